"""Turning logits into the next token: greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

Each row of the logits belongs to one request and is processed with that request's parameters.
A seeded request draws from its own torch.Generator, so its output does not depend on which other
requests share the batch (or on how many random numbers they drew).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None = None  # of the chosen token, under the unmodified distribution
    top_logprobs: dict[int, float] | None = None


class Sampler:
    def __init__(self):
        self.generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[SampleResult]:
        """logits: [num_reqs, vocab] float32, one row per request that produces a token."""
        results = []
        greedy_ids = logits.argmax(dim=-1).tolist()
        want_logprobs = any(p.logprobs is not None for p in params)
        logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        for row, (request_id, p) in enumerate(zip(request_ids, params)):
            token = greedy_ids[row] if p.greedy else self._sample_row(logits[row], request_id, p)
            result = SampleResult(token)
            if p.logprobs is not None:
                row_lp = logprobs[row]
                result.logprob = row_lp[token].item()
                if p.logprobs > 0:
                    top = row_lp.topk(p.logprobs)
                    result.top_logprobs = dict(zip(top.indices.tolist(), top.values.tolist()))
                else:
                    result.top_logprobs = {}
            results.append(result)
        return results

    def _sample_row(self, logits: torch.Tensor, request_id: str, p: SamplingParams) -> int:
        probs = self.probabilities(logits, p)
        generator = None
        if p.seed is not None:
            generator = self.generators.get(request_id)
            if generator is None:
                generator = torch.Generator(device=logits.device).manual_seed(p.seed)
                self.generators[request_id] = generator
        return int(torch.multinomial(probs, 1, generator=generator))

    @staticmethod
    def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        """The distribution actually sampled from, after temperature and the three filters."""
        logits = logits.float() / p.temperature
        if p.top_k > 0 and p.top_k < logits.numel():
            kth = logits.topk(p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:  # keep the smallest set of tokens whose mass reaches top_p
            sorted_probs, order = probs.sort(descending=True)
            mass_before = sorted_probs.cumsum(0) - sorted_probs
            sorted_probs[mass_before >= p.top_p] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        if p.min_p > 0.0:  # drop tokens less likely than min_p × the most likely one
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return probs / probs.sum()
