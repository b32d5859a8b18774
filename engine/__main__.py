"""Command line: python -m engine {artifact,generate,serve,bench,quality,simulate,selfcheck}.

A thin dispatcher: the commands and their flags are in engine/entrypoints/cli.py, one small
function each. Across machines, generate and serve also run under torchrun (one process per rank;
see docs/distributed.md): `torchrun --nnodes 2 --node-rank R --nproc-per-node 1 --master-addr A
--master-port P -m engine generate "prompt" -pp 2` (the default model splits by tp 3, not 2)."""

from __future__ import annotations

import sys

from engine.artifact import ArtifactError
from engine.entrypoints.cli import build_parser, torchrun_dispatch


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status = torchrun_dispatch(args)  # launched by torchrun: RANK > 0 serves RANK 0
        if status is not None:
            return status
        return args.func(args)
    except (ArtifactError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
