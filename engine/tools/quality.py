"""What reduced numbers cost in quality, measured against the float32 engine.

    python -m engine quality [--variants float32 bfloat16 int8 int4 int4/64 gguf ...]

Two measurements per variant (a dtype, a weight-only quantization, a group size):
- teacher-forced, on a fixed text (README.md, the first `text_tokens` tokens): every position's
  next-token distribution in one forward pass; top-1 agreement = the share of positions where
  the variant's most likely next token equals float32's (raw, and with a difference excused where
  float32's own top-2 logits are within TIE_MARGIN and the variant picked the runner-up: on a
  135M model about a third of a text's positions are such near ties, and bfloat16 alone flips a
  few percent of them); perplexity = exp(mean cross-entropy of
  the text's real next tokens); mean KL(float32 ‖ variant) of the next-token distributions.
- greedy generation through the engine itself: the first `max_tokens` tokens for a few prompts;
  token agreement = the share of positions where the variant wrote float32's token (after the
  first difference the texts usually part, so the first divergence is reported too).

Plus two demonstrations of real loss that the default model hides (its float32 artifact was
itself dequantized from Q4_1, so int4 at group 32 lands back on nearly the same numbers):
`outlier_demo` (int8 per channel on a matrix with a few outlier weights) and larger int4 groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.worker.quantization import DEFAULT_GROUP_SIZE

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TEXT = REPO_ROOT / "README.md"
DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "A paged KV cache stores keys and values in",
    "Once upon a time, in a small village,",
)
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Variant:
    dtype: str = "float32"
    quantization: str | None = None
    group_size: int = DEFAULT_GROUP_SIZE

    @property
    def name(self) -> str:
        if self.quantization is None:
            return self.dtype
        group = f"/{self.group_size}" if self.quantization == "int4" else ""
        prefix = "" if self.dtype == "float32" else f"{self.dtype}+"
        return f"{prefix}{self.quantization}{group}"

    @classmethod
    def parse(cls, text: str) -> "Variant":
        """'float32', 'bfloat16', 'int8', 'int4', 'int4/64', 'gguf', 'bfloat16+int8'."""
        dtype, _, rest = text.partition("+")
        if dtype in ("int8", "int4", "gguf") or dtype.startswith("int4/"):
            dtype, rest = "float32", text
        method, _, group = rest.partition("/")
        return cls(dtype, method or None, int(group) if group else DEFAULT_GROUP_SIZE)


REFERENCE = Variant()
DEFAULT_VARIANTS = tuple(
    Variant.parse(v) for v in ("bfloat16", "int8", "bfloat16+int8", "int4", "int4/64", "gguf")
)


def load_variant(model_dir, variant: Variant, device="cpu", kernels: str = "auto"):
    """The engine's model (a LlamaModel) for this variant, loaded the way an engine loads it."""
    from engine.models.config import LlamaConfig
    from engine.worker import worker
    from engine.worker.quantization import check_quantization
    from engine.worker.worker import load_quantized_model

    device = torch.device(device)
    dtype = worker.resolve_dtype(variant.dtype, device)
    check_quantization(
        variant.quantization,
        variant.group_size,
        device,
        LlamaConfig.from_model_dir(model_dir),
        model_dir,
    )
    if variant.quantization:
        model = load_quantized_model(
            model_dir, device, dtype, variant.quantization, variant.group_size
        )
    else:
        model = worker.load_model(model_dir, device, dtype)
    return model.with_kernels(kernels)


def text_token_ids(tokenizer, text: str | None = None, max_tokens: int = 256) -> list[int]:
    text = DEFAULT_TEXT.read_text(encoding="utf-8") if text is None else text
    return tokenizer.encode(text)[:max_tokens]


@torch.inference_mode()
def teacher_forced_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Logits [n, vocab] (float32) at every position of `token_ids`, one prefill on a fresh
    paged cache: position i holds the model's distribution for token i + 1."""
    from engine.layers.attention import build_attention_metadata

    n = len(token_ids)
    blocks = -(-n // BLOCK_SIZE)
    cache = model.allocate_kv_cache(blocks, BLOCK_SIZE)
    meta = build_attention_metadata([n], [0], [list(range(blocks))], BLOCK_SIZE, model.device)
    ids = torch.tensor(token_ids, device=model.device)
    positions = torch.arange(n, device=model.device)
    logits = model.forward(ids, positions, cache, meta, torch.arange(n, device=model.device))
    return logits.float().cpu()


# The project's near-tie rule for bfloat16 comparisons (engine/tools/selfcheck.py TIE_MARGIN): where
# float32's own top-2 logits are closer than this, picking its runner-up is a tie, not an error.
TIE_MARGIN = 0.5


def compare_logits(
    reference: torch.Tensor, logits: torch.Tensor, token_ids: list[int], tie_margin=TIE_MARGIN
) -> dict:
    """Top-1 agreement with the reference (raw, and with differences at the reference's near ties
    excused), perplexity of the text, mean KL(reference ‖ variant)."""
    targets = torch.tensor(token_ids[1:])
    ref, out = reference[:-1], logits[:-1]
    same = ref.argmax(-1) == out.argmax(-1)
    agree = same.float().mean().item()
    top2 = ref.topk(2, dim=-1)
    near = (top2.values[:, 0] - top2.values[:, 1]) < tie_margin
    runner_up = out.argmax(-1) == top2.indices[:, 1]
    excused = same | (near & runner_up)
    ref_logp, out_logp = F.log_softmax(ref, -1), F.log_softmax(out, -1)
    kl = (ref_logp.exp() * (ref_logp - out_logp)).sum(-1).mean().item()
    return {
        "positions": len(targets),
        "top1_agreement": agree,
        "top1_agreement_outside_ties": excused.float().mean().item(),
        "near_ties": int(near.sum()),
        "perplexity": math.exp(F.cross_entropy(out, targets).item()),
        "reference_perplexity": math.exp(F.cross_entropy(ref, targets).item()),
        "kl_mean": kl,
    }


def greedy_tokens(
    model_dir,
    variant: Variant,
    prompts: list[list[int]],
    max_tokens: int = 64,
    device: str = "cpu",
    kernels: str = "auto",
) -> list[list[int]]:
    """The first `max_tokens` greedy tokens of each prompt (ignore_eos), through the engine."""
    from engine.entrypoints.llm import LLM
    from engine.sampling_params import SamplingParams

    longest = max(len(p) for p in prompts) + max_tokens
    llm = LLM(
        model=str(model_dir),
        device=device,
        dtype=variant.dtype,
        quantization=variant.quantization,
        quantization_group_size=variant.group_size,
        kernels=kernels,
        num_kv_blocks=len(prompts) * (-(-longest // BLOCK_SIZE)) + 4,
        max_model_len=longest + BLOCK_SIZE,
        enable_prefix_caching=False,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [list(o.token_ids) for o in outputs]


def greedy_agreement(reference: list[list[int]], ours: list[list[int]]) -> dict:
    """Share of positions with the same token; where each pair first differs (None: never)."""
    same = total = 0
    first = []
    for a, b in zip(reference, ours):
        n = min(len(a), len(b))
        same += sum(x == y for x, y in zip(a[:n], b[:n]))
        total += n
        first.append(next((i for i in range(n) if a[i] != b[i]), None))
    return {
        "token_agreement": same / total if total else None,
        "first_divergence": first,
        "identical": sum(f is None for f in first),
        "prompts": len(first),
    }


def evaluate(
    model_dir=None,
    variants=DEFAULT_VARIANTS,
    text: str | None = None,
    text_tokens: int = 256,
    prompts=DEFAULT_PROMPTS,
    max_tokens: int = 64,
    device: str = "cpu",
    greedy: bool = True,
    log=lambda msg: None,
) -> dict:
    """Every variant against float32: teacher-forced on the text, greedy on the prompts."""
    from engine.artifact import resolve_model_path
    from engine.tokenizer import Tokenizer
    from engine.worker.quantization import decode_bytes_per_step

    model_dir = resolve_model_path(model_dir)
    tokenizer = Tokenizer(model_dir)
    ids = text_token_ids(tokenizer, text, text_tokens)
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    log(f"float32 reference: {len(ids)} text tokens, {len(prompt_ids)} prompts")
    reference = load_variant(model_dir, REFERENCE, device)
    ref_logits = teacher_forced_logits(reference, ids)
    ref_tokens = []
    if greedy:
        ref_tokens = greedy_tokens(model_dir, REFERENCE, prompt_ids, max_tokens, device)
    rows = [
        {
            "variant": REFERENCE.name,
            "weight_bytes_per_step": decode_bytes_per_step(reference),
            **compare_logits(ref_logits, ref_logits, ids),
            **({"greedy": greedy_agreement(ref_tokens, ref_tokens)} if greedy else {}),
        }
    ]
    for variant in variants:
        log(f"{variant.name}")
        model = load_variant(model_dir, variant, device)
        row = {
            "variant": variant.name,
            "weight_bytes_per_step": decode_bytes_per_step(model),
            **compare_logits(ref_logits, teacher_forced_logits(model, ids), ids),
        }
        if greedy:
            tokens = greedy_tokens(model_dir, variant, prompt_ids, max_tokens, device)
            row["greedy"] = greedy_agreement(ref_tokens, tokens)
        rows.append(row)
    return {
        "model": str(model_dir),
        "device": device,
        "text": "README.md" if text is None else "given text",
        "text_tokens": len(ids),
        "max_tokens": max_tokens,
        "rows": rows,
        "kind": "measured",
    }


def format_quality(result: dict) -> str:
    lines = [
        f"Quality against float32 ({Path(result['model']).name}, {result['device']}): teacher-"
        f"forced on {result['text']} ({result['text_tokens']} tokens), greedy "
        f"{result['max_tokens']} tokens per prompt",
        f"  {'variant':<16}{'MB/step':>9}{'top-1 agree':>13}{'excl. ties':>12}{'perplexity':>12}"
        f"{'KL':>9}{'greedy agree':>14}{'first diff':>16}",
    ]
    for r in result["rows"]:
        g = r.get("greedy")
        greedy = f"{100 * g['token_agreement']:13.1f}%" if g else f"{'—':>14}"
        first = ",".join("—" if f is None else str(f) for f in g["first_divergence"]) if g else ""
        lines.append(
            f"  {r['variant']:<16}{r['weight_bytes_per_step'] / 1e6:9.1f}"
            f"{100 * r['top1_agreement']:12.1f}%{100 * r['top1_agreement_outside_ties']:11.1f}%"
            f"{r['perplexity']:12.2f}{r['kl_mean']:9.4f}"
            f"{greedy}{first:>16}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Where quantization visibly loses


def outlier_demo(rows: int = 64, cols: int = 256, outliers: int = 4, seed: int = 0) -> dict:
    """int8 per output channel on a matrix whose few rows hold one outlier weight each (column 0,
    100 × a typical weight): the outlier sets its row's scale, so every ordinary weight of that
    row is rounded on a grid 100 × coarser. int4 with groups of 32 confines the damage to the
    outlier's own group. RMS errors of the ordinary weights: in clean rows, in outlier rows next
    to the outlier (columns 1..31) and in outlier rows away from it (columns 32..)."""
    from engine.kernels.quant import dequantize, quantize_int4, quantize_int8

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * 0.02
    hit = torch.randperm(rows, generator=gen)[:outliers]
    w[hit, 0] = 2.0
    clean = torch.ones(rows, dtype=torch.bool)
    clean[hit] = False

    def rms(x: torch.Tensor) -> float:
        return x.pow(2).mean().sqrt().item()

    out = {"weight_rms": rms(w[clean]), "outlier": 2.0}
    for name, qw in (("int8", quantize_int8(w)), ("int4/32", quantize_int4(w, 32))):
        err = dequantize(qw) - w
        out[name] = {
            "rms_clean_rows": rms(err[clean]),
            "rms_near_outlier": rms(err[hit, 1:32]),
            "rms_far_from_outlier": rms(err[hit, 32:]),
            "bits_per_weight": 8 * qw.nbytes() / w.numel(),
        }
    return out
