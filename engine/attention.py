"""Paged attention: K/V live in fixed-size blocks, requests find theirs through block tables.

Per layer the cache is two tensors of shape [num_blocks, block_size, num_kv_heads, head_dim].
A token's K/V go to one *slot* (block_id * block_size + offset in block); a request's context is
the concatenation of the blocks listed in its block table. Nothing here needs the blocks of one
request to be contiguous: that is the whole point of paging (chapter 06).

A step's batch is flat (vLLM style): all scheduled tokens of all requests in one sequence. A
request contributes either one decode token or a prefill chunk that may start at any offset of its
prompt (chunked prefill). Decode requests are attended to together in one padded call; prefill
chunks one request at a time, each with its own causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """One request's prefill chunk inside the flat batch."""

    token_start: int  # first row of this chunk in the flat batch
    num_tokens: int  # tokens of this chunk
    context_len: int  # tokens in the cache after this step (already cached + this chunk)
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] physical blocks in order
    mask: torch.Tensor | None  # [num_tokens, context_len] bool, None when plain causal


@dataclass
class AttentionMetadata:
    """Everything attention needs about a step, built once and shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V are written
    block_size: int
    decode_rows: torch.Tensor  # [num_decodes] rows of the flat batch that are decode tokens
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks]
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_blocks * block_size] True = attend
    prefills: list[PrefillSpan]


def build_attention_metadata(
    query_lens: list[int],
    num_computed: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Describe a flat batch: request i has `query_lens[i]` new tokens after `num_computed[i]`
    tokens already in the cache, and owns the blocks `block_tables[i]`."""
    slots: list[int] = []
    decode_rows, decode_tables, decode_lens = [], [], []
    prefills: list[PrefillSpan] = []
    row = 0
    for q_len, start, table in zip(query_lens, num_computed, block_tables):
        context_len = start + q_len
        for pos in range(start, context_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        num_blocks = -(-context_len // block_size)
        if q_len == 1 and start > 0:
            decode_rows.append(row)
            decode_tables.append(table[:num_blocks])
            decode_lens.append(context_len)
        else:
            mask = None
            if start > 0:  # chunk i-th query (position start+i) sees keys 0..start+i
                q_pos = torch.arange(start, context_len, device=device).unsqueeze(1)
                mask = torch.arange(context_len, device=device).unsqueeze(0) <= q_pos
            ids = torch.tensor(table[:num_blocks], dtype=torch.long, device=device)
            prefills.append(PrefillSpan(row, q_len, context_len, ids, mask))
        row += q_len

    max_blocks = max((len(t) for t in decode_tables), default=0)
    padded = [t + [0] * (max_blocks - len(t)) for t in decode_tables]
    key_pos = torch.arange(max_blocks * block_size, device=device)
    lens = torch.tensor(decode_lens, dtype=torch.long, device=device)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_size=block_size,
        decode_rows=torch.tensor(decode_rows, dtype=torch.long, device=device),
        decode_block_tables=torch.tensor(padded, dtype=torch.long, device=device).view(len(padded), max_blocks),
        decode_mask=(key_pos.unsqueeze(0) < lens.unsqueeze(1)).view(len(decode_lens), 1, 1, len(key_pos)),
        prefills=prefills,
    )


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor):
    """Store this step's K/V ([num_tokens, kv_heads, head_dim]) into their cache slots."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


def gather_context(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """A request's keys or values in order: [..., num_blocks * block_size, kv_heads, head_dim]."""
    blocks = cache[block_ids]  # [..., num_blocks, block_size, kv_heads, head_dim]
    return blocks.flatten(-4, -3)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim]; k, v: [num_tokens, kv_heads, head_dim].
    Writes k, v to the cache, then attends every query to its request's cached context."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)

    if meta.decode_rows.numel():
        q_dec = q[meta.decode_rows].unsqueeze(2)  # [B, heads, 1, head_dim]
        k_ctx = gather_context(k_cache, meta.decode_block_tables).transpose(1, 2)  # [B, kv_heads, L, d]
        v_ctx = gather_context(v_cache, meta.decode_block_tables).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q_dec, k_ctx, v_ctx, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        )
        out[meta.decode_rows] = o.squeeze(2)

    for span in meta.prefills:
        rows = slice(span.token_start, span.token_start + span.num_tokens)
        q_chunk = q[rows].transpose(0, 1)  # [heads, n, head_dim]
        k_ctx = gather_context(k_cache, span.block_ids)[: span.context_len].transpose(0, 1)
        v_ctx = gather_context(v_cache, span.block_ids)[: span.context_len].transpose(0, 1)
        o = F.scaled_dot_product_attention(
            q_chunk,
            k_ctx,
            v_ctx,
            attn_mask=span.mask,
            is_causal=span.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[rows] = o.transpose(0, 1)
    return out
