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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine", description="A small vLLM-shaped inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("artifact", help="build, locate or inspect the model artifact")
    p.add_argument("action", choices=["build", "info", "path"])
    p.add_argument("--model", default=None, help="model directory (default: the embedded artifact)")
    p.set_defaults(func=cmd_artifact)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ArtifactError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
