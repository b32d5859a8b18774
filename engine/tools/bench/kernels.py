"""Section 6 (CPU, float32, full runs): our C++ kernels against torch's linear and attention, and
the decode step with kernels="torch" and kernels="auto"."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from engine.kernels import huge_pages
from engine.tools.bench.config import BenchConfig
from engine.tools.bench.decode import probe_workload, run_steps, step_breakdown
from engine.tools.bench.timing import best_time, best_times


def linear_paths(mats: list, ext) -> dict:
    """name: (one call per matrix, activation dtype, weight bytes) for every path measured."""
    from engine.kernels.bfloat16_tiles import can_tile, tile_bfloat16, tiles_available
    from engine.kernels.float32_linear import (
        ONEDNN_LINEAR,
        float32_kernel,
        float32_linear_backend,
        onednn_linear,
    )
    from engine.kernels.quant import kernel_linear, quantize_int4, quantize_int8, reference_linear

    params = sum(m.numel() for m in mats)
    arena = huge_pages.Arena()  # every path's weights in the pages the engine gives its own
    bf16 = [arena.copy(m.to(torch.bfloat16)) for m in mats]
    q8 = [arena.place(quantize_int8(m)) for m in mats]
    q4 = [arena.place(quantize_int4(m, 32)) for m in mats]
    q8_bytes, q4_bytes = sum(q.nbytes() for q in q8), sum(q.nbytes() for q in q4)
    paths = {
        "float32 F.linear (MKL)": (lambda x, i: F.linear(x, mats[i]), torch.float32, 4 * params),
    }
    if ONEDNN_LINEAR:
        paths["float32 oneDNN"] = (
            lambda x, i: onednn_linear(x, mats[i]),
            torch.float32,
            4 * params,
        )
    if ext is not None:  # the engine's own: up to 8 rows on our kernel, more on the library
        ours = [float32_kernel(m, ext) for m in mats]
        library = {"mkl": "MKL", "onednn": "oneDNN"}[float32_linear_backend()["backend"]]
        paths[f"float32 ours (one row; 32 rows {library})"] = (
            lambda x, i: ours[i](x, None),
            torch.float32,
            4 * params,
        )
    paths["bfloat16 F.linear"] = (lambda x, i: F.linear(x, bf16[i]), torch.bfloat16, 2 * params)
    if tiles_available(ext) and all(can_tile(m.shape) for m in bf16):  # AMX or AVX512-BF16
        tiles = [tile_bfloat16(m).tiles for m in bf16]
        paths["bfloat16 ours (tiles)"] = (
            lambda x, i: ext.bf16_tiled_linear(x, tiles[i], None),
            torch.float32,  # rounded to bfloat16 by the kernel itself
            2 * params,
        )
    for fmt, label, qws, nbytes in (
        ("int8", "", q8, q8_bytes),
        ("int4", " (group 32)", q4, q4_bytes),
    ):
        if ext is not None:  # bound once per matrix, as a layer binds its kernel
            bound = [kernel_linear(q, ext) for q in qws]
            paths[f"{fmt} ours{label}"] = (
                lambda x, i, bound=bound: bound[i](x, None),
                torch.float32,
                nbytes,
            )
        paths[f"{fmt} torch reference"] = (
            lambda x, i, qws=qws: reference_linear(x, qws[i]),
            torch.float32,
            nbytes,
        )
    return paths


def time_linear_paths(mats: list, paths: dict, repeats: int) -> dict:
    """Each path over all matrices at 1 row (GB/s of its weights) and 32 rows (GFLOP/s), the
    paths taking turns (timing.best_times): the ratios between them are what the section
    reports, and a VM's slow minute would otherwise fall on whichever path ran in it."""
    params = sum(m.numel() for m in mats)
    rows = {name: {"weight_bytes": nbytes} for name, (_, _, nbytes) in paths.items()}
    for batch in (1, 32):
        calls = {}
        for name, (fn, dtype, _) in paths.items():
            xs = {k: torch.randn(batch, k).to(dtype) for k in {m.shape[1] for m in mats}}
            calls[name] = lambda fn=fn, xs=xs: [fn(xs[m.shape[1]], i) for i, m in enumerate(mats)]
        for name, seconds in best_times(calls, torch.device("cpu"), repeats).items():
            rows[name][f"ms_{batch}"] = seconds * 1e3
    for entry in rows.values():
        entry["gb_s_1"] = entry["weight_bytes"] / entry["ms_1"] / 1e6
        entry["gflop_s_32"] = 2 * params * 32 / entry["ms_32"] / 1e6
    return rows


def measure_linear_kernels(model, repeats: int) -> dict:
    """Every layer's weight matrices (qkv, o, gate_up, down of all layers; not the embedding or
    the output layer) through each path: GB/s of weights streamed at 1 row (a decode step at
    batch 1: the path's own weight bytes ÷ time) and GFLOP/s at 32 rows (a decode step at batch
    32: 2 × weights × 32 ÷ time). Paths: torch's float32 (MKL's F.linear and oneDNN, one of
    which the engine's `linear` runs: engine/kernels/float32_linear.py; and that one as the
    engine runs it on our kernels: one row on our own kernel, 32 on the library),
    bfloat16 (torch's, and our tiles where the CPU runs them: engine/kernels/bfloat16_tiles.py),
    and int8 / int4 (group 32) both through our C++ kernels ("ours") and through the
    readable torch reference (dequantize, then F.linear) that kernels="torch" runs. CPU only;
    the "ours" rows are left out when the extension does not build."""
    from engine import kernels as kernel_lib
    from engine.kernels.bfloat16_tiles import BFloat16TiledWeight

    layer = [t for k, t in model.w.items() if k.split(".")[0].isdigit()]
    untiled = [t.to_rows() if isinstance(t, BFloat16TiledWeight) else t for t in layer]
    mats = [t.float() for t in untiled if t.dim() == 2]
    params = sum(m.numel() for m in mats)
    ext = kernel_lib.load()
    rows = time_linear_paths(mats, linear_paths(mats, ext), repeats)
    float32_ms = [v for k, v in rows.items() if k.startswith("float32")]
    best_f32 = {b: min(v[f"ms_{b}"] for v in float32_ms) for b in (1, 32)}

    def ratio(a: str, b: str | None, batch: int) -> float | None:
        """How many times faster `a` runs than `b` (None: the best float32), None if missing."""
        if a not in rows:
            return None
        return (rows[b][f"ms_{batch}"] if b else best_f32[batch]) / rows[a][f"ms_{batch}"]

    ours = {  # format: (our kernel's row, its torch reference's row)
        "int8": ("int8 ours", "int8 torch reference"),
        "int4": ("int4 ours (group 32)", "int4 torch reference"),
    }
    return {
        "params": params,
        "kernels": rows,
        "extension": kernel_lib.describe("cpu" if ext is not None else "torch"),
        "int8_speedup_vs_float32_1row": ratio("int8 ours", None, 1),
        "int4_speedup_vs_float32_1row": ratio("int4 ours (group 32)", None, 1),
        # ours ÷ the torch reference of the same format, and ÷ the best float32, at 1 and 32 rows
        "ours_vs_reference": {
            fmt: {f"rows_{b}": ratio(a, ref, b) for b in (1, 32)} for fmt, (a, ref) in ours.items()
        },
        "ours_vs_float32": {
            fmt: {f"rows_{b}": ratio(a, None, b) for b in (1, 32)} for fmt, (a, _) in ours.items()
        },
        "method": f"{len(mats)} layer matrices, {params / 1e6:.1f} M weights; best of {repeats}",
        "kind": "measured",
    }


def measure_attention_kernel(
    model, batch: int, context: tuple[int, int], repeats: int, seed: int
) -> dict:
    """One decode step's attention alone (all layers) at `batch` requests of random context
    lengths, blocks shuffled: the torch path (gather + SDPA) against our kernel (in place)."""
    from engine import kernels
    from engine.layers.attention import build_attention_metadata, paged_attention

    cfg, block_size = model.cfg, 16
    rng = random.Random(seed)
    lens = [rng.randint(*context) for _ in range(batch)]
    blocks = [-(-n // block_size) for n in lens]
    ids = list(range(sum(blocks)))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in blocks:
        tables.append(ids[at : at + n])
        at += n
    shape = (len(ids), block_size, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(cfg.num_layers)]
    meta = build_attention_metadata([1] * batch, [n - 1 for n in lens], tables, block_size)
    q = torch.randn(batch, cfg.num_heads, cfg.head_dim)
    k = torch.randn(batch, cfg.num_kv_heads, cfg.head_dim)
    v = torch.randn(batch, cfg.num_kv_heads, cfg.head_dim)
    ext = kernels.load()
    scale = cfg.head_dim**-0.5  # as LlamaAttention scales its scores

    def step(ext_or_none):
        for kc, vc in caches:
            paged_attention(q, k, v, kc, vc, meta, scale, ext_or_none)

    out = {
        "batch": batch,
        "mean_context": sum(lens) / batch,
        "torch_ms": best_time(lambda: step(None), torch.device("cpu"), repeats) * 1e3,
    }
    if ext is not None:
        out["kernel_ms"] = best_time(lambda: step(ext), torch.device("cpu"), repeats) * 1e3
    out["kv_bytes_read"] = sum(lens) * cfg.kv_elements_per_token * 4
    return out


def measure_decode_both_paths(model_dir, config: "BenchConfig", vocab: int, specials) -> dict:
    """The batch-1 and batch-32 decode steps with kernels="torch" and kernels="auto" (two engines
    sharing the weights), on the same probe workloads."""
    from engine.entrypoints.llm import LLM

    out = {}
    for mode in ("torch", "auto"):
        llm = LLM(
            model=str(model_dir),
            device="cpu",
            dtype="float32",
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            kernels=mode,
            enable_prefix_caching=False,
        )
        engine = llm.engine
        path = engine.executor.worker.model.kernel_path
        b1 = probe_workload(
            1, config.probe_prompt_len, config.probe_output_len, config.seed + 500, vocab, specials
        )
        # 32 prompts of 384 tokens take 24 steps of a 512-token budget to prefill: outputs must
        # outlast that, or the batch never decodes all 32 at once (and this row stays empty)
        full = probe_workload(config.max_num_seqs, 384, 64, config.seed + 600, vocab, specials)
        out[mode] = {
            "path": path,
            "batch_1": step_breakdown(run_steps(engine, b1), 1),
            "full_batch": step_breakdown(run_steps(engine, full), config.max_num_seqs),
        }
    return out
