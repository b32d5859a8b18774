"""Tiny model artifacts for fast tests, built from nothing but this repository.

A tiny model needs a tokenizer. Borrowing the real artifact's would make every fast test depend
on the 135M model being built, so a small byte-level BPE tokenizer (SmolLM2's special tokens
and ChatML template, like the real one) is trained on a snapshot of the repository's own text
(tests/data/tiny_tokenizer_corpus.txt) instead.
Byte-level BPE covers every string, Korean and emoji included, and every id decodes to bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

TINY_VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


CORPUS = Path(__file__).resolve().parent / "data" / "tiny_tokenizer_corpus.txt"


def training_text() -> list[str]:
    """Korean lessons, English code and docs (a frozen snapshot, so that editing the lessons or
    the engine never changes the tiny tokenizer and with it the tiny model's greedy text)."""
    return CORPUS.read_text(encoding="utf-8").split("\n\n")


def write_tiny_tokenizer(path: Path) -> int:
    """Train and write tokenizer.json, tokenizer_config.json, chat_template.jinja. Returns the
    vocabulary size (the tiny model's vocab_size must equal it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1024,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return tokenizer.get_vocab_size()


def write_tiny_model(path: Path, hf_config, seed: int = 0) -> None:
    """Save a seeded random transformers model (config `hf_config`) as an artifact directory."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():  # norm weights default to exactly 1; make them matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
    state = {name: t.detach().contiguous().clone() for name, t in model.state_dict().items()}
    if hf_config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config_dict = hf_config.to_dict()
    config_dict["torch_dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True))


def run_engine(engine, max_steps: int = 2000):
    """Step an EngineCore until idle: (records, final outputs by id, streamed text by id)."""
    records, final, streamed = [], {}, {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return records, final, streamed
        record = engine.step()
        records.append(record)
        for out in record.outputs:
            streamed[out.request_id] = streamed.get(out.request_id, "") + out.delta_text
            if out.finished:
                final[out.request_id] = out
    raise AssertionError(f"engine still busy after {max_steps} steps")
