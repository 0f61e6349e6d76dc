"""`meshserve plan`: the mesh planner's command line, a ranked table and optional JSON.

`add_plan_parser(subparsers)` adds the `plan` subcommand to the `meshserve` parser and
`run(args)` runs it; `python -m meshserve.serving.bench.plan_command plan ...` runs it
alone. The cost model is `meshserve.sharding.planner`; nothing here imports jax, so planning
starts at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from meshserve.model.config import DTYPES, PRESETS
from meshserve.sharding.hardware import HARDWARE, hardware
from meshserve.sharding.planner import (DEFAULT_HEADROOM, PLANNING_MODELS, MeshPlan, Plan,
                                        PlanOptions, Slo, Workload, model_summary, plan)

COLUMNS = ("mesh (d,s,m)", "weights/dev", "KV/token/dev", "max batch", "batch", "decode tick",
           "TP comm", "PP send", "stage util", "TTFT", "TPOT", "output tok/s", "SLO")


HELP = "predict how a model serves on each (data, stage, model) mesh and rank them"


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """The `plan` subcommand and its flags, on the `meshserve` parser's subparsers."""
    sub = subparsers.add_parser("plan", help=HELP)
    add_arguments(sub)
    return sub


def add_arguments(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--model", default="llama-2-70b",
                     help=f"a preset: {', '.join(sorted({**PRESETS, **PLANNING_MODELS}))}")
    sub.add_argument("--hardware", default="h100-sxm",
                     help=f"{', '.join(sorted(HARDWARE))}, or a full spec "
                          f"'flops=989e12,hbm_bw=3.35e12,hbm=80e9,link_bw=450e9,per_node=8' "
                          f"(optional: inter_node_bw, f32_flops, name)")
    sub.add_argument("--devices", type=int, default=8, help="devices to split into a mesh")
    sub.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="weights and KV cache")
    sub.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens per request")
    sub.add_argument("--output-len", type=int, default=1024, help="output tokens per request")
    sub.add_argument("--concurrency", type=_concurrency, default=None,
                     help="requests in flight, or 'max' (default): as many as fit")
    sub.add_argument("--page-size", type=int, default=16, help="KV page size, in tokens")
    sub.add_argument("--ttft", type=float, default=Slo().ttft, help="TTFT limit, seconds")
    sub.add_argument("--tpot", type=float, default=Slo().tpot, help="TPOT limit, seconds")
    sub.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM,
                     help="share of HBM kept free of weights and KV")
    sub.add_argument("--microbatches", type=int, default=None,
                     help="microbatches per pipeline (default: as many as stages)")
    sub.add_argument("--fill-bubbles", action="store_true",
                     help="run prefill in the pipeline's idle decode ticks")
    sub.add_argument("--output", type=Path, default=None, help="also write the plan as JSON")


def _concurrency(text: str) -> int | None:
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int or 'max', got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    """Prints the ranked table; writes JSON to `args.output` when given. Bad input raises
    ValueError with what to change."""
    result = plan_from_args(args)
    print(format_plan(result))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        print(f"wrote {args.output}")
    return 0


def plan_from_args(args: argparse.Namespace) -> Plan:
    workload = Workload(prompt_len=args.prompt_len, output_len=args.output_len,
                        concurrency=args.concurrency, page_size=args.page_size)
    options = PlanOptions(headroom=args.headroom, microbatches=args.microbatches,
                          fill_bubbles=args.fill_bubbles)
    return plan(args.model, hardware(args.hardware), args.devices, workload,
                Slo(ttft=args.ttft, tpot=args.tpot), options, dtype=args.dtype)


def format_plan(result: Plan) -> str:
    w, slo = result.workload, result.slo
    concurrency = "max" if w.concurrency is None else w.concurrency
    header = (f"{model_summary(result.config)} on {result.num_devices} x {result.hardware.name}; "
              f"prompt {w.prompt_len}, output {w.output_len}, concurrency {concurrency}; "
              f"SLOs TTFT {slo.ttft:g} s, TPOT {slo.tpot * 1e3:g} ms")
    rows = [COLUMNS] + [_cells(m) for m in result.meshes]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = [header, ""]
    for mesh_plan, cells in zip((None,) + result.meshes, rows):
        line = "  ".join(c.rjust(n) if i else c.ljust(n) for i, (c, n) in
                         enumerate(zip(cells, widths)))
        lines.append((line + "  " + _remark(mesh_plan)).rstrip())
    return "\n".join(lines + ["", _verdict(result)])


def _cells(m: MeshPlan) -> tuple[str, ...]:
    mesh = f"({m.mesh.data},{m.mesh.stage},{m.mesh.model})"
    if m.weight_bytes is None:
        return (mesh,) + ("-",) * (len(COLUMNS) - 1)
    memory = (f"{m.weight_bytes / 1e9:.1f} GB", f"{m.kv_bytes_per_token / 1e3:.1f} KB")
    if not m.feasible:
        return (mesh, *memory) + ("-",) * (len(COLUMNS) - 3)
    return (mesh, *memory, f"{m.max_batch}", f"{m.batch}", _ms(m.decode_tick_s),
            _ms(m.tp_comm_s), _ms(m.pp_send_s), f"{m.utilisation:.2f}", f"{m.ttft_s:.2f} s",
            _ms(m.tpot_s), f"{m.throughput:,.0f}", "met" if m.meets_slo else "missed")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _remark(m: MeshPlan | None) -> str:
    if m is None:
        return "notes"
    return m.reason if not m.feasible else "; ".join(m.notes)


def _verdict(result: Plan) -> str:
    best, closest = result.recommended, result.closest
    if best is not None:
        return (f"recommended: {best.mesh} at {best.throughput:,.0f} output tokens/s, TTFT "
                f"{best.ttft_s:.2f} s, TPOT {best.tpot_s * 1e3:.1f} ms")
    if closest is None:
        return "no mesh can hold the model and one sequence: add devices or lower the context"
    return (f"no mesh meets the SLOs; closest: {closest.mesh} at {closest.throughput:,.0f} output "
            f"tokens/s, TTFT {closest.ttft_s:.2f} s, TPOT {closest.tpot_s * 1e3:.1f} ms")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as err:
        print(f"meshserve: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
