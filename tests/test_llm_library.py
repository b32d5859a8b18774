"""`LLM` as a library user meets it: a plain script (no `if __name__ == "__main__":` guard, the
README's shape) runs tensor parallel, because the workers fork where that is safe
(engine/executor/start_method.py); where they must be spawned, such a script is refused at once
with the fix; `generate` takes vLLM's prompt dicts, `cache_salt` included."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
PROMPT_IDS = [5, 6, 7, 8, 9, 10, 11]
MAX_TOKENS = 8


def plain_script(model_dir: Path, tp: int) -> str:
    """Builds the engine at the script's top level, no guard."""
    return (
        "from engine import LLM, SamplingParams\n"
        f"llm = LLM(model={str(model_dir)!r}, device='cpu', num_kv_blocks=16, max_model_len=128,\n"
        f"          kernels='torch', tensor_parallel_size={tp})\n"
        f"params = SamplingParams(max_tokens={MAX_TOKENS}, temperature=0.0, ignore_eos=True)\n"
        f"out = llm.generate(prompt_token_ids=[{PROMPT_IDS}], sampling_params=params,\n"
        "                   use_tqdm=False)\n"
        "print('TOKENS', *out[0].token_ids, flush=True)\n"
    )


def run_script(tmp_path: Path, text: str, timeout_s: float, **env) -> subprocess.CompletedProcess:
    script = tmp_path / "plain_script.py"
    script.write_text(text)
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def tp1_tokens(model_dir: Path) -> list[int]:
    from engine import LLM

    llm = LLM(model=str(model_dir), device="cpu", num_kv_blocks=16, max_model_len=128,
              kernels="torch")  # fmt: skip
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return llm.generate(prompt_token_ids=[PROMPT_IDS], sampling_params=params, use_tqdm=False)[
        0
    ].token_ids


def test_a_plain_script_runs_tensor_parallel(tiny_model_dir, tmp_path):
    done = run_script(tmp_path, plain_script(tiny_model_dir, tp=2), timeout_s=180)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("TOKENS"))
    assert [int(t) for t in line.split()[1:]] == tp1_tokens(tiny_model_dir)


def test_a_plain_script_that_must_spawn_is_refused_at_once_with_the_fix(tiny_model_dir, tmp_path):
    start = time.monotonic()
    done = run_script(
        tmp_path,
        plain_script(tiny_model_dir, tp=2),
        timeout_s=120,
        LLM_WORKER_MULTIPROC_METHOD="spawn",
    )
    assert done.returncode != 0
    assert 'outside an `if __name__ == "__main__":` block' in done.stderr, done.stderr[-3000:]
    assert "LLM_WORKER_MULTIPROC_METHOD=spawn" in done.stderr
    assert "died" not in done.stderr  # refused before any worker started
    assert time.monotonic() - start < 120


def test_a_guarded_script_still_spawns(tiny_model_dir, tmp_path):
    body = plain_script(tiny_model_dir, tp=2).replace("\n", "\n    ")
    guarded = "if __name__ == '__main__':\n    " + body
    done = run_script(tmp_path, guarded, timeout_s=180, LLM_WORKER_MULTIPROC_METHOD="spawn")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TOKENS" in done.stdout


def test_prompt_dicts_take_a_cache_salt_that_separates_prefix_cache_hits(tiny_model_dir):
    from engine import LLM

    llm = LLM(model=str(tiny_model_dir), device="cpu", num_kv_blocks=32, max_model_len=128,
              kernels="torch")  # fmt: skip
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    ids = [5 + i % 97 for i in range(40)]  # two full 16-token blocks and a partial one
    text = llm.get_tokenizer().decode(ids)

    def cached(prompt) -> int:
        (output,) = llm.generate(prompt, params, use_tqdm=False)
        return output.metrics.num_cached_tokens

    assert cached({"prompt_token_ids": ids, "cache_salt": "alice"}) == 0
    assert cached({"prompt_token_ids": ids, "cache_salt": "bob"}) == 0  # another salt: no hit
    assert cached({"prompt_token_ids": ids}) == 0  # no salt is a salt of its own
    assert cached({"prompt_token_ids": ids, "cache_salt": "alice"}) == 32  # same salt: a hit
    assert cached({"prompt": text, "cache_salt": "carol"}) == 0  # TextPrompt
    assert cached({"prompt": text, "cache_salt": "carol"}) >= 16
    mixed = llm.generate(["plain text", {"prompt_token_ids": ids}], params, use_tqdm=False)
    assert [len(o.token_ids) for o in mixed] == [2, 2]
    with pytest.raises(ValueError, match="'multi_modal_data'"):
        llm.generate({"prompt": "x", "multi_modal_data": {}}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="needs 'prompt'"):
        llm.generate({"cache_salt": "x"}, params, use_tqdm=False)


@pytest.mark.slow  # the real model, tp 3 in a fresh process: tens of seconds on a small CPU
def test_the_readme_example_with_tensor_parallel_3_runs_as_a_plain_script(
    default_model_dir, tmp_path
):
    """The issue's script: the README's example with tensor_parallel_size=3, no guard."""
    from engine import LLM

    script = (
        "from engine import LLM, SamplingParams\n"
        f"llm = LLM(model={str(default_model_dir)!r}, device='cpu', num_kv_blocks=8,\n"
        "          max_model_len=128, kernels='torch', tensor_parallel_size=3)\n"
        "outs = llm.generate(['Hello'], SamplingParams(max_tokens=8, temperature=0.0),\n"
        "                    use_tqdm=False)\n"
        "print('TOKENS', *outs[0].token_ids, flush=True)\n"
    )
    done = run_script(tmp_path, script, timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("TOKENS"))
    llm = LLM(model=str(default_model_dir), device="cpu", num_kv_blocks=8, max_model_len=128,
              kernels="torch")  # fmt: skip
    params = SamplingParams(max_tokens=8, temperature=0.0)
    expected = llm.generate(["Hello"], params, use_tqdm=False)[0].token_ids
    assert [int(t) for t in line.split()[1:]] == expected
