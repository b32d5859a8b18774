"""Command line: python -m engine {artifact,generate,serve,bench,selfcheck}."""

from __future__ import annotations

import argparse
import sys

from engine.artifact import ArtifactError


def cmd_artifact(args: argparse.Namespace) -> int:
    from engine import artifact

    if args.action == "build":
        artifact.build_default_artifact()
    elif args.action == "path":
        print(artifact.resolve_model_path(args.model))
    elif args.action == "info":
        print(artifact.format_info(artifact.inspect_artifact(args.model)))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.core import EngineConfig, EngineCore
    from engine.sampling_params import SamplingParams

    engine = EngineCore(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                     enforce_eager=args.enforce_eager))
    _configure_cuda_graphs(engine)
    prompt = args.prompt
    if not args.raw:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    request = engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            print(output.delta_text, end="", flush=True)
            if output.finished:
                m = output.metrics
                print(f"\n[{output.finish_reason}] {m.num_prompt_tokens} prompt + {m.num_output_tokens} output tokens; "
                      f"TTFT {1000 * m.ttft:.0f} ms, TPOT {1000 * (m.tpot or 0):.1f} ms, E2E {1000 * m.e2e:.0f} ms "
                      f"(measured, {engine.device.type}, {str(engine.dtype).removeprefix('torch.')})", file=sys.stderr)
    return 0 if request.finish_reason != "abort" else 1


def cmd_serve(args: argparse.Namespace) -> int:
    from engine.core import EngineConfig, EngineCore
    from engine.server import serve

    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, num_kv_blocks=args.num_kv_blocks,
                          max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          enforce_eager=args.enforce_eager)
    engine = EngineCore(config)
    _configure_cuda_graphs(engine)
    print(f"serving {engine.model_dir.name} ({engine.device.type}, {str(engine.dtype).removeprefix('torch.')}, "
          f"{engine.num_blocks} KV blocks of {config.block_size} tokens, context {engine.max_model_len}) "
          f"on http://{args.host}:{args.port}/v1" + (" (API key required)" if args.api_key else ""),
          file=sys.stderr, flush=True)
    serve(engine, host=args.host, port=args.port, api_key=args.api_key, log_level=args.log_level)
    return 0


def _configure_cuda_graphs(engine) -> None:
    """CUDA graphs for decode steps on a GPU unless --enforce-eager (engine/cuda_graphs.py)."""
    from engine.cuda_graphs import configure_engine

    decision = configure_engine(engine)
    if engine.device.type == "cuda":
        print(f"CUDA graphs: {decision}", file=sys.stderr)


def cmd_selfcheck(args: argparse.Namespace) -> int:
    from engine import selfcheck

    return selfcheck.main(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from engine import bench

    return bench.main(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine", description="A small vLLM-shaped inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("artifact", help="build, locate or inspect the model artifact")
    p.add_argument("action", choices=["build", "info", "path"])
    p.add_argument("--model", default=None, help="model directory (default: the embedded artifact)")
    p.set_defaults(func=cmd_artifact)

    p = sub.add_parser("generate", help="stream one answer to the terminal")
    p.add_argument("prompt")
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (FastAPI + uvicorn)")
    p.add_argument("--model", default=None, help="model directory (default: the embedded artifact)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="if set, clients must send 'Authorization: Bearer KEY'")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--log-level", default="info")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="measure the machine's ceilings, the engine against transformers, latency")
    p.add_argument("--json", default=None, help="where to write the results (default: bench-results/latest.json)")
    p.add_argument("--quick", action="store_true", help="a smaller workload (about a minute on a laptop CPU)")
    p.add_argument("--model", default=None, help="model directory (default: the embedded artifact)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--num-requests", type=int, default=None, help="offline workload size (default 64, quick 16)")
    p.add_argument("--prompt-len", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    p.add_argument("--max-num-seqs", type=int, default=None, help="engine batch and transformers static batch (32)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine token budget per step (512)")
    p.add_argument("--latency-requests", type=int, default=None, help="requests per arrival rate (default 32, quick 8)")
    p.add_argument("--rates", type=float, nargs="+", default=None, help="arrival rates in requests/s "
                   "(default: fractions of the measured offline request rate)")
    p.add_argument("--skip-transformers", action="store_true", help="do not run the transformers baseline")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("selfcheck", help="prove this device works: oracle, features, KV sizing, "
                       "CUDA graphs, a quick bench")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (CUDA if available)")
    p.add_argument("--model", default=None, help="model directory (default: the embedded artifact)")
    p.add_argument("--json", default=None, help="also write every result to this JSON file")
    p.add_argument("--quick", action="store_true", help="a much smaller bench")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.set_defaults(func=cmd_selfcheck)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ArtifactError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
