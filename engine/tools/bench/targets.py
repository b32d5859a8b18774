"""The issue's goals for this engine on a CPU in float32, each beside the value measured (reported,
never asserted)."""

from __future__ import annotations

# The goals for this engine on a CPU in float32 (reported, never asserted).
TARGETS = {
    "offline_ratio": 2.5,  # engine output tokens/s ÷ transformers static batching
    "decode_roofline_fraction": 0.60,  # batch-1 decode tokens/s ÷ decode roofline
    "overhead_share_full_batch": 0.10,  # share of step time outside the forward, at full batch
    "int8_matvec_speedup": 1.8,  # our int8 matrix × vector ÷ the best float32 one, 1 row
    "int8_decode_speedup": 1.8,  # the engine's batch-1 decode, int8 ÷ float32 (section 8)
    "int4_vs_llama_cpp": 1.0,  # the engine's best 4-bit batch-1 decode ÷ llama.cpp Q4_1's
    "int4_roofline_fraction": 0.70,  # the best 4-bit batch-1 decode ÷ its weight-streaming limit
    "bf16_linears_offline_on_amx": 2.0,  # offline with bfloat16 linears ("auto") ÷ float32's
}


def bf16_rows(bf16: dict) -> list[tuple]:
    """The bfloat16 goal, set for AMX machines: one row for bfloat16 linears over a float32 KV
    cache, one for bfloat16 linears over a bfloat16 one (each engine's own ratio)."""
    if not (bf16.get("ran") and bf16.get("amx") == "AMX"):
        return []
    target = TARGETS["bf16_linears_offline_on_amx"]
    engines = [("float32", bf16), ("bfloat16", bf16.get("with_bfloat16_kv_cache"))]
    return [
        (
            f"offline throughput, bfloat16 linears (auto), {cache} KV cache ÷ float32's, on AMX",
            run["ratio"],
            target,
            run["ratio"] >= target,
        )
        for cache, run in engines
        if run is not None
    ]


def four_bit_rows(results: dict) -> list[tuple]:
    """The 4-bit goals, where a 4-bit engine ran (section 8's int4 and gguf rows, or the run's own
    engine when it is one): its best batch-1 decode against llama.cpp Q4_1's in the same run, and
    its best fraction of the weight-streaming limit at the bandwidth sampled next to it."""
    runs = [
        (v["decode_tokens_per_s"], v.get("fraction_of_roofline"))
        for v in results.get("variants", {}).get("rows", [])
        if v.get("quantization") in ("int4", "gguf") and v.get("decode_tokens_per_s")
    ]
    if results["conditions"].get("quantization_method") in ("int4", "gguf"):
        own = results["decode_batch1"]
        runs.append((own.get("tokens_per_s") or 0.0, own.get("fraction_of_roofline")))
    rows = []
    peer = results.get("llama_cpp", {}).get("decode_tokens_per_s")
    if peer and runs:
        vs_peer = max(rate for rate, _ in runs) / peer
        target = TARGETS["int4_vs_llama_cpp"]
        rows.append(
            (
                "4-bit batch-1 decode (best of int4 / gguf) ÷ llama.cpp Q4_1's",
                vs_peer,
                target,
                vs_peer >= target,
            )
        )
    fractions = [f for _, f in runs if f is not None]
    if fractions:
        target = TARGETS["int4_roofline_fraction"]
        rows.append(
            (
                "4-bit batch-1 decode (best of int4 / gguf) ÷ its weight-streaming roofline",
                max(fractions),
                target,
                max(fractions) >= target,
            )
        )
    return rows


def evaluate_targets(results: dict) -> list[dict]:
    """The issue's goals, with the measured value next to each (meaningful on a CPU in float32)."""
    ratio = results["offline"].get("ratio")
    fraction = results["decode_batch1"].get("fraction_of_roofline")
    share = results["overhead"]["full_batch"].get("overhead_share")
    lin = results.get("kernels", {}).get("linear")
    int8 = lin and lin["int8_speedup_vs_float32_1row"]
    rows = [
        (
            "offline throughput ÷ transformers static batching",
            ratio,
            TARGETS["offline_ratio"],
            ratio is not None and ratio >= TARGETS["offline_ratio"],
        ),
        (
            "batch-1 decode ÷ decode roofline",
            fraction,
            TARGETS["decode_roofline_fraction"],
            fraction is not None and fraction >= TARGETS["decode_roofline_fraction"],
        ),
        (
            "overhead share at full batch",
            share,
            TARGETS["overhead_share_full_batch"],
            share is not None and share < TARGETS["overhead_share_full_batch"],
        ),
    ]
    if int8:
        rows.append(
            (
                "int8 matvec tokens/s ÷ float32's (1 row, best float32 kernel)",
                int8,
                TARGETS["int8_matvec_speedup"],
                int8 >= TARGETS["int8_matvec_speedup"],
            )
        )
    rows += four_bit_rows(results)
    by_name = {v["name"]: v for v in results.get("variants", {}).get("rows", [])}
    int8_decode = by_name.get("float32 + int8", {}).get("decode_vs_float32")
    if int8_decode is not None:
        rows.append(
            (
                "int8 batch-1 decode ÷ float32's (engine, section 8)",
                int8_decode,
                TARGETS["int8_decode_speedup"],
                int8_decode >= TARGETS["int8_decode_speedup"],
            )
        )
    rows += bf16_rows(results["offline"].get("bfloat16_linears") or {})
    # "met" is None where the value was not measured (transformers skipped, say): neither verdict
    return [
        {"name": n, "value": v, "target": t, "met": None if v is None else bool(m)}
        for n, v, t, m in rows
    ]
