"""The `meshserve` command line.

`main` is the entry point (the `meshserve` script, `python -m meshserve.serving.cli`). A table of
subcommands, each a module with `HELP`, `add_arguments(parser)` and `run(args)`:

  generate   answer prompts given on the command line, streamed (`cli.generate_command`)
  batch      run a JSONL file of requests, resumable (`cli.batch_command`)
  demo       `batch` on the shipped example prompts (`cli.demo_command`)
  roofline   decode steps against this machine's floor (`bench.roofline_command`)
  quality    quantized weights against float32 (`bench.quality`)
  bench      continuous vs static batching, online or offline (`bench.bench_command`)
  serve      the gRPC server, on one host or many (`cli.serve_command`)
  convert    write a model as a meshserve checkpoint directory (`cli.convert_command`)
  client     prompts to a running `serve` (`cli.client_command`)
  plan       rank the meshes of a model on given hardware from a cost model
             (`bench.plan_command`)
  mesh-sweep measure a model on several meshes of the devices at hand (`bench.mesh_sweep`)

The engine, server and cluster options are generated from the configs' field metadata
(`meshserve.serving.options`), so a knob is declared once and the command line follows it.
Importing this module imports the package `meshserve.serving.cli` first, whose `STARTED` is the
clock startup timings count from.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from meshserve.serving.bench import (bench_command, mesh_sweep, plan_command, quality,
                                     roofline_command)
from meshserve.serving.cli import (batch_command, client_command, convert_command, demo_command,
                                   generate_command, serve_command)

COMMANDS = {
    "generate": generate_command,
    "batch": batch_command,
    "demo": demo_command,
    "roofline": roofline_command,
    "quality": quality,
    "bench": bench_command,
    "serve": serve_command,
    "convert": convert_command,
    "client": client_command,
    "plan": plan_command,
    "mesh-sweep": mesh_sweep,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshserve", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        command.add_arguments(subparsers.add_parser(name, help=command.HELP))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # recorded in results files
    try:
        return COMMANDS[args.command].run(args) or 0
    except (ValueError, FileNotFoundError) as err:
        print(f"meshserve: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
