"""Paged attention: K/V live in fixed-size blocks, requests find theirs through block tables.

Per layer the cache is two tensors of shape [num_blocks, block_size, num_kv_heads, head_dim].
A token's K/V go to one *slot* (block_id * block_size + offset in block); a request's context is
the concatenation of the blocks listed in its block table. Nothing here needs the blocks of one
request to be contiguous: that is the whole point of paging (chapter 06).

A step's batch is flat (vLLM style): all scheduled tokens of all requests in one sequence. A
request contributes either one decode token or a prefill chunk that may start at any offset of its
prompt (chunked prefill). Prefill chunks are attended one request at a time, each with its own
causal mask. Decode tokens are attended in groups of requests with similar context lengths: one
padded call per group, so that a short request does not pay for the padding up to a long one.

Everything that depends only on the batch's shape (slots, padded block tables, masks) is computed
once per step in `build_attention_metadata` and shared by all layers.

Two implementations, the same numbers (tests/test_kernels.py checks it):
- the torch path below, the readable reference: gather each request's blocks into one tensor
  (`gather_context`), then `F.scaled_dot_product_attention`;
- on a CPU in float32 or bfloat16 with `kernels="auto"`, our C++ kernel (engine/kernels/csrc)
  for decode tokens and for prefill chunks that attend to a cached prefix: it reads every K/V row
  where it lies in its block, through the block table, so the copy of the whole context per
  request, per layer, per step disappears; the same call writes the step's new K/V. A first
  prefill chunk needs no cache read at all: it stays on SDPA.

The cache may be narrower than the model (`kv_cache_dtype="bfloat16"` under a float32 model):
K/V are rounded as they are written and widened as they are read, so a decode step streams half
the bytes; a first prefill chunk attends to its K/V rounded the same way (`as_cached`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.utils import cdiv

DECODE_GROUP_SIZE = 4  # decodes per padded attention call (4 to 8 measured best on a 2-core CPU)
KERNEL_TILE_ROWS = 16  # prefill queries per work item of the C++ kernel (each key read serves all)


@dataclass
class PrefillSpan:
    """One request's prefill chunk inside the flat batch."""

    token_start: int  # first row of this chunk in the flat batch
    num_tokens: int  # tokens of this chunk
    context_len: int  # tokens in the cache after this step (already cached + this chunk)
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] physical blocks in order
    mask: torch.Tensor | None  # [num_tokens, context_len] bool, None when plain causal


@dataclass
class DecodeGroup:
    """Decode tokens of requests with similar context lengths, attended to in one padded call."""

    rows: slice | torch.Tensor  # their rows in the flat batch (a slice when the rows are adjacent)
    num_seqs: int
    block_ids: torch.Tensor  # [num_seqs * max_blocks] each request's blocks in order, padded with 0
    padded_len: int  # max_blocks * block_size keys per request after the gather
    context_len: int  # the longest request's context; the keys beyond it are cut off
    # [num_seqs, 1, 1, context_len] True = attend (False: padding past the request's end);
    # None for a single request, which is cut to its length
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """Everything attention needs about a step, built once and shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V are written
    block_size: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]
    # For the C++ kernel (CPU only, else None): every request's block table, and the work it does:
    # rows (first row, number of rows, request, position of the first row) of the decode tokens
    # and of the prefill chunks that have a cached prefix, cut into KERNEL_TILE_ROWS-row tiles.
    kernel_block_tables: torch.Tensor | None = None  # [num_requests, max_blocks] int32
    kernel_tiles: torch.Tensor | None = None  # [num_tiles, 4] int32
    # (first row, rows) of the prefill chunks with nothing cached before them, which attend to
    # their own K/V with SDPA (for the fused C++ attention block: engine/models/llama.py)
    kernel_first_chunks: torch.Tensor | None = None  # [num_chunks, 2] int64
    for_kernel: bool = False  # built without the torch path's decode groups and masks

    def kernel_work(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the fused C++ attention takes after the cache (engine/models/llama.py): slots,
        block tables, tiles and first chunks."""
        return (
            self.slot_mapping,
            self.kernel_block_tables,
            self.kernel_tiles,
            self.kernel_first_chunks,
        )


@dataclass
class _Batch:
    """The shape of a flat batch, as the metadata builders below read it."""

    query_lens: list[int]  # new tokens per request
    num_computed: list[int]  # tokens already in the cache per request
    context_lens: list[int]  # tokens in the cache after this step
    num_blocks: list[int]  # blocks each request's context spans
    token_starts: list[int]  # first row of each request in the flat batch
    tables: list[list[int]]  # each request's block table padded with 0 to the longest
    block_size: int


def build_attention_metadata(
    query_lens: list[int],
    num_computed: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    for_kernel: bool = False,
) -> AttentionMetadata:
    """Describe a flat batch: request i has `query_lens[i]` new tokens after `num_computed[i]`
    tokens already in the cache, and owns the blocks `block_tables[i]`. Three things: where the
    new K/V go (the slot mapping), how the torch path attends (decode groups, prefill spans),
    and the work of our C++ kernel on a CPU. `for_kernel` (the model attends with the kernel)
    leaves out what only the torch path reads: the padded decode groups and their masks."""
    batch = _describe_batch(query_lens, num_computed, block_tables, block_size)
    decodes = sorted(
        (i for i in range(len(query_lens)) if query_lens[i] == 1 and num_computed[i] > 0),
        key=lambda i: batch.context_lens[i],
    )
    kernel_tables = kernel_tiles = first_chunks = None
    if torch.device(device).type == "cpu":
        kernel_tables, kernel_tiles, first_chunks = _kernel_work(batch)
    return AttentionMetadata(
        slot_mapping=_slot_mapping(batch, block_tables, device),
        block_size=block_size,
        decode_groups=[] if for_kernel else _decode_groups(batch, decodes, device),
        prefills=_prefill_spans(batch, set(decodes), device, for_kernel),
        kernel_block_tables=kernel_tables,
        kernel_tiles=kernel_tiles,
        kernel_first_chunks=first_chunks,
        for_kernel=for_kernel,
    )


def int_tensor(values: list, dtype=np.int64, device: torch.device | str = "cpu") -> torch.Tensor:
    """A step's integers (token ids, slots, block tables) as a tensor, built by numpy: a decode
    step runs in a cold cache (its weights have just streamed through), where torch.tensor of a
    short list costs ~20 µs (four tensor operations) and numpy's array ~10 (docs/performance.md,
    sixteenth session)."""
    host = torch.from_numpy(np.array(values, dtype=dtype))
    return host if torch.device(device).type == "cpu" else host.to(device)


def _describe_batch(query_lens, num_computed, block_tables, block_size: int) -> _Batch:
    context_lens = [start + q_len for start, q_len in zip(num_computed, query_lens)]
    num_blocks = [cdiv(n, block_size) for n in context_lens]
    max_blocks = max(num_blocks, default=0)
    # One padded block table for the whole batch: row i = request i's blocks, then zeros. (Made
    # a tensor only where a path reads it: each small tensor operation costs microseconds.)
    tables = [t[:n] + [0] * (max_blocks - n) for t, n in zip(block_tables, num_blocks)]
    token_starts = [0]
    for q_len in query_lens:
        token_starts.append(token_starts[-1] + q_len)
    return _Batch(
        query_lens, num_computed, context_lens, num_blocks, token_starts, tables, block_size
    )


def _slot_mapping(batch: _Batch, block_tables: list[list[int]], device) -> torch.Tensor:
    """Slot of every new token: its request's block for its position, then the offset in the
    block. (Plain Python: a decode step has a handful of tokens, and a dozen small tensor
    operations for them cost more than the loop.)"""
    size = batch.block_size
    slots = [
        block_tables[i][position // size] * size + position % size
        for i in range(len(batch.query_lens))
        for position in range(batch.num_computed[i], batch.context_lens[i])
    ]
    return int_tensor(slots, device=device)


def _decode_groups(batch: _Batch, decodes: list[int], device) -> list[DecodeGroup]:
    """Decodes, shortest context first, cut into groups; each group is padded to its longest
    member."""
    if not decodes:
        return []
    context_lens, num_blocks = batch.context_lens, batch.num_blocks
    decode_tables = int_tensor([batch.tables[i] for i in decodes], device=device)
    decode_lens = int_tensor([context_lens[i] for i in decodes], device=device)
    longest = context_lens[decodes[-1]]
    # [num_decodes, longest]: True where a request has a key
    attend = torch.arange(longest, device=device).unsqueeze(0) < decode_lens.unsqueeze(1)
    groups = []
    for g in range(0, len(decodes), DECODE_GROUP_SIZE):
        group = decodes[g : g + DECODE_GROUP_SIZE]
        n, last = len(group), group[-1]  # the last one has the group's longest context
        context_len = context_lens[last]
        groups.append(
            DecodeGroup(
                rows=_as_rows([batch.token_starts[i] for i in group], device),
                num_seqs=n,
                block_ids=decode_tables[g : g + n, : num_blocks[last]].reshape(-1),
                padded_len=num_blocks[last] * batch.block_size,
                context_len=context_len,
                mask=attend[g : g + n, :context_len].view(n, 1, 1, context_len) if n > 1 else None,
            )
        )
    return groups


def _prefill_spans(batch: _Batch, decodes: set[int], device, for_kernel: bool) -> list:
    """Every request that is not a decode: its chunk's rows, and its causal mask when the chunk
    starts after a cached prefix (the torch path's; a first chunk is plain causal)."""
    spans = []
    for i in range(len(batch.query_lens)):
        if i in decodes:
            continue
        start, context_len = batch.num_computed[i], batch.context_lens[i]
        mask = None
        if start > 0 and not for_kernel:  # chunk i-th query (position start+i) sees keys 0..start+i
            q_pos = torch.arange(start, context_len, device=device).unsqueeze(1)
            mask = torch.arange(context_len, device=device).unsqueeze(0) <= q_pos
        block_ids = int_tensor(batch.tables[i][: batch.num_blocks[i]], device=device)
        spans.append(
            PrefillSpan(batch.token_starts[i], batch.query_lens[i], context_len, block_ids, mask)
        )
    return spans


def _kernel_work(batch: _Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the C++ kernel: every request's block table (int32), and the rows it attends, cut
    into KERNEL_TILE_ROWS-row tiles (first row, rows, request, position of the first row); and
    the first chunks that SDPA attends instead (first row, rows)."""
    tiles, first_chunks = [], []
    for i, q_len in enumerate(batch.query_lens):
        if batch.num_computed[i] == 0:  # a first chunk: SDPA on its own fresh K/V
            first_chunks.append((batch.token_starts[i], q_len))
            continue
        for a in range(0, q_len, KERNEL_TILE_ROWS):
            rows = min(KERNEL_TILE_ROWS, q_len - a)
            tiles.append((batch.token_starts[i] + a, rows, i, batch.num_computed[i] + a))
    return (
        int_tensor(batch.tables, np.int32) if batch.tables else _NO_TABLES,
        int_tensor(tiles, np.int32) if tiles else _NO_TILES,
        int_tensor(first_chunks) if first_chunks else _NO_FIRST_CHUNKS,
    )


# What _kernel_work gives when there is none of it (a decode step has no first chunks): shared,
# never written (a tensor of no elements has nothing to write).
_NO_TABLES = torch.zeros(0, 0, dtype=torch.int32)
_NO_TILES = torch.zeros(0, 4, dtype=torch.int32)
_NO_FIRST_CHUNKS = torch.zeros(0, 2, dtype=torch.long)


def _as_rows(rows: list[int], device) -> slice | torch.Tensor:
    """Rows of the flat batch as a slice when they are adjacent (a view, no copy),
    else as indices."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return int_tensor(rows, device=device)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
):
    """Store this step's K/V ([num_tokens, kv_heads, head_dim]) into their cache slots, in the
    cache's dtype (a bfloat16 KV cache under a float32 model rounds them)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))


def as_cached(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """`x` as the cache gives it back: rounded to the cache's dtype and widened again (a bfloat16
    KV cache under a float32 model), so that a first prefill chunk, which attends to its fresh
    K/V, sees the keys and values every later step reads."""
    return x if x.dtype == cache.dtype else x.to(cache.dtype).to(x.dtype)


def gather_context(
    cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Blocks in table order, as one tensor [len(block_ids), block_size, kv_heads, head_dim] of
    `dtype` (the queries'). (index_select copies whole blocks at once: several times faster than
    cache[block_ids].)"""
    return cache.index_select(0, block_ids).to(dtype)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kernels=None,
) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim]; k, v: [num_tokens, kv_heads, head_dim].
    Writes k, v to the cache, then attends every query to its request's cached context.
    `kernels`: the compiled extension (engine.kernels.load()) to use it, None for torch only."""
    kernel_dtype = q.dtype in (torch.float32, torch.bfloat16)
    cache_readable = k_cache.dtype in (q.dtype, torch.bfloat16)  # its own dtype, or bfloat16
    if kernels is not None and meta.kernel_tiles is not None and kernel_dtype and cache_readable:
        return paged_attention_kernel(q, k, v, k_cache, v_cache, meta, scale, kernels)
    if meta.for_kernel:  # its decodes have no groups here: they would be left unattended
        raise ValueError("attention metadata built for_kernel=True reached the torch path")
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    _, _, kv_heads, head_dim = k_cache.shape
    group_size = q.shape[1] // kv_heads  # query heads sharing one KV head (GQA)

    for group in meta.decode_groups:
        n = group.num_seqs
        # [n, padded_len, kv_heads, d] → [n, kv_heads, context_len, d]
        k_ctx = gather_context(k_cache, group.block_ids, q.dtype).view(
            n, group.padded_len, kv_heads, head_dim
        )
        v_ctx = gather_context(v_cache, group.block_ids, q.dtype).view(
            n, group.padded_len, kv_heads, head_dim
        )
        k_ctx = k_ctx[:, : group.context_len].transpose(1, 2)
        v_ctx = v_ctx[:, : group.context_len].transpose(1, 2)
        # The query heads that share a KV head become that head's queries:
        # [n, kv_heads, group_size, d]. One decode token attends to all its keys, so they need no
        # causal mask, only the padding one.
        q_dec = q[group.rows].view(n, kv_heads, group_size, head_dim)
        o = F.scaled_dot_product_attention(q_dec, k_ctx, v_ctx, attn_mask=group.mask, scale=scale)
        out[group.rows] = o.reshape(n, kv_heads * group_size, head_dim)

    for span in meta.prefills:
        rows = slice(span.token_start, span.token_start + span.num_tokens)
        q_chunk = q[rows].transpose(0, 1)  # [heads, n, head_dim]
        if (
            span.num_tokens == span.context_len
        ):  # a first chunk sees only itself: its K/V are at hand
            k_ctx = as_cached(k[rows], k_cache).transpose(0, 1)
            v_ctx = as_cached(v[rows], v_cache).transpose(0, 1)
        else:
            k_ctx = (
                gather_context(k_cache, span.block_ids, q.dtype)
                .flatten(0, 1)[: span.context_len]
                .transpose(0, 1)
            )
            v_ctx = (
                gather_context(v_cache, span.block_ids, q.dtype)
                .flatten(0, 1)[: span.context_len]
                .transpose(0, 1)
            )
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


def paged_attention_kernel(
    q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, kernels
) -> torch.Tensor:
    """The same attention with our C++ kernel for every query that reads the cache: decode tokens
    and prefill chunks after a cached prefix read their K/V blocks in place (no gather). The one
    call also writes this step's K/V into their slots. First prefill chunks attend to their own
    fresh K/V with SDPA, exactly as the torch path does."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    kernels.paged_attention(
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta.slot_mapping,
        meta.kernel_block_tables,
        meta.kernel_tiles,
        scale,
        out,
    )
    for span in meta.prefills:
        if span.num_tokens != span.context_len:  # has a cached prefix: done by the kernel
            continue
        rows = slice(span.token_start, span.token_start + span.num_tokens)
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1),
            as_cached(k[rows], k_cache).transpose(0, 1),
            as_cached(v[rows], v_cache).transpose(0, 1),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        out[rows] = o.transpose(0, 1)
    return out
