"""The command line's commands, one small function each: `add_<command>_parser` declares a
command's flags, `cmd_<command>` runs it. engine/__main__.py builds the parser from these and
dispatches; the heavy modules (torch, the server, the instruments in engine/tools) load only
inside the command that needs them, so `python -m engine --help` stays fast."""

from __future__ import annotations

import argparse
import json
import os
import sys

from engine.config import (
    DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
)
from engine.entrypoints.disagg_cli import add_kv_transfer_args, add_proxy_parser, kv_transfer_config
from engine.entrypoints.weights_cli import add_quantization_args

# engine.entrypoints.server.app.API_KEY_ENV, spelled out: importing the server here would load
# torch for --help.
SERVE_API_KEY_ENV = "LLM_LAB_API_KEY"


def speculative_config_arg(text: str) -> dict:
    """--speculative-config '{"method": "ngram", "num_speculative_tokens": 3, ...}' (JSON, like
    vLLM's option)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """vLLM's flags: worker processes that split the model (engine/executor/multiproc.py)."""
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="worker processes that split every layer (heads, MLP columns); default 1",
    )
    p.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="pipeline stages (runs of layers), one worker process each per tp rank; default 1",
    )


def add_kernels_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kernels",
        choices=["auto", "torch"],
        default="auto",
        help="auto: our C++ CPU kernels when they build (default); torch: the reference",
    )


TORCHRUN_COMMANDS = ("generate", "serve")


def torchrun_dispatch(args: argparse.Namespace) -> int | None:
    """Under torchrun (RANK and WORLD_SIZE in the environment, one process per rank): check
    that WORLD_SIZE is tp × pp before anything loads; RANK 0 goes on to run the command (the
    engine core plus its own shard), every other rank serves RANK 0's steps until it shuts down
    and prints nothing. Returns the exit status of a rank > 0, None where the command runs."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None  # not launched by torchrun
    from engine.executor.multiproc import run_torchrun_worker
    from engine.executor.transport import check_torchrun_world

    tp = getattr(args, "tensor_parallel_size", 1)
    pp = getattr(args, "pipeline_parallel_size", 1)
    if args.command not in TORCHRUN_COMMANDS and int(os.environ["WORLD_SIZE"]) > 1:
        raise ValueError(
            f"under torchrun only {' and '.join(TORCHRUN_COMMANDS)} run across processes; "
            f"run {args.command!r} without torchrun"
        )
    rank = check_torchrun_world(tp, pp)
    if rank == 0:
        return None
    return run_torchrun_worker(args.model, args.device, tp, pp)


def _report_layout(engine) -> None:
    """Which worker holds which layers and heads (multi-process executor only)."""
    layout = getattr(engine.executor, "layout", None)
    if layout is not None:
        from engine.layers.sharding import describe_layout

        print(describe_layout(layout()), file=sys.stderr)


def cmd_artifact(args: argparse.Namespace) -> int:
    from engine import artifact

    if args.action == "build":
        artifact.build_default_artifact()
    elif args.action == "path":
        print(artifact.resolve_model_path(args.model))
    elif args.action == "info":
        print(artifact.format_info(artifact.inspect_artifact(args.model)))
    return 0


def engine_config(args: argparse.Namespace):
    """The EngineConfig a command's flags name: each field its flag sets (the rest default)."""
    from dataclasses import fields

    from engine.config import EngineConfig
    from engine.kv_connector import KVTransferConfig

    given = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    mb = getattr(args, "kv_offload_mb", None)  # generate's host tier (OffloadingConnector)
    offload = KVTransferConfig("OffloadingConnector", offload_bytes=int(mb * 2**20)) if mb else None
    return EngineConfig(**given, kv_transfer_config=kv_transfer_config(args) or offload)


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.core import EngineCore
    from engine.sampling_params import SamplingParams

    engine = EngineCore(engine_config(args))
    _report_cuda_graphs(engine)
    _report_layout(engine)
    prompt = args.prompt
    if not args.raw:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    request = engine.add_request(prompt, params)
    records = []
    while engine.has_unfinished_requests():
        records.append(engine.step())
        for output in records[-1].outputs:
            print(output.delta_text, end="", flush=True)
            if output.finished:
                m = output.metrics
                print(
                    f"\n[{output.finish_reason}] {m.num_prompt_tokens} prompt + "
                    f"{m.num_output_tokens} output tokens; "
                    f"TTFT {1000 * m.ttft:.0f} ms, TPOT {1000 * (m.tpot or 0):.1f} ms, "
                    f"E2E {1000 * m.e2e:.0f} ms "
                    f"(measured, {engine.device.type}, {str(engine.dtype).removeprefix('torch.')})",
                    file=sys.stderr,
                )
    if engine.kv_connector is not None:
        print(f"[kv connector] {engine.kv_connector.stats}", file=sys.stderr)
    if args.trace:
        write_run_trace(args.trace, "generate", records, engine.all_requests(), sys.stderr)
    engine.shutdown()
    return 0 if request.finish_reason != "abort" else 1


def add_trace_arg(p: argparse.ArgumentParser, what: str) -> None:
    """`--trace PATH`: the run as a Chrome / Perfetto trace (docs/traces.md)."""
    p.add_argument(
        "--trace",
        default=None,
        metavar="PATH",
        help=f"also write {what} as a Chrome / Perfetto trace (Trace Event Format JSON, engine "
        "clock; open it in ui.perfetto.dev or chrome://tracing; docs/traces.md)",
    )


def write_run_trace(path: str, label: str, records, requests, out=None) -> None:
    """Write one run's trace; say where (on `out`, default stdout)."""
    from engine.tools.trace_export import write_trace

    write_trace(path, [(label, records, requests)])
    note = f"trace written to {path} (open it in ui.perfetto.dev or chrome://tracing)"
    print(note, file=out or sys.stdout)


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C; exit status 1 if the engine loop dies (so a supervisor restarts us)."""
    from engine.core import EngineCore
    from engine.entrypoints.server.app import ConnectionLimits, serve
    from engine.entrypoints.server.protocol import DEFAULT_MAX_BODY_BYTES

    config = engine_config(args)
    engine = EngineCore(config)
    _report_cuda_graphs(engine)
    _report_layout(engine)
    name = args.served_model_name or engine.model_dir.name
    print(
        f"serving {name} ({engine.device.type}, {str(engine.dtype).removeprefix('torch.')}, "
        f"{engine.num_blocks} KV blocks of {config.block_size} tokens, context "
        f"{engine.max_model_len}) on http://{args.host}:{args.port}/v1"
        + (" (API key required)" if args.api_key else ""),
        file=sys.stderr,
        flush=True,
    )
    try:
        return serve(
            engine,
            host=args.host,
            port=args.port,
            api_key=args.api_key or None,
            log_level=args.log_level,
            served_model_name=args.served_model_name,
            public_docs_and_metrics=args.public_docs_and_metrics,
            max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES,
            limits=ConnectionLimits.from_env(
                header_timeout=args.header_timeout,
                body_timeout=args.body_timeout,
                max_connections=args.max_connections,
            ),
        )
    finally:
        engine.shutdown()  # worker processes (and, under torchrun, the other ranks) stop


def _report_cuda_graphs(engine) -> None:
    """What the engine decided about CUDA graphs (engine/worker/cuda_graphs.py), on a GPU."""
    if engine.device.type == "cuda":
        print(f"CUDA graphs: {engine.cuda_graphs}", file=sys.stderr)


def cmd_selfcheck(args: argparse.Namespace) -> int:
    from engine.tools import selfcheck

    return selfcheck.main(args)


def bench_config(args: argparse.Namespace):
    """The BenchConfig the flags ask for (the quick one with --quick); unset flags keep its
    defaults."""
    from engine.tools.bench.config import BenchConfig
    from engine.tools.bench.variants import DEFAULT_VARIANTS

    flags = dict(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        seed=args.seed,
        num_requests=args.num_requests,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        latency_requests=args.latency_requests,
        latency_rates=tuple(args.rates) if args.rates else None,
        skip_transformers=args.skip_transformers or None,
        kernels=args.kernels,
        speculative=args.speculative,
        speculative_config=args.speculative_config,
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
        linear_precision=args.linear_precision,
        kv_cache_dtype=args.kv_cache_dtype,
        compare_variants=DEFAULT_VARIANTS if args.compare_quantization else None,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        prompt_len=tuple(args.prompt_len) if args.prompt_len else None,
        output_len=tuple(args.output_len) if args.output_len else None,
        trace=args.trace,
    )
    overrides = {k: v for k, v in flags.items() if v is not None}
    return BenchConfig.quick_config(**overrides) if args.quick else BenchConfig(**overrides)


def cmd_bench(args: argparse.Namespace) -> int:
    from engine.tools.bench.run import bench_and_report

    return bench_and_report(bench_config(args), args.json)


def cmd_quality(args: argparse.Namespace) -> int:
    from engine.tools import quality

    variants = [quality.Variant.parse(v) for v in args.variants] if args.variants else None
    result = quality.evaluate(
        args.model,
        variants or quality.DEFAULT_VARIANTS,
        text=open(args.text, encoding="utf-8").read() if args.text else None,
        text_tokens=args.text_tokens,
        max_tokens=args.max_tokens,
        device=args.device,
        greedy=not args.no_greedy,
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    print(quality.format_quality(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


def _trace_workload(args: argparse.Namespace, engine_config: dict):
    """--trace-file read for the chosen model preset at full scale (unless --time-scale or caps
    say otherwise); a prompt + output longer than the context is cut to it (and counted), and the
    context defaults to the trace's longest request, up to the model's limit."""
    from engine.tools.presets import load_model_preset
    from engine.tools.trace_readers import read_trace

    preset = load_model_preset(args.model_preset)
    limit = engine_config.get("max_model_len") or preset.config.max_position_embeddings
    trace = read_trace(
        args.trace_file,
        preset.config.vocab_size,
        args.trace_format,
        special_ids={preset.bos_token_id, preset.eos_token_id} - {None},
        time_scale=args.time_scale,
        max_requests=args.max_requests,
        max_input_len=args.max_input_len,
        max_output_len=args.max_output_len,
        max_total_len=limit,
    )
    longest = max(len(r.prompt_token_ids) + r.output_len for r in trace.requests)
    engine_config.setdefault("max_model_len", max(longest, 16))
    return trace


def cmd_simulate(args: argparse.Namespace) -> int:
    from engine.tools import presets, simulator

    if args.list:
        print("model presets:    " + ", ".join(presets.model_preset_names()))
        print("hardware presets: " + ", ".join(presets.hardware_preset_names()))
        print("link presets:     " + ", ".join(presets.link_preset_names()))
        return 0
    if args.calibrate:
        from engine.tools.calibration import calibrate

        calibrate(quick=args.quick_calibration)
    engine_config = {
        k: v
        for k, v in dict(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
        ).items()
        if v is not None
    }
    trace = _trace_workload(args, engine_config) if args.trace_file else None
    if args.disaggregate or args.pd_sweep:
        from engine.tools.disagg_sim import run_cli

        data = run_cli(args, engine_config, trace)
        return _write_json(args.json, data)
    result = simulator.simulate(
        args.model_preset,
        args.hardware,
        rate=None if trace else args.rate,
        num_requests=args.num_requests,
        prompt_len=tuple(args.prompt_len),
        output_len=tuple(args.output_len),
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        workload=trace.requests if trace else None,
        **engine_config,
    )
    text = simulator.format_result(result)
    if trace:
        from engine.tools.trace_readers import describe

        drawn = ("rate_req_s", "prompt_len", "output_len", "seed")  # Poisson's, unused here
        kept = {k: v for k, v in result.conditions["workload"].items() if k not in drawn}
        result.conditions["workload"] = {**kept, **trace.conditions}
        text = text.replace("all at once", "arrivals from the trace", 1)
        text += "\n" + describe(trace)
    print(text)
    if args.trace:
        write_run_trace(args.trace, "simulate", result.records, result.requests)
    data = {"summary": result.summary, "conditions": result.conditions}
    return _write_json(args.json, {**data, "requests": [m.as_dict() for m in result.metrics]})


SPEC_HELP = (
    'speculative decoding as JSON, e.g. \'{"method": "ngram", '
    '"num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}\''
)


def add_artifact_parser(sub) -> None:
    """`python -m engine artifact` and its flags."""
    p = sub.add_parser("artifact", help="build, locate or inspect the model artifact")
    p.add_argument("action", choices=["build", "info", "path"])
    p.add_argument("--model", default=None, help="model directory (default: the embedded artifact)")
    p.set_defaults(func=cmd_artifact)


def add_generate_parser(sub) -> None:
    """`python -m engine generate` and its flags."""
    p = sub.add_parser("generate", help="stream one answer to the terminal")
    p.add_argument("prompt")
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--raw", action="store_true", help="send the prompt as is, without the chat template"
    )
    p.add_argument("--speculative-config", type=speculative_config_arg, help=SPEC_HELP)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--kv-offload-mb", type=float, metavar="N", help="host KV tier, MiB (docs/kv_connector.md)"
    )
    add_kernels_arg(p)
    add_quantization_args(p)
    add_parallel_args(p)
    add_trace_arg(p, "the run (its steps and the request's journey)")
    p.set_defaults(func=cmd_generate)


def add_serve_parser(sub) -> None:
    """`python -m engine serve` and its flags."""
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (FastAPI + uvicorn)",
        description="OpenAI-compatible HTTP server. Exits with status 1 if the "
        "engine loop dies, so that a supervisor can restart it.",
    )
    p.add_argument("--model", default=None, help="model directory (default: the embedded artifact)")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the API (default: the model directory's name)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default: 127.0.0.1, this machine only)",
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get(SERVE_API_KEY_ENV),
        help="if set, clients must send 'Authorization: Bearer KEY' (everything but "
        f"/health); default: the environment variable {SERVE_API_KEY_ENV}, which keeps "
        "the key out of the process list",
    )
    p.add_argument(
        "--public-docs-and-metrics",
        action="store_true",
        help="serve /metrics, /docs and /openapi.json without the API key",
    )
    add_connection_limit_args(p)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    p.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD,
        help="max prompt tokens one request may take per step, so a long prompt cannot starve "
        f"short ones (0: no cap; default {DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD}, not vLLM's 0: on "
        "a CPU a step costs about its tokens, and the cap lets short requests into the steps of "
        "a long prefill at the price of more steps for the long prompt)",
    )
    p.add_argument("--log-level", default="info")
    p.add_argument("--speculative-config", type=speculative_config_arg, help=SPEC_HELP)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    add_kernels_arg(p)
    add_quantization_args(p)
    add_parallel_args(p)
    add_iteration_timeout_arg(p)
    add_kv_transfer_args(p)
    p.set_defaults(func=cmd_serve)


def add_connection_limit_args(p: argparse.ArgumentParser) -> None:
    """serve's bounds on what one client may hold: body size, head and body deadlines and open
    connections (engine/entrypoints/server/app.py's ConnectionLimits)."""
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="larger request bodies get a 413 (default 2 MiB)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=None,
        help="seconds a connection has to send its request head (default 10, or the "
        "environment variable LLM_LAB_HEADER_TIMEOUT_S)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=None,
        help="seconds a request has to send its body after its head (default 30, or "
        "LLM_LAB_BODY_TIMEOUT_S)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open connections beyond this get a 503 (default: half the file-descriptor "
        "limit, at most 1000, or LLM_LAB_MAX_CONNECTIONS)",
    )


def add_iteration_timeout_arg(p: argparse.ArgumentParser) -> None:
    """The engine-iteration watchdog (vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S)."""
    p.add_argument(
        "--engine-iteration-timeout-s",
        type=float,
        default=None,
        help="a step running longer counts as hung: /health answers 503, and with worker "
        "processes (-tp/-pp) the step fails and the server exits with status 1 (default 60, "
        "or the environment variable LLM_ENGINE_ITERATION_TIMEOUT_S)",
    )


def add_bench_workload_args(p: argparse.ArgumentParser) -> None:
    """The bench's workload: its size, lengths, the engine's batch and the latency rates."""
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="offline workload size (default 64, quick 16)",
    )
    p.add_argument("--prompt-len", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="engine batch and transformers static batch (32)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=f"engine token budget per step ({DEFAULT_MAX_NUM_BATCHED_TOKENS})",
    )
    p.add_argument(
        "--latency-requests",
        type=int,
        default=None,
        help="requests per arrival rate (default 32, quick 8)",
    )
    p.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=None,
        help="arrival rates in requests/s "
        "(default: fractions of the measured offline request rate)",
    )


def add_bench_parser(sub) -> None:
    """`python -m engine bench` and its flags."""
    p = sub.add_parser(
        "bench", help="measure the machine's ceilings, the engine against transformers, latency"
    )
    p.add_argument(
        "--json",
        default=None,
        help="where to write the results (default: bench-results/latest.json)",
    )
    p.add_argument(
        "--quick", action="store_true", help="a smaller workload (about a minute on a laptop CPU)"
    )
    p.add_argument("--model", default=None, help="model directory (default: the embedded artifact)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)"
    )
    p.add_argument("--seed", type=int, default=None)
    add_bench_workload_args(p)
    p.add_argument(
        "--skip-transformers", action="store_true", help="do not run the transformers baseline"
    )
    p.add_argument(
        "--kernels",
        choices=["auto", "torch"],
        default=None,
        help="auto: our C++ CPU kernels when they build (default); torch: the reference",
    )
    p.add_argument(
        "--speculative",
        choices=["ngram"],
        default=None,
        help="also measure speculative decoding (n-gram) against plain decoding",
    )
    p.add_argument(
        "--speculative-config",
        type=speculative_config_arg,
        default=None,
        help=SPEC_HELP + " (for --speculative; default k=3, n-gram 1 to 3)",
    )
    add_quantization_args(p)
    p.add_argument(
        "--compare-quantization",
        action="store_true",
        help="also measure float32, bfloat16, int8, int4 and gguf side by side (section 8)",
    )
    add_parallel_args(p)  # > 1: also the same workload at this size against tp 1 (section 9)
    add_trace_arg(p, "the offline section's engine run (section 2)")
    p.set_defaults(func=cmd_bench)


def add_trace_file_args(p: argparse.ArgumentParser) -> None:
    """--trace-file and its scaling (engine/tools/trace_readers.py): a production trace instead
    of the Poisson workload (--rate, --num-requests and the length ranges are then unused)."""
    p.add_argument(
        "--trace-file",
        default=None,
        help="replay a trace: Mooncake JSON lines or an Azure LLM inference CSV",
    )
    p.add_argument("--trace-format", choices=["auto", "mooncake", "azure"], default="auto")
    p.add_argument(
        "--time-scale", type=float, default=1.0, help="with --trace-file: arrivals ÷ this (1)"
    )
    p.add_argument("--max-requests", type=int, default=None, help="the trace's first N only")
    p.add_argument("--max-input-len", type=int, default=None, help="cut longer prompts (counted)")
    p.add_argument("--max-output-len", type=int, default=None, help="cut longer outputs (counted)")


def add_disaggregate_args(p: argparse.ArgumentParser) -> None:
    """Disaggregated prefill/decode (engine/tools/disagg_sim.py): a split against colocated, or
    every split of N GPUs, with goodput under the SLOs."""
    p.add_argument("--disaggregate", metavar="P:D", help="P prefill + D decode GPUs vs colocated")
    p.add_argument("--pd-sweep", type=int, metavar="N", help="every split P:D of N GPUs")
    p.add_argument("--link", default="nvlink", help="KV transfer link preset (see --list)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput's TTFT target")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, help="goodput's TPOT target")


def _write_json(path: str | None, data: dict) -> int:
    import json

    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2, ensure_ascii=False)
        print(f"results written to {path}")
    return 0


def add_simulate_parser(sub) -> None:
    """`python -m engine simulate` and its flags."""
    p = sub.add_parser(
        "simulate", help="what-if at scale: the real scheduler on a cost model (no model is run)"
    )
    p.add_argument("--model-preset", default="llama-3.1-8b", help="a model preset (see --list)")
    p.add_argument(
        "--hardware", default="h100-sxm", help="a hardware preset, or this-machine (see --list)"
    )
    p.add_argument(
        "--rate", type=float, default=4.0, help="Poisson arrivals, requests/s (default 4)"
    )
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="pipeline stages (GPUs = tp × pp); the stages run one after another in this engine",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=f"token budget per step ({DEFAULT_MAX_NUM_BATCHED_TOKENS})",
    )
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="max prompt tokens one request may take per step (default 0, no cap: vLLM's default "
        "for a simulated GPU; the real engine's 64 is chosen for CPU step costs)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help=f"requests running at once ({DEFAULT_MAX_NUM_SEQS})",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context limit (default: min(8192, the model's))",
    )
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=None, help="share of GPU memory used (0.9)"
    )
    p.add_argument("--prompt-len", type=int, nargs=2, metavar=("MIN", "MAX"), default=[32, 1024])
    p.add_argument(
        "--output-len",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        default=[32, 512],
        help="each request's target output length is drawn uniformly from this range",
    )
    p.add_argument("--seed", type=int, default=0)
    add_trace_file_args(p)
    p.add_argument(
        "--json",
        default=None,
        help="also write the summary, conditions and per-request metrics here",
    )
    add_trace_arg(p, "the simulated run (every step and request)")
    add_disaggregate_args(p)
    p.add_argument("--list", action="store_true", help="list the presets and exit")
    p.add_argument(
        "--calibrate", action="store_true", help="re-fit this machine's calibration first"
    )
    p.add_argument(
        "--quick-calibration", action="store_true", help="with --calibrate: a smaller run"
    )
    p.set_defaults(func=cmd_simulate)


def add_quality_parser(sub) -> None:
    """`python -m engine quality` and its flags."""
    p = sub.add_parser(
        "quality",
        help="what dtype and quantization cost: agreement with float32, perplexity",
    )
    p.add_argument("--model", default=None, help="model directory (default: the embedded artifact)")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help="e.g. bfloat16 int8 bfloat16+int8 int4 int4/64 gguf (default: these six)",
    )
    p.add_argument("--text", default=None, help="text file for teacher forcing (default README.md)")
    p.add_argument("--text-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--no-greedy", action="store_true", help="teacher-forced figures only")
    p.add_argument("--json", default=None, help="also write the results here")
    p.set_defaults(func=cmd_quality)


def add_selfcheck_parser(sub) -> None:
    """`python -m engine selfcheck` and its flags."""
    p = sub.add_parser(
        "selfcheck",
        help="prove this device works: oracle, features, KV sizing, CUDA graphs, a quick bench",
    )
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (CUDA if available)")
    p.add_argument("--model", default=None, help="model directory (default: the embedded artifact)")
    p.add_argument("--json", default=None, help="also write every result to this JSON file")
    p.add_argument("--quick", action="store_true", help="a much smaller bench")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.set_defaults(func=cmd_selfcheck)


COMMANDS = (
    add_artifact_parser,
    add_generate_parser,
    add_serve_parser,
    add_bench_parser,
    add_simulate_parser,
    add_quality_parser,
    add_selfcheck_parser,
    add_proxy_parser,
)


def build_parser() -> argparse.ArgumentParser:
    """`python -m engine` with every command; each command's `func` is what runs it."""
    parser = argparse.ArgumentParser(
        prog="python -m engine", description="A small vLLM-shaped inference engine."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser in COMMANDS:
        add_parser(sub)
    return parser
