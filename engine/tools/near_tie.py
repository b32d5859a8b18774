"""The project's near-tie rule for greedy outputs (from engine/tools/selfcheck.py, whose oracle
it is; the bench's bfloat16-linears comparison uses it too): two greedy outputs agree when they
are equal token for token, or when they first differ where the reference's top-2 logits are
closer than the dtype's margin and the other output picked the runner-up."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

# A divergence is excused only where the reference's top-2 logits are closer than this. bfloat16
# logits of 10-30 are spaced 0.06-0.125 apart, and rounding differs between implementations.
TIE_MARGIN = {torch.float32: 1e-3, torch.bfloat16: 0.5}


@dataclass
class GreedyComparison:
    name: str
    equal: bool
    diverge_at: int | None = None  # first generated position that differs
    ours: int | None = None
    reference: int | None = None
    margin: float | None = None  # transformers' top-1 minus top-2 logit there
    near_tie: bool = False  # the divergence is excused

    @property
    def ok(self) -> bool:
        return self.equal or self.near_tie


def compare_greedy(
    hf_model, name: str, prompt_ids: list[int], ours: list[int], ref: list[int], tie_margin: float
) -> GreedyComparison:
    """Equal token for token; else a near tie of the reference at the first divergence, where
    our token must be its runner-up. After a divergence the two texts differ legitimately, so
    nothing after it is compared."""
    diverge = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if diverge is None and len(ours) == len(ref):
        return GreedyComparison(name, equal=True)
    if diverge is None:  # one is a prefix of the other: a length bug, never a tie
        return GreedyComparison(name, equal=False, diverge_at=min(len(ours), len(ref)))
    device = next(hf_model.parameters()).device
    with torch.no_grad():
        logits = (
            hf_model(torch.tensor([prompt_ids + ref[:diverge]], device=device))
            .logits[0, -1]
            .float()
        )
    top2 = logits.topk(2)
    margin = (top2.values[0] - top2.values[1]).item()
    near = margin < tie_margin and ours[diverge] in top2.indices.tolist()
    return GreedyComparison(name, False, diverge, ours[diverge], ref[diverge], margin, near)


def summarize(comparisons: list[GreedyComparison]) -> tuple[bool, str, dict]:
    """(all ok, one line, data) for a list of comparisons."""
    equal = sum(c.equal for c in comparisons)
    ties = [c for c in comparisons if c.near_tie]
    bad = [c for c in comparisons if not c.ok]
    line = f"{equal}/{len(comparisons)} identical"
    if ties:
        line += "; near ties: " + ", ".join(
            f"{c.name}@{c.diverge_at} (margin {c.margin:.1e})" for c in ties
        )
    if bad:
        line += "; MISMATCH: " + ", ".join(
            f"{c.name}@{c.diverge_at} (ours {c.ours}, ref {c.reference}"
            + (f", margin {c.margin:.2f})" if c.margin is not None else ")")
            for c in bad
        )
    return not bad, line, {"comparisons": [asdict(c) for c in comparisons]}
