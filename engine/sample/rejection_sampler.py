"""Verification: which draft tokens the target model accepts, and the token it adds itself.

The model ran once on [last token, d1, ..., dk], so row j of the logits is the target model's
distribution for the token after d_j (row 0: after the last real token). Walking the drafts in
order:

- greedy: accept d_{j+1} while it equals row j's argmax. At the first mismatch the argmax itself
  is the next token; if all k are accepted, row k's argmax is a free extra ("bonus") token.
  The output is exactly what plain greedy decoding would produce, one token per forward.
- sampling (Leviathan et al. 2023; Chen et al. 2023): accept a draft x drawn from q with
  probability min(1, p(x)/q(x)); on rejection, draw from normalize(max(0, p - q)). An n-gram draft
  is deterministic, so q is a point mass on x: accept with probability p(x), and on rejection draw
  from p with x removed. Either way each emitted token is distributed exactly as p, the target
  model's own distribution (after temperature, top-k, top-p, min-p).

Every call emits between 1 and k + 1 tokens: the accepted drafts, then one token of the target's.
"""

from __future__ import annotations

import torch

from engine.sample.sampler import Sampler
from engine.sampling_params import SamplingParams


class RejectionSampler:
    def __init__(self) -> None:
        self.generators: dict[str, torch.Generator] = {}  # seeded requests draw from their own

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def __call__(
        self,
        logits: torch.Tensor,
        draft_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
    ) -> list[int]:
        """logits: [len(draft_token_ids) + 1, vocab], one row per verified position."""
        if params.greedy:
            return verify_greedy(logits.argmax(dim=-1).tolist(), draft_token_ids)
        return self._verify_sampled(logits, draft_token_ids, params, request_id)

    def _verify_sampled(
        self,
        logits: torch.Tensor,
        draft_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
    ) -> list[int]:
        generator = self._generator(request_id, params, logits.device)
        tokens = []
        for row, draft in enumerate(draft_token_ids):
            p = Sampler.probabilities(logits[row], params)
            u = torch.rand((), generator=generator, device=p.device)
            if u < p[draft]:  # accepted with probability min(1, p(x) / q(x)) = p(x)
                tokens.append(draft)
                continue
            residual = p.clone()  # max(0, p - q) with q a point mass on the draft
            residual[draft] = 0.0
            tokens.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
            return tokens
        p = Sampler.probabilities(logits[len(draft_token_ids)], params)  # all accepted: the bonus
        tokens.append(int(torch.multinomial(p, 1, generator=generator)))
        return tokens

    def _generator(self, request_id: str, params: SamplingParams, device) -> torch.Generator | None:
        if params.seed is None:
            return None
        if request_id not in self.generators:
            self.generators[request_id] = torch.Generator(device=device).manual_seed(params.seed)
        return self.generators[request_id]


def verify_greedy(target_token_ids: list[int], draft_token_ids: list[int]) -> list[int]:
    """The longest prefix of drafts that match the target's argmax, then the target's own token."""
    tokens = []
    for target, draft in zip(target_token_ids, draft_token_ids):
        if draft != target:
            break
        tokens.append(draft)
    tokens.append(target_token_ids[len(tokens)])
    return tokens
