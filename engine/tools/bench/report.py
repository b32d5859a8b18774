"""The benchmark's report: every section's results as the text `python -m engine bench` prints."""

from __future__ import annotations

from engine.tools.bench.structured import format_structured_outputs
from engine.tools.bench.timing import ratio


def fmt(value, spec=".1f", none="—") -> str:
    return none if value is None else format(value, spec)


def format_results(r: dict) -> str:
    """The report of sections 1-9 (section 10, fidelity, has its own: `format_fidelity`)."""
    lines = format_conditions(r["conditions"])
    lines += format_ceilings(r)
    lines += format_offline(r["offline"])
    lines += format_decode_batch1(r["decode_batch1"])
    lines += format_overhead(r["overhead"])
    lines += format_structured_outputs(r.get("structured_outputs"))
    lines += format_latency(r["latency"])
    lines += format_kernels(r.get("kernels"))
    lines += format_targets(r["targets"])
    if "spec_decode" in r:
        lines += ["", *format_spec_decode(r["spec_decode"])]
    if "variants" in r:
        lines += ["", *format_variants(r["variants"])]
    if "llama_cpp" in r:
        lines += format_llama_cpp(r["llama_cpp"], r)
    if "parallel" in r:
        lines += format_parallel(r["parallel"])
    lines.append(f"\n  bench took {r['conditions']['bench_seconds']:.0f} s")
    return "\n".join(lines)


def format_conditions(c: dict) -> list[str]:
    return [
        f"Benchmark {c['date']}: {c['model_name']} "
        f"({c['num_parameters'] / 1e6:.1f} M parameters), {c['dtype']}, "
        f"{c['device']} = {c['device_name']}, {c['threads']} threads"
        f"{' (quick)' if c['quick'] else ''}",
        f"  workload: {c['workload']['num_requests']} requests, "
        f"prompt {c['workload']['prompt_len']} tokens, "
        f"output {c['workload']['output_len']} tokens, seed {c['seed']}; engine max_num_seqs "
        f"{c['engine']['max_num_seqs']}, token budget {c['engine']['max_num_batched_tokens']}",
        f"  kernels: {c.get('kernels', 'torch')}",
        f"  quantization: {c.get('quantization', 'none')}",
        *([f"  memory: {c['pages']}"] if c.get("pages") else []),
        *format_load(c),
    ]


def format_load(c: dict) -> list[str]:
    """The load average around the run, and BUSY when other programs shared the machine (then
    every time below carries their noise)."""
    if "load_before" not in c:
        return []
    verdict = "BUSY: other programs shared the machine" if c["busy"] else "quiet"
    return [
        f"  load average (1 min): {c['load_before']:.2f} before, {c['load_after']:.2f} after "
        f"({c.get('machine') or c['device_name']}): {verdict} [{c['busy_rule']}]"
    ]


def format_ceilings(r: dict) -> list[str]:
    c, ce, ro = r["conditions"], r["ceilings"], r["rooflines"]
    mm = "; ".join(
        f"{dt} {max(ks.values()):.0f} (" + ", ".join(f"{k} {v:.0f}" for k, v in ks.items()) + ")"
        for dt, ks in ce["matmul_gflop_s_by_kernel"].items()
    )
    return [
        "",
        "1. Ceilings (measured, best of N) and rooflines (derived)",
        f"  memory read bandwidth   {ce['memory_read_gb_s']:8.1f} GB/s   (samples "
        f"{', '.join(f'{x:.1f}' for x in ce['memory_read_gb_s_samples'])}; "
        f"copy {ce['memory_copy_gb_s']:.1f} GB/s)",
        f"  matmul GFLOP/s          {mm}",
        f"  matrix × vector         {ce['matvec_gb_s']:8.1f} GB/s   "
        "(the engine's linear over all weights, 1 token: "
        f"{ce['matvec_ms']:.1f} ms)",
        f"  weight bytes per step   {c['weight_bytes_per_step'] / 1e6:8.1f} MB     FLOP per token "
        f"{c['flop_per_token'] / 1e6:.0f} M",
        f"  decode roofline (b=1)   {ro['decode_tokens_per_s']:8.1f} tokens/s  "
        "= bandwidth ÷ weight bytes",
        f"  decode, matmuls alone   {ro['decode_matvec_tokens_per_s']:8.1f} tokens/s  "
        "= matrix × vector GB/s ÷ "
        "weight bytes "
        f"({100 * ro['decode_matvec_tokens_per_s'] / ro['decode_tokens_per_s']:.0f}% "
        "of the roofline)",
        f"  compute roofline        {fmt(ro['compute_tokens_per_s'], '8.1f')} tokens/s  "
        "= matmul FLOP/s ÷ "
        f"FLOP per token (batch ≥ {fmt(ro['balance_batch'], '.0f')} is compute-bound)",
    ]


def format_offline(off: dict) -> list[str]:
    e = off["engine"]
    lines = [
        "",
        "2. Offline throughput (output tokens/s, useful tokens only)",
        f"  engine (continuous)     {e['output_tokens_per_s']:8.1f}   {e['seconds']:.1f} s, "
        f"{e['steps']} steps, {e['preemptions']} preemptions",
    ]
    if "transformers" in off:
        h = off["transformers"]
        waste = 1 - (h["prompt_tokens_useful"] + h["output_slots_useful"]) / (
            h["prompt_tokens_computed"] + h["output_slots_computed"]
        )
        lines.append(
            f"  transformers (static)   {h['output_tokens_per_s']:8.1f}   {h['seconds']:.1f} s, "
            f"{h['batches']} batches of {h['batch_size']}, "
            f"{100 * waste:.0f}% of computed tokens are padding"
        )
        agree = off["greedy_agreement"]
        lines.append(
            f"  ratio                   {off['ratio']:8.2f}×  (greedy outputs identical for "
            f"{agree['identical_requests']}/{agree['requests']} requests)"
        )
    return lines + format_bfloat16_linears(off.get("bfloat16_linears"))


def format_bfloat16_linears(b: dict | None) -> list[str]:
    """The report's lines under section 2."""
    if b is None:
        return []
    if not b["ran"]:
        return [f"  bfloat16 linears (auto): not run: {b['why']}"]
    target = f"target ≥ {b['target_ratio_on_amx']:.0f}× on AMX"
    target += "; not an AMX machine" if b["amx"] != "AMX" else ""
    lines = format_bfloat16_engine("engine, bf16 linears   ", b, target)
    weights = b["weight_bytes"] / 1e6, b["float32_weight_bytes"] / 1e6
    lines[0] += "; weights {:.0f} MB vs {:.0f} MB".format(*weights)
    kv = b.get("with_bfloat16_kv_cache")
    if kv is not None:
        lines += format_bfloat16_engine("  + bf16 KV cache      ", kv, target)
    return lines + [f"    auto chose bfloat16: {b['why']}"]


def format_bfloat16_engine(label: str, b: dict, target: str) -> list[str]:
    """One bfloat16 engine's line and its agreement with the float32 engine's outputs."""
    e, a = b["engine"], b["agreement"]
    return [
        f"  {label} {e['output_tokens_per_s']:8.1f}   {e['seconds']:.1f} s, "
        f"{b['ratio']:.2f}× the float32 engine ({target})",
        f"    agreement with float32: {a['identical_requests']}/{a['requests']} identical, "
        f"{a['near_ties']} near-tie divergences, {a['not_near_ties']} not near ties "
        f"(margin {a['tie_margin']})",
    ]


def format_decode_batch1(d: dict) -> list[str]:
    return [
        "",
        "3. Decode at batch 1",
        f"  {fmt(d['tokens_per_s'])} tokens/s ({fmt(d['step_ms'], '.1f')} ms/step) = "
        f"{fmt(d['fraction_of_roofline'] and 100 * d['fraction_of_roofline'], '.0f')}% of the "
        f"{d['roofline_tokens_per_s']:.1f} tokens/s roofline at "
        f"{fmt(d.get('bandwidth_gb_s'), '.1f')} GB/s, the bandwidth sampled next to it; "
        f"{fmt(d.get('fraction_of_best_roofline') and 100 * d['fraction_of_best_roofline'], '.0f')}"
        f"% of the run's best ({d['context']})",
    ]


def format_overhead(overhead: dict) -> list[str]:
    from engine.trace import PHASES

    names = list(PHASES) + ["untimed"]
    lines = [
        "",
        "4. Engine overhead (median decode step, ms)",
        "  batch " + "".join(f"{n[:12]:>13}" for n in names) + f"{'step':>9}{'overhead':>10}",
    ]
    for key in ("batch_1", "full_batch"):
        o = overhead[key]
        if not o.get("steps"):
            lines.append(f"  {o['batch']:>5}  (no pure decode steps)")
            continue
        lines.append(
            f"  {o['batch']:>5} "
            + "".join(f"{o['phase_ms'][n]:13.2f}" for n in names)
            + f"{o['step_ms']:9.1f}{100 * o['overhead_share']:9.1f}%"
        )
    return lines


def format_latency(lat: dict) -> list[str]:
    lines = [
        "",
        f"5. Latency under load (Poisson arrivals, {lat['requests_per_rate']} requests per rate, "
        "seconds)",
        "  rate/s   TTFT p50/p90/p99        TPOT p50/p90/p99        E2E p50/p90/p99         tok/s",
    ]
    for run in lat["runs"]:
        cols = []
        for key in ("ttft_s", "tpot_s", "e2e_s"):
            p = run[key]
            spec = ".3f" if key == "tpot_s" else ".2f"
            cols.append("/".join(fmt(p[k], spec) for k in ("p50", "p90", "p99")))
        lines.append(
            f"  {run['rate_req_s']:6.3f}   {cols[0]:<23} {cols[1]:<23} {cols[2]:<23} "
            f"{run['output_tokens_per_s']:6.1f}"
        )
    return lines


def format_targets(targets: list[dict]) -> list[str]:
    lines = ["", "Targets (CPU, float32)"]
    verdicts = {True: "met    ", False: "NOT met", None: "not run"}
    for t in targets:
        value = "not measured" if t["value"] is None else fmt(t["value"], ".3f")
        lines.append(f"  {verdicts[t['met']]}  {t['name']}: {value} (target {t['target']})")
    return lines


def format_kernels(k: dict | None) -> list[str]:
    if not k:
        return []
    lin = k["linear"]
    width = max([24, *(len(name) + 1 for name in lin["kernels"])])  # the path column
    lines = [
        "",
        f"6. Kernels ({lin['method']})",
        f"  {'path':<{width}}{'weights MB':>11}{'1 row ms':>10}{'GB/s':>8}"
        f"{'32 rows ms':>12}{'GFLOP/s':>9}",
    ]
    for name, e in lin["kernels"].items():
        lines.append(
            f"  {name:<{width}}{e['weight_bytes'] / 1e6:11.1f}{e['ms_1']:10.1f}"
            f"{e['gb_s_1']:8.1f}{e['ms_32']:12.1f}{e['gflop_s_32']:9.1f}"
        )
    if lin.get("extension"):
        lines.append(f"  our kernels: {lin['extension']}")
    for kind in ("int8", "int4"):
        vs_ref = lin.get("ours_vs_reference", {}).get(kind, {})
        vs_f32 = lin.get("ours_vs_float32", {}).get(kind, {})
        lines.append(
            f"  {kind} ours, 1 row / 32 rows: {fmt(vs_ref.get('rows_1'), '.2f')}× / "
            f"{fmt(vs_ref.get('rows_32'), '.2f')}× its torch reference's speed, "
            f"{fmt(vs_f32.get('rows_1'), '.2f')}× / {fmt(vs_f32.get('rows_32'), '.2f')}× "
            "the best float32's"
        )
    a = k["attention"]
    kernel = f"our kernel {a['kernel_ms']:.1f} ms" if "kernel_ms" in a else "kernel unavailable"
    lines.append(
        f"  attention alone, one decode step (all layers), batch {a['batch']}, "
        f"mean context {a['mean_context']:.0f}: torch (gather + SDPA) "
        f"{a['torch_ms']:.1f} ms, {kernel} "
        f"(K/V to read {a['kv_bytes_read'] / 1e6:.0f} MB)"
    )
    lines.append("  decode step (median ms)   kernels=torch   kernels=auto")
    d = k["decode"]
    for key, label in (("batch_1", "batch 1"), ("full_batch", "full batch, prompts 384")):
        t, a2 = d["torch"][key], d["auto"][key]
        lines.append(
            f"  {label:<26}{fmt(t.get('step_ms'), '13.1f')}"
            f"{fmt(a2.get('step_ms'), '15.1f')}   ({fmt(t.get('tokens_per_s'))} → "
            f"{fmt(a2.get('tokens_per_s'))} tokens/s; auto ran {d['auto']['path']})"
        )
    return lines


def format_spec_decode(r: dict) -> list[str]:
    sc = r["speculative_config"]
    lines = [
        f"7. Speculative decoding ({sc['method']}, k={sc['num_speculative_tokens']}, n-gram "
        f"{sc['prompt_lookup_min']}..{sc['prompt_lookup_max']}; {r['num_requests']} requests "
        f"× {r['output_len']} tokens, {r['sampling']})",
        "  workload     batch-1 tok/s plain → ngram (×)   offline tok/s plain → ngram (×)  "
        "accepted  mean len  same output",
    ]
    for name, w in r["workloads"].items():
        p, n, spec = w["plain"], w["ngram"], w["ngram"]["spec"]
        rate, mean_len = spec["acceptance_rate"], spec["mean_accepted_length"]
        b1_x, off_x = w["speedup_decode_batch1"], w["speedup_offline"]
        lines.append(
            f"  {name:<12} {fmt(p['decode_batch1_tokens_per_s']):>8} → "
            f"{fmt(n['decode_batch1_tokens_per_s']):>7} ({fmt(b1_x, '.2f')}×)"
            f"      {fmt(p['offline_output_tokens_per_s']):>8} → "
            f"{fmt(n['offline_output_tokens_per_s']):>7} ({fmt(off_x, '.2f')}×)"
            f"  {fmt(rate and 100 * rate, '.0f'):>7}%  {fmt(mean_len, '.2f'):>8}"
            f"  {'yes' if w['identical_outputs'] else 'NO'}"
        )
    return lines


def format_variants(v: dict) -> list[str]:
    lines = [
        "8. dtype and quantization side by side (measured one after the other; roofline at the "
        "read bandwidth sampled next to each decode, 'of best' at the run's best "
        f"{v['bandwidth_gb_s']:.1f} GB/s)",
        f"  {'variant':<20}{'MB/step':>9}{'matvec GB/s':>13}{'decode tok/s':>14}"
        f"{'× fp32':>8}{'GB/s':>7}{'of roof':>9}{'of best':>9}{'offline tok/s':>15}{'× fp32':>8}",
    ]
    for r in v["rows"]:
        if "skipped" in r:
            lines.append(f"  {r['name']:<20}skipped: {r['skipped']}")
            continue
        frac, of_best = r["fraction_of_roofline"], r.get("fraction_of_best_roofline")
        lines.append(
            f"  {r['name']:<20}{r['weight_bytes_per_step'] / 1e6:9.1f}"
            f"{r['matvec']['matvec_gb_s']:13.1f}{fmt(r['decode_tokens_per_s'], '14.1f')}"
            f"{fmt(r.get('decode_vs_float32'), '8.2f')}{fmt(r.get('bandwidth_gb_s'), '7.1f')}"
            f"{fmt(frac and 100 * frac, '8.0f')}%{fmt(of_best and 100 * of_best, '8.0f')}%"
            f"{fmt(r['offline_tokens_per_s'], '.1f'):>15}"
            f"{fmt(r.get('offline_vs_float32'), '.2f'):>8}"
        )
    skipped = {r["offline_skipped"] for r in v["rows"] if "offline_skipped" in r}
    return lines + [f"  offline of the rows marked —: {why}" for why in sorted(skipped)]


def format_llama_cpp(peer: dict, r: dict) -> list[str]:
    head = ["", "Peer: llama.cpp on the same GGUF file, batch-1 decode"]
    if "skipped" in peer:
        return [*head, f"  skipped: {peer['skipped']}"]
    ours = r["decode_batch1"].get("tokens_per_s")
    label = r["conditions"].get("quantization_method") or r["conditions"]["dtype"]
    return [
        *head,
        f"  llama.cpp Q4_1  decode {peer['decode_tokens_per_s']:.1f} tokens/s "
        f"({peer['decode_step_ms']:.1f} ms/step), prefill {peer['prefill_tokens_per_s']:.0f} "
        f"tokens/s; the engine's section-3 decode ({label}) ÷ llama.cpp's = "
        f"{fmt(ratio(ours, peer['decode_tokens_per_s']), '.2f')} ({peer['method']})",
        *([f"  note: {peer['note']}"] if peer.get("note") else []),
    ]


def format_fidelity(f: dict) -> str:
    if "error" in f:
        return f"\n10. Simulator fidelity: not measured, the section failed ({f['error']})"
    fit = f["calibration"]["fit"]
    lines = [
        "",
        f"10. Simulator fidelity (same workload, all at t=0; calibration fitted on "
        f"{f['calibration']['workload']['num_requests']} other requests: {fit['steps']} steps, "
        f"median step error {100 * fit['median_abs_relative_error']:.1f} %)",
        "  figure                 real (measured)   simulated (computed)   error",
    ]
    for name, row in f["figures"].items():
        err = "—" if row["relative_error"] is None else f"{100 * row['relative_error']:+.1f} %"
        lines.append(
            f"  {name:<22} {fmt(row['real'], '12.3f')}       {fmt(row['simulated'], '12.3f')}"
            f"          {err:>8}  "
            f"{'within' if row['met'] else 'NOT within'} {100 * f['target']:.0f} %"
        )
    lines.append(
        f"  steps real {f['steps']['real']} / simulated {f['steps']['simulated']}; preemptions "
        f"{f['preemptions']['real']} / {f['preemptions']['simulated']}; the simulation took "
        f"{f['simulated_wall_s']:.2f} s"
    )
    lines.append(f"  ({f['evidence']})")
    return "\n".join(lines)


def format_parallel(r: dict | None) -> list[str]:
    if not r:
        return []
    tp, pp = r["tensor_parallel_size"], r["pipeline_parallel_size"]
    lines = [
        "",
        f"9. Parallel: tp {tp} × pp {pp} worker processes against tp 1 (measured, same "
        f"{r['num_requests']} requests, greedy; start-up {r['startup_s']:.0f} s)",
        f"  {'engine':<10}{'offline tok/s':>14}{'batch-1 tok/s':>15}{'comm share':>12}"
        f"{'all-reduce/step':>17}{'weights MB':>12}",
    ]
    for name, row in r["rows"].items():
        share = row["comm_share"]
        lines.append(
            f"  {name:<10}{row['offline_output_tokens_per_s']:14.1f}"
            f"{row['decode_batch1_tokens_per_s'] or 0:15.1f}"
            f"{'—' if share is None else f'{100 * share:.0f} %':>12}"
            f"{row['all_reduces_per_step']:17.1f}{row['weight_bytes'] / 1e6:12.1f}"
        )
    speed = r["speedup_offline"]
    lines += [
        f"  speed-up offline {speed or 0:.2f}×, batch-1 decode "
        f"{r['speedup_decode_batch1'] or 0:.2f}×; all-reduces per step derived "
        f"{r['derived_all_reduces_per_step']} (2 per layer); identical outputs: "
        f"{r['identical_outputs']}",
        f"  threads: tp 1 {r['rows']['tp1']['threads_per_process']} in one process; each worker "
        f"{next(reversed(r['rows'].values()))['threads_per_process']} (on a CPU the workers "
        "share the same cores; on a busy machine more processes also get more of its time, so "
        "a speed-up here says little about devices)",
    ]
    return lines
