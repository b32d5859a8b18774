"""A minimal block manager + step runner for driving LlamaModel.forward from tests.

It plays the part the scheduler and KV-cache manager will play in the engine: it hands out
physical blocks (optionally in shuffled order, so block tables are non-contiguous), tracks how
many tokens of each request are already in the cache, and builds one flat batch per step."""

from __future__ import annotations

import random

import torch

from engine.layers.attention import build_attention_metadata


class PagedRunner:
    def __init__(self, model, num_blocks: int, block_size: int, shuffle_seed: int | None = None):
        self.model = model
        self.block_size = block_size
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size)
        self.free = list(range(num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(self.free)
        self.tables: dict = {}
        self.num_computed: dict = {}

    def fill_garbage(self, seed: int = 0, scale: float = 50.0) -> None:
        """Put large finite junk in every cache slot, as blocks freed by earlier requests hold."""
        g = torch.Generator().manual_seed(seed)
        for k, v in self.kv_caches:
            for t in (k, v):
                t.copy_((torch.randn(t.shape, generator=g) * scale).to(t.dtype))

    def _ensure_blocks(self, key, total_tokens: int) -> None:
        table = self.tables.setdefault(key, [])
        while len(table) * self.block_size < total_tokens:
            table.append(self.free.pop(0))

    def release(self, key) -> None:
        self.free.extend(self.tables.pop(key))
        self.num_computed.pop(key, None)

    def step(
        self, pieces: list[tuple[object, list[int]]], all_logits: bool = False
    ) -> list[torch.Tensor]:
        """Run one flat batch. `pieces`: (request key, new token ids) in batch order; the new
        tokens continue that request after the tokens it already has in the cache. Returns, per
        piece, logits [vocab] of its last token, or [n, vocab] for all its tokens if all_logits."""
        ids, positions, query_lens, computed, tables, rows = [], [], [], [], [], []
        row = 0
        for key, tokens in pieces:
            start = self.num_computed.get(key, 0)
            self._ensure_blocks(key, start + len(tokens))
            ids += tokens
            positions += range(start, start + len(tokens))
            query_lens.append(len(tokens))
            computed.append(start)
            tables.append(self.tables[key])
            rows.append(
                list(range(row, row + len(tokens))) if all_logits else [row + len(tokens) - 1]
            )
            row += len(tokens)
        meta = build_attention_metadata(
            query_lens, computed, tables, self.block_size, device=self.model.device
        )
        flat_rows = [r for rs in rows for r in rs]
        logits = self.model.forward(
            torch.tensor(ids, device=self.model.device),
            torch.tensor(positions, device=self.model.device),
            self.kv_caches,
            meta,
            torch.tensor(flat_rows, device=self.model.device),
        ).cpu()
        for key, tokens in pieces:
            self.num_computed[key] = self.num_computed.get(key, 0) + len(tokens)
        out, i = [], 0
        for rs in rows:
            chunk = logits[i : i + len(rs)]
            out.append(chunk if all_logits else chunk[0])
            i += len(rs)
        return out


def blocks_needed(lengths: list[int], block_size: int) -> int:
    return sum(-(-n // block_size) for n in lengths)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Worst row of max|ours - ref| / max|ref| (rows = positions)."""
    ours, ref = ours.float().reshape(-1, ours.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
    return ((ours - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item()


def greedy_alone(model, prompt: list[int], max_new_tokens: int, block_size: int = 16) -> list[int]:
    """Prefill the whole prompt, then decode one token per step; never stops at EOS."""
    runner = PagedRunner(
        model, blocks_needed([len(prompt) + max_new_tokens], block_size), block_size
    )
    (logits,) = runner.step([("r", prompt)])
    out = [int(logits.argmax())]
    while len(out) < max_new_tokens:
        (logits,) = runner.step([("r", [out[-1]])])
        out.append(int(logits.argmax()))
    return out


def greedy_batched(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    chunk: int = 64,
    long_prompt: int = 128,
    block_size: int = 16,
    shuffle_seed: int | None = 0,
) -> tuple[list[list[int]], list[list[int]]]:
    """All prompts in one flat batch per step. At the first step every prompt of at most
    `long_prompt` tokens is prefilled whole; a longer one is prefilled in chunks of `chunk`
    tokens, one per step, while the others contribute one decode token each. Returns the outputs
    and, per step, the query lengths of the batch (for the test to check the mixing happened)."""
    total = blocks_needed([len(p) + max_new_tokens for p in prompts], block_size)
    runner = PagedRunner(model, total, block_size, shuffle_seed=shuffle_seed)
    outputs: list[list[int]] = [[] for _ in prompts]
    schedule: list[list[int]] = []
    while any(len(o) < max_new_tokens for o in outputs):
        pieces, owners = [], []
        for i, prompt in enumerate(prompts):
            if len(outputs[i]) >= max_new_tokens:
                continue
            done = runner.num_computed.get(i, 0)
            if done < len(prompt):
                size = chunk if len(prompt) > long_prompt else len(prompt)
                pieces.append((i, prompt[done : done + size]))
            else:
                pieces.append((i, [outputs[i][-1]]))
            owners.append(i)
        schedule.append([len(t) for _, t in pieces])
        for i, logits in zip(owners, runner.step(pieces)):
            if runner.num_computed[i] >= len(prompts[i]):  # prompt fully in cache: a real sample
                outputs[i].append(int(logits.argmax()))
        for i in owners:
            if len(outputs[i]) >= max_new_tokens:
                runner.release(i)
    return outputs, schedule
