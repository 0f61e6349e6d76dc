"""`meshserve bench`: continuous vs static batching on a seeded workload or a JSONL file,
offline or online, with the roofline, sweeps, the highest rate meeting SLOs, peers and plots
(`meshserve.serving.bench.bench` runs them; this module is the command line and the tables)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

from meshserve.batching.knobs import ORDERINGS
from meshserve.model.loading.hub import resolve_model
from meshserve.model.quantized_weights import weight_bytes
from meshserve.serving import options
from meshserve.serving.bench import (bench, latency, lora_adapters, memory, repeats,
                                     result_files, structured_cost, workloads)
from meshserve.serving.python_api.llm import LLM

HELP = "continuous vs static batching, side by side"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="chat-mix",
                        help="chat-mix, long, shared-prefix, grounded (answers that copy their "
                             "input: where --speculative-config pays), fixed-IxO (fixed-128x64) "
                             "or jsonl:PATH")
    parser.add_argument("--prompts", type=Path, default=None,
                        help="a JSONL file of prompts (same as --workload jsonl:PATH)")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="output length of JSONL lines without max_tokens")
    parser.add_argument("--stop-at-eos", action="store_true",
                        help="let the model's EOS end each output (the workload's length is then "
                             "a cap), instead of forcing every output to its length")
    parser.add_argument("--num-requests", type=int, default=None,
                        help="requests of a generated workload (default: 64; --quick: 16)")
    parser.add_argument("--seed", type=int, default=0, help="workload and arrivals seed")
    parser.add_argument("--output", type=Path,
                        help="write the results JSON (and plots) to this new file; {date} and "
                             "{commit} in the name are filled in; a file that exists is refused")
    parser.add_argument("--plots-dir", type=Path, default=None,
                        help="where the PNG plots go (default: next to --output)")
    parser.add_argument("--mode", default="offline", choices=("offline", "online"),
                        help="offline: all at t=0 into the engine; online: through the gRPC server")
    parser.add_argument("--rate", type=float, default=None,
                        help="online: requests/s (default: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="online: gamma shape of the gaps; 1 is Poisson, < 1 burstier")
    parser.add_argument("--concurrency", type=int, default=None, help="online: max in flight")
    parser.add_argument("--frontend", default=None, choices=("grpc", "http"),
                        help="online: drive the gRPC server or the OpenAI-compatible HTTP API "
                             "(default: grpc; http when comparing with llama-server)")
    parser.add_argument("--rates", type=_float_list, default=None,
                        help="online: sweep these request rates, e.g. 1,2,4")
    parser.add_argument("--concurrencies", type=_int_list, default=None,
                        help="online: sweep these concurrency caps, e.g. 1,4,16")
    parser.add_argument("--slo-scale", type=float, default=None,
                        help="online: goodput against MLPerf Llama-2-70B Server SLOs (TTFT 2 s, "
                             "TPOT 200 ms) times this factor")
    parser.add_argument("--find-max-rate", action="store_true",
                        help="online: search the highest Poisson rate meeting the p99 SLOs "
                             "(needs --slo-scale)")
    parser.add_argument("--max-rate-probes", type=int, default=6,
                        help="online runs per policy for --find-max-rate")
    parser.add_argument("--roofline", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the machine and decode steps against the floor first")
    parser.add_argument("--startup", action="store_true",
                        help="time `meshserve generate --prompt hi --max-tokens 4` (default engine) "
                             "in fresh processes, with an empty and a filled compilation cache")
    parser.add_argument("--roofline-batch", type=int, action="append", default=None,
                        help="decode batch for the roofline; repeat (default: 1, 8, 32, 64; "
                             "--quick: 1, 8)")
    parser.add_argument("--compare", action="append", default=None,
                        choices=("static", "hf", "llama-cpp", "llama-server"),
                        help="static (always run) and peers: hf, llama-cpp, llama-server (built "
                             "from source on first use, about 9 minutes on 2 cores); repeat for "
                             "several")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run continuous, static and every peer this many times, "
                             "interleaved; report medians, min and max and the ratio of medians "
                             "with its range, and mark runs whose load average says another "
                             "process shared the cores")
    parser.add_argument("--lora-adapters", type=int, default=0, metavar="N",
                        help="serve N random LoRA adapters of the model (every projection, "
                             "--lora-rank), request i with adapter i mod N, on an engine with "
                             "enable_lora and max_loras N; beside it the base model alone "
                             "(offline mode)")
    parser.add_argument("--lora-rank", type=int, default=lora_adapters.DEFAULT_RANK,
                        help="the rank of --lora-adapters' adapters (and max_lora_rank)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="a progress bar (only on a terminal)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 16 short chat-mix requests, roofline at 1 and 8")
    parser.add_argument("--structured", nargs="?", const="json-lines", default=None,
                        choices=structured_cost.CONSTRAINTS, metavar="SET",
                        help="instead of the policies: the continuous engine unconstrained, then "
                             "with every request constrained to JSON lines (structured output): "
                             "json-lines (the default) holds every line to one small schema, "
                             "json-schemas request i to shipped schema i mod 54; their "
                             "throughput ratio, TTFT p50 of both and the matchers' and masks' "
                             "host time per step")
    parser.add_argument("--schema-validity", nargs="?", const="", default=None, metavar="PATH",
                        help="instead of the policies: JSON for each schema of a set (default: "
                             "the 54 shipped) at temperature 0 and 0.8, each output validated "
                             "with jsonschema")
    result_files.add_allow_dirty_argument(parser)
    options.add_model_args(parser)


def _float_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


QUICK_MAX_PROMPT, QUICK_MAX_OUTPUT, QUICK_MAX_MODEL_LEN = 128, 32, 256


def run(args: argparse.Namespace) -> None:
    _check_bench_args(args)
    source, output = result_files.prepare_output(args.output, allow_dirty=args.allow_dirty)
    structured = args.structured is not None or args.schema_validity is not None
    plots_to = None if structured else _plots_to(args, output)
    if plots_to is not None:
        from meshserve.serving.bench import plots  # matplotlib: only when plotting

        result_files.refuse_existing(result_files.plot_paths(*plots_to, plots.NAMES),
                                     flag="--plots-dir" if args.plots_dir else "--output")
    if args.policy in ORDERINGS:  # both batching policies always run: --policy picks the ordering
        args.ordering, args.policy = args.policy, "continuous"
    if args.quick and args.max_model_len is None:
        args.max_model_len = QUICK_MAX_MODEL_LEN
    if structured:
        return _run_structured(args, source, output)
    llm = options.load_llm(args, needs_tokenizer=False, warmup=False)
    requests = _bench_requests(args, llm)
    if args.stop_at_eos:
        requests = [dataclasses.replace(r, stop_at_eos=True) for r in requests]
    adapters_dir = None
    if args.lora_adapters:  # kept until the process ends: engines read them as requests come
        adapters_dir = tempfile.TemporaryDirectory(prefix="meshserve-bench-lora-")
        requests = lora_adapters.spread(requests, lora_adapters.random_adapters(
            adapters_dir.name, llm.model_config, args.lora_adapters, rank=args.lora_rank,
            seed=args.seed))
    progress = args.progress and sys.stderr.isatty()
    payload: dict[str, Any] = {"weight_bytes": weight_bytes(llm.engine.model)}
    print(f"weights: {payload['weight_bytes'] / 1e6:.0f} MB "
          f"(quantization {llm.engine.config.quantization})")
    if args.startup:  # before this process compiles anything, so the runs have the cores
        payload["startup"] = startup = bench.measure_startup(
            str(resolve_model(args.model).path), dtype=args.dtype,
            quantization=llm.engine.config.quantization)
        for name in ("empty_cache", "warm_cache"):
            run = startup[name]
            print(f"startup, {name.replace('_', ' ')}: answer after {run['wall_s']:.1f} s "
                  f"(load {run['load_s']} s, {run['programs']:.0f} programs in "
                  f"{run['compile_s']} s, first token {run['first_token_s']} s, peak RSS "
                  f"{run['peak_rss_bytes'] / 2**20:.0f} MiB)")
    if args.roofline:
        batches = args.roofline_batch or ((1, 8) if args.quick else bench.ROOFLINE_BATCHES)
        payload["roofline"] = bench.run_roofline(llm.engine.model, llm.engine.config,
                                                 batches=batches,
                                                 layout=llm.engine.runner.layout)
    slos = None if args.slo_scale is None else latency.mlperf_server_slos(args.slo_scale)
    online = {}
    if args.mode == "online":
        online = dict(rate=args.rate, burstiness=args.burstiness, concurrency=args.concurrency,
                      slos=slos, seed=args.seed, frontend=args.frontend)
    engines = bench.make_engines(llm.engine.model, llm.engine.config)
    axis, values = (("rate", args.rates) if args.rates else
                    ("concurrency", args.concurrencies) if args.concurrencies else (None, None))
    peers = [name for name in dict.fromkeys(args.compare or []) if name != "static"]
    if args.repeats > 1:
        results, payload["peak_rss_bytes"] = _repeated(args, llm, requests, engines, peers,
                                                       online, progress)
        peers = []  # run in every repeat already
    elif axis is None:
        results = bench.compare_policies(llm.engine.model, llm.engine.config, requests,
                                         mode=args.mode, engines=engines, progress=progress,
                                         **online)
    else:
        swept = bench.sweep(engines, requests, axis=axis, values=values, progress=progress,
                            **online)
        results = {p: swept[p][-1] for p in bench.POLICY_NAMES} | {"sweep": swept}
        results["ratio_output_tokens_per_s"] = (results["continuous"]["output_tokens_per_s"]
                                                / results["static"]["output_tokens_per_s"])
    if args.find_max_rate:
        results["max_rate"] = {p: bench.find_max_rate(
            engines[p], requests, slos=slos, start=args.rate or 1.0,
            max_probes=args.max_rate_probes, seed=args.seed, burstiness=args.burstiness,
            progress=progress) for p in bench.POLICY_NAMES}
    # meshserve's alone: before a peer runs in this process (the HF peer does)
    payload.setdefault("peak_rss_bytes", memory.own_peak_rss_bytes())
    if peers:
        results["peers"] = bench.run_peers(
            peers, args.model, requests, max_batch_size=llm.engine.config.max_num_seqs,
            continuous=results["continuous"], engine_config=llm.engine.config,
            arrivals={k: v for k, v in online.items() if k != "frontend"})
    _print_bench(results, payload.get("roofline"), online=args.mode == "online")
    if "repeats" in results:
        print("\n".join(repeats.summary_lines(results["repeats"]["summary"])))
    print("peak RSS: " + ", ".join(
        [f"meshserve {payload['peak_rss_bytes'] / 2**20:.0f} MiB"]
        + [f"{name} {peer['peak_rss_bytes'] / 2**20:.0f} MiB"
           for name, peer in results.get("peers", {}).items() if peer.get("peak_rss_bytes")]))
    if plots_to is not None:
        directory, stem = plots_to
        payload["plots"] = plots.write_plots(results, directory, stem) | {
            "directory": str(directory)}
    if output:
        command = "meshserve " + " ".join(args.argv)
        result_files.write_json(output, {
            "schema_version": 1, "command": command, "model": llm.model_config.name,
            "workload": args.workload, "num_requests": len(requests), "seed": args.seed,
            "mode": args.mode, "quick": args.quick,
            "arrivals": {k: v for k, v in online.items() if k != "slos"} or None,
            "engine_config": dataclasses.asdict(llm.engine.config),
            "environment": bench.environment(source), "results": results} | payload)
        print(f"wrote {output}")


def _repeated(args: argparse.Namespace, llm: LLM, requests: list, engines: dict,
              peers: list[str], online: dict[str, Any], progress: bool
              ) -> tuple[dict[str, Any], int]:
    """`--repeats N`: continuous, static (and `bench.NO_SPECULATION` when the engine
    speculates) and each peer, in that order, N times over
    (`meshserve.serving.bench.repeats`). The results show each system's median run, the ratios
    are ratios of medians, and `repeats` holds the summary and every run. Also returns this
    process's peak resident memory after the first repeat's policies, before any peer ran in
    it (the HF peer does)."""
    runs, peak = [], None
    for i in range(args.repeats):
        print(f"repeat {i + 1} of {args.repeats}", flush=True)
        run: dict[str, Any] = {}
        for name, engine in engines.items():
            run[name] = repeats.measured(
                lambda: bench.run_offline(engine, requests, progress=progress)
                if args.mode == "offline" else
                bench.run_online(engine, requests, progress=progress, **online))
        peak = peak or memory.own_peak_rss_bytes()
        for name in peers:
            run[name] = repeats.measured(lambda: bench.run_peers(
                [name], args.model, requests, max_batch_size=llm.engine.config.max_num_seqs,
                engine_config=llm.engine.config,
                arrivals={k: v for k, v in online.items() if k != "frontend"})[name])
        runs.append(run)
    summary = repeats.summarize(runs)
    results: dict[str, Any] = {name: repeats.median_run(runs, name) for name in engines}
    results["ratio_output_tokens_per_s"] = (
        summary["ratios"]["continuous/static"]["ratio_of_medians"])
    for name, ratio in ((bench.NO_SPECULATION, "ratio_speculation_output_tokens_per_s"),
                        (bench.BASE_MODEL, "ratio_lora_output_tokens_per_s")):
        if name in engines:
            results[ratio] = summary["ratios"][f"continuous/{name}"]["ratio_of_medians"]
    if peers:
        results["peers"] = {}
        for name in peers:
            if name not in summary["systems"]:
                results["peers"][name] = {"skipped": summary["skipped"][name]}
                continue
            peer = dict(repeats.median_run(runs, name))
            peer["ratio_continuous_output_tokens_per_s"] = (
                summary["ratios"][f"continuous/{name}"]["ratio_of_medians"])
            ours, theirs = (bench.ttft_median(results["continuous"]),
                            bench.ttft_median(peer))
            if ours and theirs:
                peer["ratio_continuous_ttft_median"] = ours / theirs
            results["peers"][name] = peer
    results["repeats"] = {"summary": summary, "runs": runs}
    return results, peak


def _plots_to(args: argparse.Namespace, output: Path | None) -> tuple[Path, str] | None:
    """The folder and file-name stem of the plots: beside the JSON and named after it, or in
    `--plots-dir` (named `bench-*` without `--output`); None: no plots."""
    if output is None and args.plots_dir is None:
        return None
    return (args.plots_dir or output.parent, output.stem if output else "bench")


def _run_structured(args: argparse.Namespace, source: result_files.Provenance | None,
                    output: Path | None) -> None:
    """`--structured` or `--schema-validity`: structured output's cost, or its validity."""
    if args.mode != "offline":
        raise ValueError("--structured and --schema-validity run offline only")
    llm = options.load_llm(args, needs_tokenizer=True, warmup=True)
    if args.schema_validity is not None:
        results = structured_cost.schema_validity(
            llm.engine, structured_cost.load_schemas(args.schema_validity or None))
        for temperature, row in results["temperatures"].items():
            print(f"temperature {temperature}: {row['valid']}/{row['requests']} outputs parse "
                  f"and validate ({row['output_tokens']} tokens)")
            for failure in row["failures"]:
                print(f"  {failure['name']}: {failure['error']} ({failure['finish_reason']})")
    else:
        results = structured_cost.compare_structured(
            llm.engine, _bench_requests(args, llm),
            structured=structured_cost.constraints(args.structured),
            progress=args.progress and sys.stderr.isatty())
        results["constraint_set"] = args.structured
        _print_structured(results)
    if output:
        result_files.write_json(output, {
            "schema_version": 1, "command": "meshserve " + " ".join(args.argv),
            "model": llm.model_config.name, "workload": args.workload, "seed": args.seed,
            "engine_config": dataclasses.asdict(llm.engine.config),
            "environment": bench.environment(source),
            "structured" if args.structured else "schema_validity": results})
        print(f"wrote {output}")


def _print_structured(results: dict) -> None:
    for name in ("unconstrained", "constrained"):
        run = results[name]
        print(f"{name:<14} {run['output_tokens_per_s']:8.1f} output tok/s "
              f"({run['output_tokens']} tokens, {run['num_steps']} steps), TTFT p50 "
              f"{_ms(results['ttft_p50_s'][name])} ms")
    ttft = results["ratio_ttft_p50"]
    print(f"constrained / unconstrained: {results['ratio_output_tokens_per_s']:.3f} output "
          f"tok/s, {'-' if ttft is None else f'{ttft:.3f}'} TTFT p50; matchers and masks: "
          f"{results['mask_ms_per_constrained_step']:.2f} ms per step with constrained rows "
          f"({results['matcher_ms_per_step']:.2f} ms per step), "
          f"{results['matcher_us_per_token']:.0f} us per constrained token")
    overlap = results["overlap"]
    if overlap["steps"]:
        print(f"masks beside the forward pass: {overlap['steps']} steps, "
              f"{overlap['mask_ms_per_step']:.2f} ms each, {overlap['hidden_ms_per_step']:.2f} "
              f"ms of it while the device ran the forward pass, "
              f"{overlap['exposed_ms_per_step']:.2f} ms with the device idle; the forward pass "
              f"ran {overlap['forward_left_ms_per_step']:.2f} ms past the masks")


def _check_bench_args(args: argparse.Namespace) -> None:
    online_only = [flag for flag, given in (("--rates", args.rates),
                                            ("--concurrencies", args.concurrencies),
                                            ("--find-max-rate", args.find_max_rate),
                                            ("--frontend http", args.frontend == "http"))
                   if given]
    if online_only and args.mode != "online":
        raise ValueError(f"{', '.join(online_only)} need --mode online")
    if args.frontend is None:  # llama-server is HTTP and JSON, so meshserve goes the same way
        args.frontend = "http" if "llama-server" in (args.compare or []) else "grpc"
    if args.rates and args.concurrencies:
        raise ValueError("give --rates or --concurrencies, not both")
    if args.find_max_rate and args.slo_scale is None:
        raise ValueError("--find-max-rate needs --slo-scale (the SLOs it must meet)")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    repeated_not = [flag for flag, given in (("--rates", args.rates),
                                             ("--concurrencies", args.concurrencies),
                                             ("--find-max-rate", args.find_max_rate),
                                             ("--structured", args.structured is not None),
                                             ("--schema-validity",
                                              args.schema_validity is not None)) if given]
    if args.repeats > 1 and repeated_not:
        raise ValueError(f"--repeats runs the policies and peers; it does not repeat "
                         f"{', '.join(repeated_not)}")
    if args.max_rate_probes < 1:
        raise ValueError(f"--max-rate-probes must be >= 1, got {args.max_rate_probes}")
    if args.lora_adapters < 0 or args.lora_rank < 1:
        raise ValueError(f"--lora-adapters must be >= 0 and --lora-rank >= 1, got "
                         f"{args.lora_adapters} and {args.lora_rank}")
    if args.lora_adapters:
        if args.mode != "online" and not (args.compare or []):
            args.enable_lora, args.max_loras = True, args.lora_adapters
            args.max_lora_rank, args.max_cpu_loras = args.lora_rank, None
        else:
            raise ValueError("--lora-adapters runs offline, without peers (the peers serve no "
                             "adapters): drop --mode online and --compare")
    if args.prompts is not None:
        if args.workload not in ("chat-mix", f"jsonl:{args.prompts}"):
            raise ValueError("give --prompts or --workload, not both")
        args.workload = f"jsonl:{args.prompts}"


def _bench_requests(args: argparse.Namespace, llm: LLM) -> list:
    if args.workload.startswith("jsonl:"):
        if args.num_requests is not None:
            raise ValueError("--num-requests applies to generated workloads; a JSONL file runs "
                             "every line")
        return workloads.load_jsonl_workload(args.workload.removeprefix("jsonl:"),
                                         tokenizer=llm.tokenizer,
                                         vocab_size=llm.model_config.vocab_size,
                                         default_max_tokens=args.max_tokens)
    num_requests = args.num_requests or (16 if args.quick else 64)
    if args.workload == "grounded":  # each answer capped within max_model_len
        max_len = llm.engine.config.max_model_len
        return [dataclasses.replace(r, num_output_tokens=min(
                    r.num_output_tokens, max_len - len(r.prompt_token_ids)))
                for r in workloads.grounded_workload(llm.tokenizer, num_requests=num_requests,
                                                     seed=args.seed)]
    requests = workloads.make_workload(args.workload, num_requests=num_requests,
                                   vocab_size=llm.model_config.vocab_size, seed=args.seed)
    if args.quick:  # short, and within max_model_len
        max_len = llm.engine.config.max_model_len
        output = min(QUICK_MAX_OUTPUT, max_len // 4)
        prompt = min(QUICK_MAX_PROMPT, max_len - output)
        requests = [dataclasses.replace(r, prompt_token_ids=r.prompt_token_ids[:prompt],
                                        num_output_tokens=min(r.num_output_tokens, output))
                    for r in requests]
    return requests


def _print_bench(results: dict, roof: dict | None, *, online: bool) -> None:
    print(f"{'policy':<14} {'out tok/s':>10} {'req/s':>7} {'prefill pad':>11} {'decode pad':>10} "
          f"{'host':>6} {'kv peak':>7} {'frag mean':>9} {'frag peak':>9} {'preempt':>7} "
          f"{'recompiles':>10} {'stage util':>10}")
    for policy in ("continuous", "static", bench.NO_SPECULATION, bench.BASE_MODEL):
        if policy not in results:
            continue
        r = results[policy]
        kv = r["kv"]
        print(f"{policy:<14} {r['output_tokens_per_s']:>10.1f} {r['requests_per_s']:>7.2f} "
              f"{r['prefill_padding']:>11.1%} {r['decode_padding']:>10.1%} "
              f"{r['host_overhead']:>6.1%} {kv['peak_used_pages']:>7} "
              f"{kv['mean_fragmentation']:>9.1%} {kv['peak_fragmentation']:>9.1%} "
              f"{r['preemptions']:>7} {r['compiles_after_warmup']:>10} "
              f"{r['stage_utilisation']:>10.1%}")
    spec = results["continuous"].get("speculative")
    if spec is not None and spec["num_draft_tokens"]:
        rates = ", ".join(f"{rate:.2f}" for rate in spec["acceptance_rate_per_position"]
                          if rate is not None)
        print(f"speculative: {spec['num_draft_tokens']} drafted, {spec['num_accepted_tokens']} "
              f"accepted ({spec['acceptance_rate']:.1%}; per position {rates}), mean "
              f"acceptance length {spec['mean_acceptance_length']:.2f}, "
              f"{spec['num_steps_off']} steps off for load")
    if roof is not None:
        print(f"roofline: bandwidth {roof['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, matmul "
              f"{roof['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, context {roof['context']}")
        print(f"{'batch':>5} {'step ms':>9} {'floor ms':>9} {'floor/step':>10}")
        for row in roof["rows"]:
            print(f"{row['batch']:>5} {row['step_s'] * 1e3:>9.2f} {row['floor_s'] * 1e3:>9.2f} "
                  f"{row['ratio']:>10.2f}")
        if roof["skipped_batches"]:
            print(f"roofline batches skipped (KV too large): {roof['skipped_batches']}")
    if online:
        _print_latencies(results)
    if "sweep" in results:
        sweep = results["sweep"]
        print(f"{sweep['axis']:>11} {'cont tok/s':>10} {'static tok/s':>12}")
        for i, value in enumerate(sweep["values"]):
            print(f"{value:>11g} {sweep['continuous'][i]['output_tokens_per_s']:>10.1f} "
                  f"{sweep['static'][i]['output_tokens_per_s']:>12.1f}")
    for policy, found in results.get("max_rate", {}).items():
        for p in found["probes"]:
            print(f"{policy:<11} rate {p['rate']:>7.3f} req/s  p99 ttft "
                  f"{_ms(p['p99_ttft_s'])} ms  p99 tpot {_ms(p['p99_tpot_s'])} ms  "
                  f"{'pass' if p['passed'] else 'fail'}")
        rate = found["max_rate"]
        print(f"{policy:<11} max rate under {found['slos']['name']}: "
              f"{'none found' if rate is None else f'{rate:.3f} req/s'}")
    for name, peer in results.get("peers", {}).items():
        if "skipped" in peer:
            print(f"{name}: skipped ({peer['skipped']})")
        else:
            print(f"{name}: {peer['output_tokens_per_s']:.1f} out tok/s; continuous / {name} "
                  f"{peer.get('ratio_continuous_output_tokens_per_s', float('nan')):.2f}x"
                  + (f"; TTFT p50 {_ms(peer['ttft_s']['median'])} ms, continuous / {name} "
                     f"{peer['ratio_continuous_ttft_median']:.2f}x"
                     if "ratio_continuous_ttft_median" in peer else ""))
    print(f"continuous / static output tokens/s: {results['ratio_output_tokens_per_s']:.2f}x")
    for name, ratio in ((bench.NO_SPECULATION, "ratio_speculation_output_tokens_per_s"),
                        (bench.BASE_MODEL, "ratio_lora_output_tokens_per_s")):
        if ratio in results:
            print(f"continuous / {name} output tokens/s: {results[ratio]:.2f}x")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _print_latencies(results: dict) -> None:
    """Client-side latencies of both policies and of each peer measured the same way."""
    print(f"{'policy':<12} {'metric':<6} {'mean ms':>9} {'p50 ms':>9} {'p90 ms':>9} "
          f"{'p99 ms':>9}")
    rows = {p: results[p] for p in ("continuous", "static")} | {
        name: r for name, r in results.get("peers", {}).items() if "itl_s" in r}
    for policy, r in rows.items():
        for metric in ("ttft", "tpot", "itl", "e2el"):
            d = r[f"{metric}_s"]
            cells = " ".join(f"{'-' if d[k] is None else f'{d[k] * 1e3:.1f}':>9}"
                             for k in ("mean", "median", "p90", "p99"))
            print(f"{policy:<12} {metric:<6} {cells}")
        goodput = r["goodput"]
        if goodput["slos"] is not None:
            print(f"{policy:<12} goodput {goodput['requests_per_s']:.2f} req/s under "
                  f"{goodput['slos']['name']}")
