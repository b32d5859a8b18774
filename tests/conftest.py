"""Shared fixtures: the repo on sys.path, a tiny random Llama artifact, the real default artifact
and one transformers reference model shared by every slow test."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from _browser import SHARED as SHARED_SERVER  # noqa: E402
from _tiny import TINY_VOCAB_SIZE, write_tiny_model, write_tiny_tokenizer  # noqa: E402

from engine.artifact import ArtifactError, default_artifact_path, validate_model_dir  # noqa: E402

# The tiny model: small enough that transformers and the engine both run it in milliseconds,
# shaped like the real one (GQA with 2 query heads per kv head, tied embeddings, explicit
# head_dim) and with a non-default rope theta so that ignoring the config's rope would show.
# Its tokenizer is trained on this repository's text (tests/_tiny.py), so no fast test needs the
# real artifact.
TINY_CONFIG = dict(
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    rope_theta=1000.0,
    tie_word_embeddings=True,
    # The default std 0.02 makes nearly uniform logits (every comparison a near tie); 0.2 gives
    # logits with a spread of a few units, so argmax and relative-error checks mean something.
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


@pytest.fixture(autouse=True, scope="module")
def _release_app_engines():
    """When a test module ends, release every engine its AppTest sessions registered in the
    process-wide classroom registry (ui/registry.py), as the reaper does for closed tabs: engines
    of earlier modules never fill the registry's caps for later ones (a page would then show
    "교실이 가득 찼습니다" instead of its lab), and tensor-parallel worker processes stop."""
    yield
    registry_module = sys.modules.get("ui.registry")
    registry = getattr(registry_module, "_registry", None)
    if registry is not None:
        for session_id in registry.session_ids():
            registry.release_session(session_id, trim=False)


@pytest.fixture(scope="module")
def shared_app_url(default_model_dir, tmp_path_factory) -> str:
    """The URL of the one `streamlit run app.py` the browser modules share (tests/_browser.py,
    SharedServer): started by the first module that asks, stopped by the hook below once the next
    test does not ask for it. Module-scoped (the server itself outlives the module) so that a
    module always gets the server that runs now."""
    return SHARED_SERVER.start(tmp_path_factory.getbasetemp() / "streamlit_shared")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop the shared Streamlit server right after the last test of a run of tests that use it
    (their module-scoped pages are closed by then), so it never idles behind the other tests."""
    try:
        return (yield)
    finally:
        if SHARED_SERVER.running and (
            "shared_app_url" not in getattr(nextitem, "fixturenames", ())
        ):
            SHARED_SERVER.stop()


def pytest_sessionfinish(session, exitstatus):
    SHARED_SERVER.stop()


def machine_line() -> str:
    """The CPU the run measured on (its timing tests' numbers depend on it): /proc/cpuinfo's model
    name, family and model, the vector ISA our kernels target, the L3 size, the logical CPUs."""
    import platform

    from engine.kernels import cpu_isa

    facts: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            facts.setdefault(key.strip(), value.strip())
        l3 = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        l3 = "?"
    name = facts.get("model name", platform.machine())
    family = f"family {facts.get('cpu family', '?')} model {facts.get('model', '?')}"
    return f"{name}, {family}, {cpu_isa()}, L3 {l3}, {os.cpu_count()} logical CPUs"


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"machine: {machine_line()}")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real SmolLM2-135M-Instruct artifact (built by `./run.sh test` before pytest starts)."""
    path = default_artifact_path()
    try:
        validate_model_dir(path)
    except ArtifactError as exc:
        pytest.skip(
            f"default artifact not usable ({exc}); build it with: python -m engine artifact build"
        )
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A randomly initialised 2-layer Llama saved as an artifact directory (seeded, reproducible),
    with the tied lm_head left out of the weights file as the default artifact's build does."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama")
    vocab_size = write_tiny_tokenizer(path)
    config = LlamaConfig(**{**TINY_CONFIG, "vocab_size": vocab_size})
    config.architectures = ["LlamaForCausalLM"]
    write_tiny_model(path, config)
    validate_model_dir(path)
    return path


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2-style model: q/k/v projections with bias, untied lm_head (the loader claims
    Qwen2 directories, so a test must load one)."""
    from transformers import Qwen2Config

    path = tmp_path_factory.mktemp("tiny-qwen2")
    vocab_size = write_tiny_tokenizer(path)
    config = Qwen2Config(
        **{
            **TINY_CONFIG,
            "vocab_size": vocab_size,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
        }
    )
    config.architectures = ["Qwen2ForCausalLM"]
    write_tiny_model(path, config, seed=1)
    validate_model_dir(path)
    return path


@pytest.fixture(scope="module")
def make_engine(tiny_model_dir):
    """A factory of EngineCores on the tiny model (small KV cache, CPU); overrides per call."""
    from engine.core import EngineConfig, EngineCore

    def make(**overrides) -> EngineCore:
        config = dict(
            model=str(tiny_model_dir),
            device="cpu",
            num_kv_blocks=64,
            max_model_len=256,
            block_size=16,
        )
        config.update(overrides)
        return EngineCore(EngineConfig(**config))

    return make


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from engine.tokenizer import Tokenizer

    return Tokenizer(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_dir):
    """transformers' own LlamaForCausalLM loaded from the tiny artifact, float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_reference(default_model_dir):
    """transformers' model for the real artifact in float32: the oracle. Loaded once (slow)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from engine.tokenizer import Tokenizer

    return Tokenizer(default_model_dir)


@pytest.fixture(scope="session")
def ext():
    """Our compiled C++ kernels (engine/kernels), built once per session; a test that needs them
    skips with the reason when they cannot build."""
    from engine import kernels

    module = kernels.load()
    if module is None:
        pytest.skip(f"C++ kernels unavailable: {kernels.build_error()}")
    return module
