"""Command line: python -m engine {artifact,generate,serve,bench}."""

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

    engine = EngineCore(EngineConfig(model=args.model, device=args.device, dtype=args.dtype))
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
    p.set_defaults(func=cmd_generate)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ArtifactError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
