"""`meshserve mesh-sweep`: one model and workload measured on each of several (data, stage,
model) meshes of the devices at hand, and set beside the planner's prediction for those meshes.

    meshserve mesh-sweep --meshes 1x1x1,1x1x2,1x2x1 --workload fixed-32x16 --concurrency 4
    meshserve mesh-sweep --meshes all --devices 8 --output results/mesh-sweep.json

Meshes are DATAxSTAGExMODEL; `all` is every factorisation of `--devices` (default: the visible
device count). On a CPU, fake devices must be asked for before jax starts:
XLA_FLAGS=--xla_force_host_platform_device_count=8; a mesh needing more devices than are visible
is refused before anything is loaded. A mesh the model cannot be split over (more stages than
layers, GPT-2 heads that do not divide) is recorded with the reason, and the sweep goes on.

Per mesh, one engine on the same host weights (`meshserve.serving.bench.mesh_measure` says how each
figure is taken):
  steps        median seconds of the engine's own prefill and decode calls, run again
               `--repeats` times, for the first `--concurrency` requests sent together
  serving      the workload through the gRPC server at `--concurrency` requests in flight
               (`bench.run_online`): output tokens/s, TTFT, TPOT and E2EL (mean, p99), stage
               utilisation. Every program the workload can reach is compiled first
               (`mesh_measure.warm_up`), so the run compiles nothing (`compiles_after_warmup`)
  memory       weight and KV bytes per device from the placed shards, and XLA's
               `memory_analysis()` of the decode program
  collectives  of the decode program's partitioned HLO, per kind: ops, count and bytes per step

The planner (`meshserve.sharding.planner`) predicts every swept mesh on two specs of this
machine, measured as the bench's roofline does (copy bandwidth, f32 matmul rate):
  whole_machine   each device has the whole machine's rates: the planner's own assumption of
                  devices that add up
  shared_machine  a mesh's devices split the machine's rates between them: what fake CPU
                  devices are (they share the cores)
and the predicted orderings by output tokens/s are set beside the measured one, with Spearman's
rank correlation.

Output: a table; with `--output`, the JSON (command, git commit, machine, jax version, devices,
engine config, one record per mesh, the comparison) and PNG charts next to it
(`meshserve.serving.bench.mesh_sweep_plots`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import re
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from meshserve.model.loading.pretrained import Pretrained, load_pretrained
from meshserve.serving import options
from meshserve.serving.bench import bench, mesh_measure, result_files, roofline, workloads
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.core import Engine
from meshserve.sharding import planner
from meshserve.sharding.hardware import HardwareSpec
from meshserve.sharding.mesh import MeshConfig

SPECS = ("whole_machine", "shared_machine")


HELP = "measure a model and workload on each of several meshes"


def add_arguments(sub: argparse.ArgumentParser) -> None:
    """The `mesh-sweep` flags, and the model and engine flags (`--model`, `--dtype`, the
    `EngineConfig` fields)."""
    sub.add_argument("--meshes", required=True,
                     help="DATAxSTAGExMODEL list, e.g. 1x1x4,1x2x2,2x1x2; or 'all': every "
                          "factorisation of --devices")
    sub.add_argument("--devices", type=int, default=None,
                     help="with --meshes all: the device count (default: every visible device)")
    sub.add_argument("--workload", default="chat-mix",
                     help="chat-mix, long, fixed-IxO (fixed-128x64) or jsonl:PATH")
    sub.add_argument("--prompts", type=Path, default=None,
                     help="a JSONL file of prompts (same as --workload jsonl:PATH)")
    sub.add_argument("--max-tokens", type=int, default=64,
                     help="output length of JSONL lines without max_tokens")
    sub.add_argument("--num-requests", type=int, default=16,
                     help="requests of a generated workload")
    sub.add_argument("--seed", type=int, default=0, help="workload seed")
    sub.add_argument("--concurrency", type=int, default=4,
                     help="requests in flight while serving; also the batch of the step timings")
    sub.add_argument("--repeats", type=int, default=5, help="runs of each timed step")
    sub.add_argument("--planner", action=argparse.BooleanOptionalAction, default=True,
                     help="measure this machine and compare the planner's ordering")
    sub.add_argument("--output", type=Path, default=None,
                     help="write the JSON (and charts) to this new file; {date} and {commit} in "
                          "the name are filled in; a file that exists is refused")
    sub.add_argument("--plots-dir", type=Path, default=None,
                     help="where the PNG charts go (default: next to --output)")
    result_files.add_allow_dirty_argument(sub)
    options.add_model_args(sub)


def run(args: argparse.Namespace) -> int:
    """Runs the sweep that `args` describes with its engine knobs (the mesh is replaced per
    mesh). Bad input raises ValueError with what to change, before any loading."""
    config = options.dataclass_from_args(EngineConfig, args)
    meshes = _check_args(args)
    source, output = result_files.prepare_output(args.output, allow_dirty=args.allow_dirty)
    if output or args.plots_dir:
        from meshserve.serving.bench import mesh_sweep_plots  # matplotlib: only when plotting

        directory = args.plots_dir or output.parent
        stem = output.stem if output else "mesh-sweep"
        result_files.refuse_existing(
            result_files.plot_paths(directory, stem, mesh_sweep_plots.NAMES),
            flag="--plots-dir" if args.plots_dir else "--output")
    pretrained = load_pretrained(args.model, dtype=args.dtype)
    config = dataclasses.replace(config.for_model(pretrained.config), mesh=None)
    requests = sweep_requests(args, pretrained, max_model_len=config.max_model_len)
    records = [measure_mesh(pretrained, mesh, config, requests, concurrency=args.concurrency,
                            repeats=args.repeats, seed=args.seed) for mesh in meshes]
    comparison = None
    machine = None
    if args.planner:
        machine = roofline.measure_machine()
        workload = planner_workload(requests, concurrency=args.concurrency,
                                    page_size=config.page_size)
        comparison = compare_with_planner(pretrained.config, records, machine, workload,
                                          fill_bubbles=config.bubble_filling)
    print(format_table(records, comparison))
    if output or args.plots_dir:
        plots = mesh_sweep_plots.write_plots(records, directory, stem)
    if output:
        command = "meshserve " + " ".join(args.argv)
        result_files.write_json(output, {
            "schema_version": 1, "command": command, "model": pretrained.config.name,
            "dtype": pretrained.config.dtype, "workload": args.workload,
            "num_requests": len(requests), "seed": args.seed, "concurrency": args.concurrency,
            "repeats": args.repeats, "engine_config": dataclasses.asdict(config),
            "environment": bench.environment(source),
            "machine": None if machine is None else dataclasses.asdict(machine),
            "meshes": records, "comparison": comparison,
            "plots": plots | {"directory": str(directory)}})
        print(f"wrote {output}")
    return 0


def _check_args(args: argparse.Namespace) -> list[MeshConfig]:
    if args.mesh is not None:
        raise ValueError("mesh-sweep takes --meshes (e.g. 1x1x2,1x2x1), not --mesh")
    for flag in ("concurrency", "repeats", "num_requests"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got "
                             f"{getattr(args, flag)}")
    if args.prompts is not None:
        if args.workload not in ("chat-mix", f"jsonl:{args.prompts}"):
            raise ValueError("give --prompts or --workload, not both")
        args.workload = f"jsonl:{args.prompts}"
    visible = jax.device_count()
    meshes = parse_meshes(args.meshes, args.devices or visible)
    check_devices(meshes, visible)
    return meshes


def parse_meshes(text: str, num_devices: int) -> list[MeshConfig]:
    """`"1x1x4,1x2x2"` -> meshes (data x stage x model); `"all"`: every factorisation of
    `num_devices`."""
    if text.strip() == "all":
        return [MeshConfig(s.data, s.stage, s.model) for s in planner.mesh_shapes(num_devices)]
    meshes = [parse_mesh(part.strip()) for part in text.split(",") if part.strip()]
    if not meshes:
        raise ValueError("--meshes is empty: give DATAxSTAGExMODEL meshes, e.g. 1x1x2,1x2x1")
    if len(set(meshes)) != len(meshes):
        raise ValueError(f"--meshes {text!r} names a mesh twice")
    return meshes


def parse_mesh(text: str) -> MeshConfig:
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)", text)
    if match is None:
        raise ValueError(f"bad mesh {text!r} in --meshes: expected DATAxSTAGExMODEL, e.g. 1x2x2")
    return MeshConfig(*(int(g) for g in match.groups()))


def check_devices(meshes: Sequence[MeshConfig], visible: int) -> None:
    needed = max(m.num_devices for m in meshes)
    if needed > visible:
        big = [mesh_label(m) for m in meshes if m.num_devices > visible]
        raise ValueError(f"mesh {', '.join(big)} needs {needed} devices, but only {visible} are "
                         f"visible; on a CPU, start with XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={needed}")


def mesh_label(mesh: MeshConfig) -> str:
    return f"{mesh.data}x{mesh.stage}x{mesh.model}"


def sweep_requests(args: argparse.Namespace, pretrained: Pretrained, *,
                   max_model_len: int) -> list[workloads.BenchRequest]:
    """The workload, as `meshserve bench` builds it; every request must fit `max_model_len`."""
    vocab = pretrained.config.vocab_size
    if args.workload.startswith("jsonl:"):
        requests = workloads.load_jsonl_workload(args.workload.removeprefix("jsonl:"),
                                             tokenizer=pretrained.tokenizer, vocab_size=vocab,
                                             default_max_tokens=args.max_tokens)
    else:
        requests = workloads.make_workload(args.workload, num_requests=args.num_requests,
                                       vocab_size=vocab, seed=args.seed)
    longest = max(len(r.prompt_token_ids) + r.num_output_tokens for r in requests)
    if longest > max_model_len:
        raise ValueError(f"workload {args.workload} has a request of {longest} tokens, over "
                         f"--max-model-len {max_model_len}: raise it, or use a shorter workload")
    return requests


# --- One mesh ----------------------------------------------------------------------------------


def measure_mesh(pretrained: Pretrained, mesh: MeshConfig, config: EngineConfig,
                 requests: list[workloads.BenchRequest], *, concurrency: int, repeats: int,
                 seed: int) -> dict[str, Any]:
    """Every measurement of one mesh, or the reason it cannot run the model."""
    record: dict[str, Any] = {"mesh": mesh_label(mesh), "shape": dataclasses.asdict(mesh)}
    try:
        engine = Engine.from_model(pretrained.model, pretrained.tokenizer,
                        dataclasses.replace(config, mesh=mesh))
    except ValueError as err:  # the model cannot be split over this mesh
        return record | {"error": str(err)}
    try:
        batch = min(concurrency, config.max_num_seqs * mesh.data)
        prompts = _step_prompts(requests, batch, config)
        mesh_measure.warm_up(engine)
        steps = mesh_measure.step_times(engine, prompts, repeats=repeats)
        program = mesh_measure.decode_program(engine, steps.pop("decode_call"))
        serving = bench.run_online(engine, requests, concurrency=concurrency, seed=seed)
        return record | {"steps": steps, "serving": _serving_summary(serving),
                         "memory": mesh_measure.device_bytes(engine) | {
                             "memory_analysis": program["memory_analysis"]},
                         "collectives": program["collectives"]}
    finally:
        engine.shutdown()
        del engine
        # XLA:CPU holds a memory map per loaded program and runs out after a few hundred:
        # let this mesh's programs go before the next mesh compiles its own.
        gc.collect()
        jax.clear_caches()


def _step_prompts(requests: list[workloads.BenchRequest], batch: int,
                  config: EngineConfig) -> list[list[int]]:
    """The first `batch` prompts, cut to leave room for the decode call's tokens."""
    room = config.max_model_len - mesh_measure.decode_tokens(config)
    if room < 1:
        raise ValueError(f"--max-model-len {config.max_model_len} leaves no room to time decode "
                         f"steps: raise it above {mesh_measure.decode_tokens(config)}")
    return [r.prompt_token_ids[:room] for r in (requests * batch)[:batch]]


def _serving_summary(result: dict[str, Any]) -> dict[str, Any]:
    keep = ("completed", "failed", "wall_s", "output_tokens", "output_tokens_per_s",
            "requests_per_s", "stage_utilisation", "compiles_after_warmup", "host_overhead",
            "preemptions", "prefill_padding", "decode_padding")
    return {k: result[k] for k in keep} | {
        metric: {stat: result[metric][stat] for stat in ("count", "mean", "median", "p99")}
        for metric in ("ttft_s", "tpot_s", "e2el_s")}


# --- Against the planner -----------------------------------------------------------------------


def planner_workload(requests: list[workloads.BenchRequest], *, concurrency: int,
                     page_size: int) -> planner.Workload:
    """The planner's one request shape: the workload's mean prompt and output lengths."""
    return planner.Workload(
        prompt_len=max(1, round(np.mean([len(r.prompt_token_ids) for r in requests]))),
        output_len=max(1, round(np.mean([r.num_output_tokens for r in requests]))),
        concurrency=concurrency, page_size=page_size)


def machine_spec(machine: roofline.Machine, *, share: int, per_node: int) -> HardwareSpec:
    """This machine as a planner spec, its rates and memory split `share` ways. Collectives
    between fake devices are memory copies, so the link runs at the copy bandwidth."""
    bandwidth, rate = machine.bandwidth / share, machine.matmul_rate / share
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return HardwareSpec(name=f"this-cpu/{share}", flops=rate, f32_flops=rate, hbm_bw=bandwidth,
                        hbm=memory / share, link_bw=bandwidth, per_node=per_node)


def compare_with_planner(config, records: list[dict[str, Any]], machine: roofline.Machine,
                         workload: planner.Workload, *, fill_bubbles: bool) -> dict[str, Any]:
    """Adds each record's predictions (`record["planner"]`); returns the orderings by output
    tokens/s, measured and predicted, with Spearman's rank correlation per spec."""
    per_node = max(r["shape"]["data"] * r["shape"]["stage"] * r["shape"]["model"]
                   for r in records)
    options = planner.PlanOptions(fill_bubbles=fill_bubbles)
    for record in records:
        shape = planner.MeshShape(**record["shape"])
        shares = {"whole_machine": 1, "shared_machine": shape.num_devices}
        record["planner"] = {
            name: _prediction(planner.plan_mesh(
                config, machine_spec(machine, share=share, per_node=per_node), shape, workload,
                planner.Slo(), options)) for name, share in shares.items()}
    ran = [r for r in records if "serving" in r and r["planner"]["whole_machine"]["throughput"]]
    measured = [r["serving"]["output_tokens_per_s"] for r in ran]
    out = {"workload": dataclasses.asdict(workload), "meshes": [r["mesh"] for r in ran],
           "measured_order": _order(ran, measured)}
    for name in SPECS:
        predicted = [r["planner"][name]["throughput"] for r in ran]
        out[name] = {"predicted_order": _order(ran, predicted),
                     "spearman": spearman(measured, predicted)}
    weights = [r["memory"]["weight_bytes"] for r in ran]
    out["weight_bytes_match"] = all(
        r["planner"]["whole_machine"]["weight_bytes"] == w for r, w in zip(ran, weights))
    return out


def _prediction(mesh_plan: planner.MeshPlan) -> dict[str, Any]:
    keep = ("reason", "weight_bytes", "kv_bytes_per_token", "decode_tick_s", "tp_comm_s",
            "pp_send_s", "utilisation", "ttft_s", "tpot_s", "throughput")
    return {k: getattr(mesh_plan, k) for k in keep}


def _order(records: list[dict[str, Any]], values: Sequence[float]) -> list[str]:
    """Mesh labels, highest value first."""
    return [records[i]["mesh"] for i in np.argsort(-np.asarray(values), kind="stable")]


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation (ties share their mean rank); None for fewer than two points
    or a constant side."""
    if len(a) < 2:
        return None
    ra, rb = _ranks(a), _ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def _ranks(values: Sequence[float]) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    ranks = np.empty(x.size)
    ranks[np.argsort(x, kind="stable")] = np.arange(x.size)
    for value in np.unique(x):
        ties = x == value
        ranks[ties] = ranks[ties].mean()
    return ranks


# --- The table ---------------------------------------------------------------------------------


COLUMNS = ("mesh", "decode ms", "prefill ms", "out tok/s", "TTFT ms", "p99", "TPOT ms", "p99",
           "E2EL ms", "weights MB", "KV MB", "AR/step", "AG/step", "CP/step", "comm KB/step",
           "stage util", "rank", "planner rank")
KINDS_SHOWN = {"AR/step": "all-reduce", "AG/step": "all-gather", "CP/step": "collective-permute"}


def format_table(records: list[dict[str, Any]], comparison: dict[str, Any] | None) -> str:
    """One row per mesh; "rank" is by measured output tokens/s, "planner rank" by the
    shared-machine prediction."""
    ranks = {}
    if comparison is not None:
        ranks = {m: (comparison["measured_order"].index(m) + 1,
                     comparison["shared_machine"]["predicted_order"].index(m) + 1)
                 for m in comparison["meshes"]}
    rows = [COLUMNS] + [_cells(r, ranks.get(r["mesh"])) for r in records]
    full = [row for row in rows if len(row) == len(COLUMNS)]
    widths = [max(len(row[i]) for row in full) for i in range(len(COLUMNS))]
    lines = []
    for row in rows:
        if len(row) == 2:  # a mesh that could not run: its reason
            lines.append(f"{row[0].ljust(widths[0])}  {row[1]}")
            continue
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths))))
    if comparison is not None:
        lines.append("")
        lines.append(f"measured order by output tok/s: {', '.join(comparison['measured_order'])}")
        for name in SPECS:
            c = comparison[name]
            rho = "-" if c["spearman"] is None else f"{c['spearman']:+.2f}"
            lines.append(f"planner ({name}): {', '.join(c['predicted_order'])}; Spearman {rho}")
    return "\n".join(lines)


def _cells(r: dict[str, Any], ranks: tuple[int, int] | None) -> tuple[str, ...]:
    if "error" in r:
        return (r["mesh"], f"cannot run: {r['error']}")
    steps, serving, memory, coll = r["steps"], r["serving"], r["memory"], r["collectives"]
    comm = sum(c["bytes_per_step"] for c in coll.values())
    return (r["mesh"], _ms(steps["decode_step_s"]), _ms(steps["prefill_step_s"]),
            f"{serving['output_tokens_per_s']:.1f}", _ms(serving["ttft_s"]["mean"]),
            _ms(serving["ttft_s"]["p99"]), _ms(serving["tpot_s"]["mean"]),
            _ms(serving["tpot_s"]["p99"]), _ms(serving["e2el_s"]["mean"]),
            f"{memory['weight_bytes'] / 1e6:.1f}", f"{memory['kv_bytes'] / 1e6:.1f}",
            *(f"{coll[kind]['per_step']:g}" for kind in KINDS_SHOWN.values()),
            f"{comm / 1e3:.1f}", f"{serving['stage_utilisation']:.2f}",
            *(("-", "-") if ranks is None else (str(ranks[0]), str(ranks[1]))))


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"
