"""Shared fixtures: the repo on sys.path, a tiny random Llama artifact, the real default artifact
and one transformers reference model shared by every slow test."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from engine.artifact import ArtifactError, default_artifact_path, validate_model_dir  # noqa: E402

# Files of the real artifact that the tiny one borrows (tokenizer + chat template).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")

# The tiny model: small enough that transformers and the engine both run it in milliseconds,
# shaped like the real one (GQA with 2 query heads per kv head, tied embeddings, explicit
# head_dim) and with a non-default rope theta so that ignoring the config's rope would show.
TINY_CONFIG = dict(
    vocab_size=49152,
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


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real SmolLM2-135M-Instruct artifact (built by `./run.sh test` before pytest starts)."""
    path = default_artifact_path()
    try:
        validate_model_dir(path)
    except ArtifactError as exc:
        pytest.skip(f"default artifact not usable ({exc}); build it with: python -m engine artifact build")
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A randomly initialised 2-layer Llama saved as an artifact directory (seeded, reproducible).

    Weights are written with safetensors directly (as the default artifact's build does) with the
    tied lm_head left out; the tokenizer files are copied from the real artifact, which is why
    the vocabulary is the real 49152 (only ~3M parameters at hidden size 64)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(**TINY_CONFIG)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norm weights default to exactly 1; make them matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    state = {name: t.detach().contiguous().clone() for name, t in model.state_dict().items()}
    state.pop("lm_head.weight", None)  # tied to model.embed_tokens.weight
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config_dict = config.to_dict()
    config_dict["architectures"] = ["LlamaForCausalLM"]
    config_dict["torch_dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True))
    for name in TOKENIZER_FILES:
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, path / name)
    validate_model_dir(path)
    return path


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
