"""The model artifact: numbers chapter 01 shows, the CLI, and what happens with broken folders."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import artifact
from engine.artifact import (
    ArtifactError,
    build_default_artifact,
    default_artifact_path,
    format_info,
    inspect_artifact,
    validate_model_dir,
)

REPO_ROOT = Path(__file__).resolve().parent.parent

# SmolLM2-135M: 30 layers, hidden 576, 9 query / 3 kv heads of 64, MLP 1536, vocab 49152, tied.
EXPECTED_PARAMS = {
    "embedding": 49152 * 576,  # 28,311,552 (tied: also the output layer)
    "attention": 30 * (576 * 576 * 2 + 576 * 192 * 2),  # q, o + k, v
    "mlp": 30 * 3 * 576 * 1536,  # gate, up, down
    "norm": 30 * 2 * 576 + 576,  # two per layer + final
}
TOTAL_PARAMS = 134_515_008


def run_cli(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "engine", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_line_cli_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


# ---------------------------------------------------------------------------------------------
# The default artifact's numbers


@pytest.fixture(scope="module")
def info(default_model_dir):
    return inspect_artifact(default_model_dir)


def test_expected_param_breakdown_is_self_consistent():
    assert EXPECTED_PARAMS["embedding"] == 28_311_552
    assert sum(EXPECTED_PARAMS.values()) == TOTAL_PARAMS


def test_structure_numbers(info):
    c = info.config
    assert info.num_layers == 30
    assert c["hidden_size"] == 576
    assert c["intermediate_size"] == 1536
    assert c["num_attention_heads"] == 9
    assert info.num_kv_heads == 3
    assert info.head_dim == 64
    assert info.vocab_size == 49152
    assert c["architectures"] == ["LlamaForCausalLM"]
    assert c["tie_word_embeddings"] is True
    assert info.special_tokens["eos_token"] == "<|im_end|>"


def test_params_by_kind(info):
    assert info.params_by_kind == EXPECTED_PARAMS
    assert info.num_params == TOTAL_PARAMS


def test_bytes(info):
    assert info.bytes_at("float32") == 4 * TOTAL_PARAMS == 538_060_032
    assert info.bytes_at("bfloat16") == info.bytes_at("float16") == 2 * TOTAL_PARAMS
    assert info.bytes_at("int8") == TOTAL_PARAMS
    assert info.stored_dtypes == ["F32"]
    # measured on disk: the float32 weights plus a small JSON header
    weights_file = info.file_sizes["model.safetensors"]
    assert info.bytes_at("float32") < weights_file < info.bytes_at("float32") + 1_000_000
    assert info.bytes_on_disk == sum(info.file_sizes.values())
    assert info.kv_bytes_per_token_fp32 == 2 * 30 * 3 * 64 * 4 == 46_080


def test_format_info_shows_the_numbers(info):
    text = format_info(info)
    for fragment in (
        "layers: 30",
        "hidden: 576",
        "attention heads: 9",
        "kv heads: 3",
        "head_dim: 64",
        "vocab size: 49152",
        "134,515,008",
        "28,311,552",
        "538,060,032",
        "46,080",
        "tied embeddings: True",
    ):
        assert fragment in text, fragment


def test_default_path_honours_cache_env(monkeypatch, tmp_path):
    monkeypatch.setenv("LLM_LAB_CACHE", str(tmp_path))
    assert default_artifact_path() == tmp_path / "SmolLM2-135M-Instruct"


# ---------------------------------------------------------------------------------------------
# CLI


def test_cli_info(default_model_dir):
    proc = run_cli("artifact", "info")
    assert proc.returncode == 0, proc.stderr
    assert str(default_model_dir) in proc.stdout
    assert "134,515,008" in proc.stdout and "46,080" in proc.stdout


def test_cli_path(default_model_dir):
    proc = run_cli("artifact", "path")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(default_model_dir)


def test_cli_info_on_another_model_dir(tiny_model_dir):
    proc = run_cli("artifact", "info", "--model", str(tiny_model_dir))
    assert proc.returncode == 0, proc.stderr
    assert (
        "layers: 2" in proc.stdout
        and "kv heads: 2" in proc.stdout
        and "head_dim: 16" in proc.stdout
    )


def test_cli_build_is_a_no_op_when_built(default_model_dir):
    proc = run_cli("artifact", "build")
    assert proc.returncode == 0, proc.stderr
    assert "already built" in proc.stdout


def test_cli_when_default_artifact_not_built(tmp_path):
    for action in ("info", "path"):
        proc = run_cli("artifact", action, env_extra={"LLM_LAB_CACHE": str(tmp_path)})
        assert_one_line_cli_error(proc, "not built", "python -m engine artifact build")


# ---------------------------------------------------------------------------------------------
# Broken model directories


@pytest.fixture
def good_copy(tiny_model_dir, tmp_path) -> Path:
    """A private, valid copy of the tiny artifact that a test may break."""
    dest = tmp_path / "model"
    shutil.copytree(tiny_model_dir, dest)
    validate_model_dir(dest)
    return dest


def write_safetensors_header(path: Path, header_bytes: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(header_bytes)) + header_bytes)


def break_missing_dir(d: Path) -> Path:
    shutil.rmtree(d)
    return d


def break_missing_weights(d: Path) -> Path:
    (d / "model.safetensors").unlink()
    return d


def break_missing_tokenizer(d: Path) -> Path:
    (d / "tokenizer.json").unlink()
    return d


def break_architecture(d: Path) -> Path:
    config = json.loads((d / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    config["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(config))
    return d


def break_config_json(d: Path) -> Path:
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64,')
    return d


def break_config_key(d: Path) -> Path:
    config = json.loads((d / "config.json").read_text())
    del config["num_attention_heads"]
    (d / "config.json").write_text(json.dumps(config))
    return d


def break_weights_garbage(d: Path) -> Path:
    (d / "model.safetensors").write_bytes(b"\xff" * 8 + os.urandom(64))  # absurd header length
    return d


def break_weights_header_json(d: Path) -> Path:
    write_safetensors_header(
        d / "model.safetensors", b'{"model.embed_tokens.weight": {"dtype": "F32", '
    )
    return d


def break_weights_not_safetensors(d: Path) -> Path:
    (d / "model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 538090408\n"
    )
    return d


BROKEN = {
    "missing dir": (break_missing_dir, ["not found"]),
    "missing model.safetensors": (break_missing_weights, ["model.safetensors", "missing"]),
    "missing tokenizer.json": (break_missing_tokenizer, ["tokenizer.json", "missing"]),
    "unsupported architecture": (
        break_architecture,
        ["unsupported architecture", "GPT2LMHeadModel", "LlamaForCausalLM"],
    ),
    "invalid config JSON": (break_config_json, ["config.json", "not valid JSON"]),
    "config without num_attention_heads": (break_config_key, ["num_attention_heads"]),
    "garbage safetensors": (break_weights_garbage, ["model.safetensors"]),
    "truncated safetensors header": (break_weights_header_json, ["model.safetensors"]),
    "git-lfs pointer instead of weights": (break_weights_not_safetensors, ["model.safetensors"]),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_dir_raises_one_line_artifact_error(good_copy, case):
    breaker, fragments = BROKEN[case]
    path = breaker(good_copy)
    with pytest.raises(ArtifactError) as excinfo:
        validate_model_dir(path)
    message = str(excinfo.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message
    with pytest.raises(ArtifactError):
        inspect_artifact(path)


@pytest.mark.parametrize(
    "case",
    [
        "missing dir",
        "missing model.safetensors",
        "unsupported architecture",
        "invalid config JSON",
        "garbage safetensors",
    ],
)
@pytest.mark.parametrize("action", ["info", "path"])
def test_cli_broken_dir_prints_one_error_line(good_copy, case, action):
    breaker, fragments = BROKEN[case]
    path = breaker(good_copy)
    assert_one_line_cli_error(run_cli("artifact", action, "--model", str(path)), *fragments)


@pytest.mark.parametrize("content", [b"", b"abc"], ids=["empty", "3 bytes"])
def test_too_short_safetensors_is_an_artifact_error(good_copy, content):
    (good_copy / "model.safetensors").write_bytes(content)
    with pytest.raises(ArtifactError):
        validate_model_dir(good_copy)


@pytest.mark.parametrize("which", ["safetensors header", "config.json"])
def test_non_object_json_is_an_artifact_error(good_copy, which):
    if which == "config.json":
        (good_copy / "config.json").write_text("[]")
    else:
        write_safetensors_header(good_copy / "model.safetensors", b"[]")
    with pytest.raises(ArtifactError):
        validate_model_dir(good_copy)


def test_truncated_weights_and_bad_tensor_entries_are_artifact_errors(good_copy):
    weights = good_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # an interrupted copy: header intact, data cut
    with pytest.raises(ArtifactError, match="truncated"):
        validate_model_dir(good_copy)
    write_safetensors_header(weights, b'{"x": {"dtype": "F32", "data_offsets": [0, 4]}}')
    with pytest.raises(ArtifactError, match="shape"):
        validate_model_dir(good_copy)


def test_config_without_intermediate_size_and_bad_tokenizer_config(good_copy):
    config = json.loads((good_copy / "config.json").read_text())
    del config["intermediate_size"]
    (good_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError, match="intermediate_size"):
        validate_model_dir(good_copy)
    config["intermediate_size"] = 128
    (good_copy / "config.json").write_text(json.dumps(config))
    (good_copy / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="tokenizer_config.json"):
        validate_model_dir(good_copy)


# ---------------------------------------------------------------------------------------------
# Building


def test_build_is_a_no_op_when_valid(default_model_dir):
    weights = default_model_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    logs: list[str] = []
    t0 = time.perf_counter()
    assert build_default_artifact(default_model_dir, log=logs.append) == default_model_dir
    assert time.perf_counter() - t0 < 5.0
    assert weights.stat().st_mtime_ns == mtime
    assert any("already built" in line for line in logs)
    assert not any(
        p.name.startswith(f".{default_model_dir.name}.") for p in default_model_dir.parent.iterdir()
    )


@pytest.fixture
def fake_conversion(monkeypatch, tmp_path, tiny_model_dir):
    """Replace the slow GGUF dequantization with loading the tiny artifact, so the real
    build_default_artifact (temp dir, writing, validation, atomic rename) runs in a second."""
    import transformers

    real_model, real_config, real_tok = (
        transformers.AutoModelForCausalLM,
        transformers.AutoConfig,
        transformers.AutoTokenizer,
    )
    calls = {"model": 0, "fail": None}

    class FakeModel:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            calls["model"] += 1
            if calls["fail"]:
                raise calls["fail"]
            return real_model.from_pretrained(tiny_model_dir, dtype=kwargs.get("dtype"))

    class FakeConfig:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            return real_config.from_pretrained(tiny_model_dir)

    class FakeTokenizer:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            return real_tok.from_pretrained(tiny_model_dir)

    fake_gguf = tmp_path / "fake.gguf"
    fake_gguf.write_bytes(b"GGUF" + b"\0" * 60)
    monkeypatch.setattr(artifact, "find_gguf", lambda: fake_gguf)
    monkeypatch.setattr(transformers, "AutoModelForCausalLM", FakeModel)
    monkeypatch.setattr(transformers, "AutoConfig", FakeConfig)
    monkeypatch.setattr(transformers, "AutoTokenizer", FakeTokenizer)
    return calls


def leftovers(dest: Path) -> list[Path]:
    return [p for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}.")]


def test_build_writes_a_valid_artifact_atomically(fake_conversion, tmp_path, tiny_model_dir):
    import torch
    from _paged import PagedRunner

    from engine.models.llama import LlamaModel

    dest = tmp_path / "cache" / "Tiny"
    logs: list[str] = []
    assert build_default_artifact(dest, log=logs.append) == dest
    config = validate_model_dir(dest)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "SOURCE.txt"):
        assert (dest / name).is_file(), name
    assert leftovers(dest) == []
    assert "artifact ready" in logs[-1]
    # the written weights are the source's weights
    outs = []
    for d in (tiny_model_dir, dest):
        runner = PagedRunner(LlamaModel.from_pretrained(d), 2, 16)
        outs.append(runner.step([("x", [5, 6, 7, 8, 9])])[0])
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    # a second build sees a valid artifact and converts nothing
    assert build_default_artifact(dest, log=logs.append) == dest
    assert fake_conversion["model"] == 1


def test_interrupted_build_leaves_nothing_behind(fake_conversion, tmp_path):
    dest = tmp_path / "cache" / "Tiny"
    fake_conversion["fail"] = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        build_default_artifact(dest, log=lambda *_: None)
    assert not dest.exists()
    assert leftovers(dest) == []


def test_two_builds_at_once_keep_the_first(fake_conversion, tmp_path, tiny_model_dir, monkeypatch):
    """The app and the tests started together both build; the second rename finds the first's
    artifact in place (os.replace cannot replace a non-empty directory) and keeps it."""
    dest = tmp_path / "cache" / "Tiny"
    real_validate = artifact.validate_model_dir

    def other_process_finishes_first(path):
        if not dest.exists():
            shutil.copytree(tiny_model_dir, dest)
        return real_validate(path)

    monkeypatch.setattr(artifact, "validate_model_dir", other_process_finishes_first)
    logs: list[str] = []
    assert build_default_artifact(dest, log=logs.append) == dest
    assert any("another process built" in line for line in logs)
    assert leftovers(dest) == []
    real_validate(dest)


def test_build_replaces_an_invalid_artifact(fake_conversion, tmp_path, tiny_model_dir):
    dest = tmp_path / "cache" / "Tiny"
    shutil.copytree(tiny_model_dir, dest)
    (dest / "model.safetensors").unlink()
    logs: list[str] = []
    build_default_artifact(dest, log=logs.append)
    assert any(
        "rebuilding invalid artifact" in line and "model.safetensors" in line for line in logs
    )
    validate_model_dir(dest)
    assert fake_conversion["model"] == 1


def test_leftover_temp_dir_is_not_an_artifact(tmp_path, tiny_model_dir):
    """What an interrupted build could leave (the temp sibling, with weights not yet written)
    is never taken for the artifact: the real name does not exist and the temp dir is invalid."""
    dest = tmp_path / "SmolLM2-135M-Instruct"
    partial = tmp_path / ".SmolLM2-135M-Instruct.abc123"
    partial.mkdir()
    shutil.copy(tiny_model_dir / "config.json", partial / "config.json")
    with pytest.raises(ArtifactError, match="missing"):
        validate_model_dir(partial)
    with pytest.raises(ArtifactError, match="not found"):
        validate_model_dir(dest)
