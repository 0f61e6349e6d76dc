"""`meshserve roofline`: measure this machine's bandwidth and matmul rate, and decode steps
against the floor they set (`meshserve.serving.bench.roofline`)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from meshserve.model.quantized_weights import weight_bytes
from meshserve.serving import options
from meshserve.serving.bench import bench, result_files, roofline

HELP = "decode step time against the machine's floor"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, action="append",
                        help="decode batch size; repeat for several (default: 1)")
    parser.add_argument("--context", type=int, default=128, help="tokens already in context")
    parser.add_argument("--output", type=Path, default=None,
                        help="also write the measurements as JSON (with the machine and command) "
                             "to this new file; {date} and {commit} in the name are filled in; a "
                             "file that exists is refused")
    result_files.add_allow_dirty_argument(parser)
    options.add_model_args(parser)


def run(args: argparse.Namespace) -> None:
    source, output = result_files.prepare_output(args.output, allow_dirty=args.allow_dirty)
    llm = options.load_llm(args, needs_tokenizer=False, warmup=False)
    config, batches = llm.model_config, args.batch or [1]
    runner = bench.decode_runner(llm.engine.model, max_batch=max(batches), context=args.context,
                                 page_size=llm.engine.config.page_size,
                                 layout=llm.engine.runner.layout)
    machine = roofline.measure_machine()
    stored = weight_bytes(llm.engine.model)
    print(f"bandwidth {machine.bandwidth / 1e9:.1f} GB/s (copy; in-place update "
          f"{machine.update_bandwidth / 1e9:.1f}), matmul {machine.matmul_rate / 1e9:.1f} "
          f"GFLOP/s, weights {stored / 1e6:.0f} MB ({llm.engine.config.quantization})")
    print(f"{'batch':>5} {'step ms':>9} {'floor ms':>9} {'floor/step':>10}")
    rows = []
    for batch in batches:
        step = roofline.measure_decode_step(runner, batch=batch, context=args.context)
        floor = roofline.decode_floor(config, machine, batch=batch, context=args.context,
                                      weights_bytes=stored)
        print(f"{batch:>5} {step * 1e3:>9.2f} {floor * 1e3:>9.2f} {floor / step:>10.2f}")
        rows.append({"batch": batch, "step_s": step, "floor_s": floor,
                     "floor_over_step": floor / step})
    if output:
        result_files.write_json(output, {
            "command": "meshserve " + " ".join(args.argv), "model": config.name,
            "dtype": config.dtype, "quantization": llm.engine.config.quantization,
            "weight_bytes": stored, "context": args.context,
            "machine": dataclasses.asdict(machine), "environment": bench.environment(source),
            "decode": rows})
        print(f"wrote {output}")
