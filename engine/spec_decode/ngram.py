"""The n-gram proposer (prompt lookup decoding): drafts copied from the request's own text.

Text that repeats itself (a list being repeated, code being edited, a document being quoted) is
predictable from itself: if the last few tokens appeared before, the tokens that followed them
then are a good guess for what follows now. Looking this up costs no model call at all, so a
wrong guess only costs the extra positions in the verifying forward pass.
"""

from __future__ import annotations


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int):
        self.k = num_speculative_tokens
        self.max_n = prompt_lookup_max
        self.min_n = prompt_lookup_min

    def propose(self, token_ids: list[int]) -> list[int]:
        """Up to k draft tokens for a request whose tokens so far (prompt + output) are
        `token_ids`; [] when its last n-gram never appeared before.

        Longer n-grams first: a longer match is stronger evidence that the text repeats. Among
        equal matches the earliest, as vLLM's prompt lookup takes
        (vllm/v1/spec_decode/ngram_proposer.py): the first occurrence is most often the prompt's
        original (the list or passage being copied), and taking the same match keeps this
        engine's drafts, and so its acceptance numbers, comparable with vLLM's."""
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            start = self._earliest_match(token_ids, n)
            if start is not None:
                return token_ids[start + n : start + n + self.k]
        return []

    @staticmethod
    def _earliest_match(token_ids: list[int], n: int) -> int | None:
        """Where the last n tokens first occurred (the suffix itself excluded)."""
        suffix = token_ids[-n:]
        first = suffix[0]
        for start in range(len(token_ids) - n):
            if token_ids[start] == first and token_ids[start : start + n] == suffix:
                return start
        return None
