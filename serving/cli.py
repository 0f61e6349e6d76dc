"""The `meshserve` command line.

Subcommands:
  generate   answer prompts given on the command line (`--prompt`, repeatable), streamed
  batch      run a JSONL file of requests; results are appended as each finishes, and a rerun
             skips the ids already in the output
  demo       `batch` on the shipped example prompts
  roofline   measure this machine's bandwidth and matmul rate, and decode steps against the floor
  bench      continuous vs static batching on a seeded workload or a JSONL file, offline or
             online, with the roofline, sweeps, the highest rate meeting SLOs, peers and plots
  serve      the gRPC server: streaming Generate, Abort, GetServerInfo, health, reflection,
             admission control, drain on SIGTERM, Prometheus metrics (`--metrics-port`); on
             many hosts with --coordinator/--num-processes/--process-id (`serving.multihost`)
  convert    write a model (any `--model` form) as a meshserve checkpoint directory: orbax
             weights, config, tokenizer and manifest; `--model DIR` then loads it
  client     prompts to a running `serve` (`--target`), answers streamed; `--info`: GetServerInfo
  plan       predict every (data, stage, model) mesh of a model on given hardware from a cost
             model, and rank them against SLOs (`meshserve.serving.bench.plan_command`)
  mesh-sweep measure a model and workload on each of several meshes of the devices at hand:
             step times, serving, memory, collectives, against the planner
             (`meshserve.serving.bench.mesh_sweep`)

Engine options are generated from `EngineConfig`'s fields, so a knob is declared once and the CLI
follows it.

Batch input lines are JSON objects with one of `prompt` (text), `prompt_token_ids` or `messages`
(chat), an optional `id` (default: the line number), and any `SamplingParams` field.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # before the heavy imports: startup timings count from here

import argparse
import dataclasses
import json
import signal
import sys
import tempfile
import threading
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Iterator, Sequence

from tqdm.auto import tqdm

from meshserve.batching import wire
from meshserve.batching.sampling import SamplingParams
from meshserve.batching.config import ORDERINGS
from meshserve.model.checkpoint import check_destination, save_checkpoint
from meshserve.model.config import weight_bytes
from meshserve.model.hub import DEFAULT_MODEL, resolve_model
from meshserve.model.pretrained import load_pretrained
from meshserve.serving import multihost
from meshserve.serving.bench import latency, roofline
from meshserve.serving.client import Client, ClientError, StreamChunk
from meshserve.serving.engine import EngineConfig
from meshserve.serving.llm import LLM
from meshserve.serving.bench.mesh_sweep import add_mesh_sweep_parser, run_mesh_sweep
from meshserve.serving.bench.plan_command import add_plan_parser, run_plan
from meshserve.serving.server import GenerationServer, ServerConfig

SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
FLAG_ALIASES = {"enable_prefix_caching": ("--prefix-caching",)}  # so --no-prefix-caching works


def add_dataclass_args(parser: argparse.ArgumentParser, cls) -> None:
    """One `--field-name` option per field of a frozen config dataclass, typed by its annotation."""
    group = parser.add_argument_group(cls.__name__)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        flag = "--" + field.name.replace("_", "-")
        kind = _scalar_type(hints[field.name])
        if kind is bool:
            group.add_argument(flag, *FLAG_ALIASES.get(field.name, ()),
                               action=argparse.BooleanOptionalAction, default=field.default,
                               dest=field.name)
        else:
            group.add_argument(flag, type=kind, default=field.default, dest=field.name,
                               help=f"(default: {field.default})")


def _scalar_type(hint) -> type:
    """`int` for `int` and `int | None`."""
    options = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    return options[0]


def dataclass_from_args(cls, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="known model name, .gguf file, HF directory, or preset")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    add_dataclass_args(parser, EngineConfig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshserve", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="answer the given prompts, streamed")
    generate.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--raw", action="store_true",
                          help="feed prompts as plain text, without the chat template")
    batch = commands.add_parser("batch", help="run a JSONL file of requests")
    batch.add_argument("--input", required=True, type=Path)
    batch.add_argument("--output", required=True, type=Path)
    batch.add_argument("--show", action="store_true", help="print each answer as it finishes")
    demo = commands.add_parser("demo", help="answer the shipped example prompts")
    roof = commands.add_parser("roofline", help="decode step time against the machine's floor")
    roof.add_argument("--batch", type=int, action="append",
                      help="decode batch size; repeat for several (default: 1)")
    roof.add_argument("--context", type=int, default=128, help="tokens already in context")
    roof.add_argument("--output", type=Path, default=None,
                      help="also write the measurements as JSON (with the machine and command)")
    _bench_args(commands.add_parser("bench", help="continuous vs static batching, side by side"))
    serve = commands.add_parser("serve", help="the gRPC server (meshserve.v1.Generation)")
    add_dataclass_args(serve, ServerConfig)
    _cluster_args(serve)
    _cluster_args(batch)
    for sub in (generate, batch, demo, roof, serve):
        _model_args(sub)
    convert = commands.add_parser("convert", help="write a model as a meshserve checkpoint")
    convert.add_argument("--model", default=DEFAULT_MODEL,
                         help="known model name, .gguf file, HF directory, checkpoint, or preset")
    convert.add_argument("--out", required=True, type=Path, help="the checkpoint directory")
    convert.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    convert.add_argument("--force", action="store_true", help="replace --out if it is not empty")
    _client_args(commands.add_parser("client", help="prompts to a running `meshserve serve`"))
    add_plan_parser(commands)
    _model_args(add_mesh_sweep_parser(commands))
    return parser


def _cluster_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "many hosts (jax.distributed)",
        "one process per host, one mesh over all their devices; process 0 serves, the others "
        "follow its plan stream. Give all of --coordinator, --num-processes and --process-id, "
        "or --distributed to read them from the cluster (SLURM, Open MPI, Kubernetes).")
    group.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help="where process 0 runs JAX's coordination service")
    group.add_argument("--num-processes", type=int, default=None)
    group.add_argument("--process-id", type=int, default=None)
    group.add_argument("--distributed", action="store_true",
                       help="join a multi-process job, auto-detecting what is not given")
    group.add_argument("--peer-timeout", type=float, default=multihost.DEFAULT_PEER_TIMEOUT,
                       help="seconds a silent process is waited for before the job fails")


def _cluster_config(args: argparse.Namespace) -> multihost.ClusterConfig | None:
    """The job to join, or None to run alone."""
    given = [args.coordinator, args.num_processes, args.process_id]
    if all(v is None for v in given) and not args.distributed:
        return None
    if any(v is None for v in given) and not args.distributed:
        raise ValueError("give all of --coordinator, --num-processes and --process-id, or add "
                         "--distributed to read the missing ones from the cluster environment")
    return multihost.ClusterConfig(coordinator=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id, peer_timeout=args.peer_timeout)


def _bench_args(bench: argparse.ArgumentParser) -> None:
    bench.add_argument("--workload", default="chat-mix",
                       help="chat-mix, long, shared-prefix, fixed-IxO (fixed-128x64) or "
                            "jsonl:PATH")
    bench.add_argument("--prompts", type=Path, default=None,
                       help="a JSONL file of prompts (same as --workload jsonl:PATH)")
    bench.add_argument("--max-tokens", type=int, default=64,
                       help="output length of JSONL lines without max_tokens")
    bench.add_argument("--stop-at-eos", action="store_true",
                       help="let the model's EOS end each output (the workload's length is then "
                            "a cap), instead of forcing every output to its length")
    bench.add_argument("--num-requests", type=int, default=None,
                       help="requests of a generated workload (default: 64; --quick: 16)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--output", type=Path, help="write the results JSON (and plots) here")
    bench.add_argument("--plots-dir", type=Path, default=None,
                       help="where the PNG plots go (default: next to --output)")
    bench.add_argument("--mode", default="offline", choices=("offline", "online"),
                       help="offline: all at t=0 into the engine; online: through the gRPC server")
    bench.add_argument("--rate", type=float, default=None,
                       help="online: requests/s (default: all at once)")
    bench.add_argument("--burstiness", type=float, default=1.0,
                       help="online: gamma shape of the gaps; 1 is Poisson, < 1 burstier")
    bench.add_argument("--concurrency", type=int, default=None, help="online: max in flight")
    bench.add_argument("--rates", type=_float_list, default=None,
                       help="online: sweep these request rates, e.g. 1,2,4")
    bench.add_argument("--concurrencies", type=_int_list, default=None,
                       help="online: sweep these concurrency caps, e.g. 1,4,16")
    bench.add_argument("--slo-scale", type=float, default=None,
                       help="online: goodput against MLPerf Llama-2-70B Server SLOs (TTFT 2 s, "
                            "TPOT 200 ms) times this factor")
    bench.add_argument("--find-max-rate", action="store_true",
                       help="online: search the highest Poisson rate meeting the p99 SLOs "
                            "(needs --slo-scale)")
    bench.add_argument("--max-rate-probes", type=int, default=6,
                       help="online runs per policy for --find-max-rate")
    bench.add_argument("--roofline", action=argparse.BooleanOptionalAction, default=True,
                       help="measure the machine and decode steps against the floor first")
    bench.add_argument("--startup", action="store_true",
                       help="time `meshserve generate --prompt hi --max-tokens 4` (default engine) "
                            "in fresh processes, with an empty and a filled compilation cache")
    bench.add_argument("--roofline-batch", type=int, action="append", default=None,
                       help="decode batch for the roofline; repeat (default: 1, 8, 32, 64; "
                            "--quick: 1, 8)")
    bench.add_argument("--compare", action="append", default=None,
                       choices=("static", "hf", "llama-cpp"),
                       help="static (always run) and peers: hf, llama-cpp; repeat for several")
    bench.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                       help="a progress bar (only on a terminal)")
    bench.add_argument("--quick", action="store_true",
                       help="a smoke run: 16 short chat-mix requests, roofline at 1 and 8")
    _model_args(bench)


def _float_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _client_args(client: argparse.ArgumentParser) -> None:
    client.add_argument("--target", default="127.0.0.1:50051", help="the server's HOST:PORT")
    client.add_argument("--prompt", action="append", default=[], help="repeat for several")
    client.add_argument("--max-tokens", type=int, default=64)
    client.add_argument("--temperature", type=float, default=0.0)
    client.add_argument("--seed", type=int, default=None)
    client.add_argument("--raw", action="store_true",
                        help="send prompts as plain text, not as a chat message")
    key = client.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None)
    key.add_argument("--api-key-file", type=Path, default=None, help="read the api key from here")
    client.add_argument("--tls-root-cert", type=Path, default=None,
                        help="PEM certificate to trust; connects with TLS")
    client.add_argument("--tls", action="store_true",
                        help="connect with TLS, trusting the system's root certificates")
    client.add_argument("--info", action="store_true", help="print GetServerInfo as JSON")


def run_serve(args: argparse.Namespace) -> int:
    """Serves until SIGTERM or SIGINT (drain, exit 0) or an engine failure (exit 1).

    In a multi-process job only process 0 serves; the others follow its plan stream
    (`_follow`) until it stops them.
    """
    config = dataclass_from_args(ServerConfig, args)
    cluster_config = _cluster_config(args)
    llm = _load(args, needs_tokenizer=False, cluster=cluster_config)
    cluster = llm.cluster
    if cluster is not None and not cluster.is_leader:
        return _follow(llm, cluster)
    server = GenerationServer(llm.engine, config)
    if cluster is not None:
        cluster.on_failure(server.peer_lost)
    port = server.start()
    processes = "" if cluster is None else f", {cluster.num_processes} processes"
    print(f"meshserve: serving {llm.model_config.name} on {config.host}:{port} "
          f"(mesh {llm.engine.config.mesh}{processes})", flush=True)
    drain = lambda *_: threading.Thread(target=server.drain, daemon=True).start()  # noqa: E731
    signal.signal(signal.SIGTERM, drain)
    signal.signal(signal.SIGINT, drain)
    if server.wait():
        if cluster is not None:
            _print_plan_stream(llm, cluster)
            cluster.shutdown()  # STOP: every follower leaves with us
        print("meshserve: drained and stopped", flush=True)
        return 0
    if cluster is not None and cluster.failed is not None:
        print(f"meshserve: error: {cluster.failed}", file=sys.stderr, flush=True)
    else:
        print("meshserve: error: the engine failed; see the log above", file=sys.stderr,
              flush=True)
    return 1


def _follow(llm: LLM, cluster: multihost.Cluster) -> int:
    """A follower of `serve`: runs process 0's steps until process 0 stops the job. SIGTERM
    and SIGINT here are noted and otherwise ignored: process 0 drains, then stops everyone."""
    ignore = lambda *_: print(  # noqa: E731
        f"meshserve: process {cluster.process_id}: stopping is process 0's call; following "
        "until it drains and stops the job", flush=True)
    signal.signal(signal.SIGTERM, ignore)
    signal.signal(signal.SIGINT, ignore)
    print(f"meshserve: process {cluster.process_id} of {cluster.num_processes} following "
          f"process 0 (mesh {llm.engine.config.mesh})", flush=True)
    header, _ = multihost.follow_or_exit(llm.engine.runner, cluster)
    if header.command != wire.STOP:
        cluster.abandon(f"process 0 sent {header.name} to a serving follower")
    cluster.shutdown()
    print(f"meshserve: process {cluster.process_id} stopped with process 0", flush=True)
    return 0


def run_client(args: argparse.Namespace) -> None:
    """Streams each prompt's answer to stdout (one after the other, each ending in a newline),
    its finish reason and usage to stderr; `--info` first prints GetServerInfo as JSON. Bad
    options raise ValueError or FileNotFoundError before anything is sent; a failed RPC raises
    ClientError."""
    if not args.prompt and not args.info:
        raise ValueError("give --prompt (repeatable) or --info")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed)
    api_key = args.api_key
    if args.api_key_file is not None:
        if not args.api_key_file.is_file():
            raise FileNotFoundError(f"api key file {args.api_key_file} does not exist")
        api_key = args.api_key_file.read_text().strip()
        if not api_key:
            raise ValueError(f"api key file {args.api_key_file} is empty")
    if args.tls_root_cert is not None and not args.tls_root_cert.is_file():
        raise FileNotFoundError(f"TLS root certificate {args.tls_root_cert} does not exist")
    with Client(args.target, api_key=api_key, tls_root_cert=args.tls_root_cert,
                tls=args.tls) as client:
        if args.info:
            print(json.dumps(client.server_info().as_dict(), indent=2), flush=True)
        for prompt in args.prompt:
            if len(args.prompt) > 1:
                print(f">>> {prompt}", flush=True)
            message = prompt if args.raw else [{"role": "user", "content": prompt}]
            for item in client.stream(message, params):
                if isinstance(item, StreamChunk):
                    print(item.text, end="", flush=True)
                    continue
                print(flush=True)
                stop = "" if item.stop_reason is None else f" ({item.stop_reason!r})"
                print(f"[{item.finish_reason}{stop}] {item.prompt_tokens} prompt tokens "
                      f"({item.cached_tokens} cached), {item.completion_tokens} completion "
                      f"tokens", file=sys.stderr, flush=True)


def run_convert(args: argparse.Namespace) -> None:
    check_destination(args.out, force=args.force)  # before the (slow) load
    pretrained = load_pretrained(args.model, dtype=args.dtype)
    path = save_checkpoint(pretrained.model, pretrained.tokenizer, args.out, force=args.force)
    config = pretrained.config
    tokenizer = "with its tokenizer" if pretrained.tokenizer is not None else "no tokenizer"
    print(f"wrote {config.name} ({config.num_params / 1e6:.1f}M params, {config.dtype}, "
          f"{tokenizer}) to {path}")


QUICK_MAX_PROMPT, QUICK_MAX_OUTPUT, QUICK_MAX_MODEL_LEN = 128, 32, 256


def run_bench(args: argparse.Namespace, argv: Sequence[str] | None) -> None:
    from meshserve.serving.bench import bench, plots

    _check_bench_args(args)
    if args.policy in ORDERINGS:  # both batching policies always run: --policy picks the ordering
        args.ordering, args.policy = args.policy, "continuous"
    if args.quick and args.max_model_len is None:
        args.max_model_len = QUICK_MAX_MODEL_LEN
    llm = _load(args, needs_tokenizer=False, warmup=False)
    requests = _bench_requests(args, llm, bench)
    if args.stop_at_eos:
        requests = [dataclasses.replace(r, stop_at_eos=True) for r in requests]
    progress = args.progress and sys.stderr.isatty()
    payload: dict[str, Any] = {}
    if args.startup:  # before this process compiles anything, so the runs have the cores
        payload["startup"] = startup = bench.measure_startup(str(resolve_model(args.model).path),
                                                             dtype=args.dtype)
        for name in ("empty_cache", "warm_cache"):
            run = startup[name]
            print(f"startup, {name.replace('_', ' ')}: answer after {run['wall_s']:.1f} s "
                  f"(load {run['load_s']} s, {run['programs']:.0f} programs in "
                  f"{run['compile_s']} s, first token {run['first_token_s']} s)")
    if args.roofline:
        batches = args.roofline_batch or ((1, 8) if args.quick else bench.ROOFLINE_BATCHES)
        payload["roofline"] = bench.run_roofline(llm.engine.model, llm.engine.config,
                                                 batches=batches,
                                                 layout=llm.engine.runner.layout)
    slos = None if args.slo_scale is None else latency.mlperf_server_slos(args.slo_scale)
    online = {}
    if args.mode == "online":
        online = dict(rate=args.rate, burstiness=args.burstiness, concurrency=args.concurrency,
                      slos=slos, seed=args.seed)
    engines = bench.make_engines(llm.engine.model, llm.engine.config)
    axis, values = (("rate", args.rates) if args.rates else
                    ("concurrency", args.concurrencies) if args.concurrencies else (None, None))
    if axis is None:
        results = bench.compare_policies(llm.engine.model, llm.engine.config, requests,
                                         mode=args.mode, engines=engines, progress=progress,
                                         **online)
    else:
        swept = bench.sweep(engines, requests, axis=axis, values=values, progress=progress,
                            **online)
        results = {p: swept[p][-1] for p in bench.POLICIES} | {"sweep": swept}
        results["ratio_output_tokens_per_s"] = (results["continuous"]["output_tokens_per_s"]
                                                / results["static"]["output_tokens_per_s"])
    if args.find_max_rate:
        results["max_rate"] = {p: bench.find_max_rate(
            engines[p], requests, slos=slos, start=args.rate or 1.0,
            max_probes=args.max_rate_probes, seed=args.seed, burstiness=args.burstiness,
            progress=progress) for p in bench.POLICIES}
    peers = [name for name in dict.fromkeys(args.compare or []) if name != "static"]
    if peers:
        results["peers"] = bench.run_peers(peers, args.model, requests,
                                           max_batch_size=llm.engine.config.max_num_seqs,
                                           continuous=results["continuous"])
    _print_bench(results, payload.get("roofline"), online=args.mode == "online")
    if args.output or args.plots_dir:
        directory = args.plots_dir or args.output.parent
        stem = args.output.stem if args.output else "bench"
        payload["plots"] = plots.write_plots(results, directory, stem) | {
            "directory": str(directory)}
    if args.output:
        command = "meshserve " + " ".join(argv if argv is not None else sys.argv[1:])
        bench.write_results(args.output, {
            "schema_version": 1, "command": command, "model": llm.model_config.name,
            "workload": args.workload, "num_requests": len(requests), "seed": args.seed,
            "mode": args.mode, "quick": args.quick,
            "arrivals": {k: v for k, v in online.items() if k != "slos"} or None,
            "engine_config": dataclasses.asdict(llm.engine.config),
            "environment": bench.environment(), "results": results} | payload)


def _check_bench_args(args: argparse.Namespace) -> None:
    online_only = [flag for flag, given in (("--rates", args.rates),
                                            ("--concurrencies", args.concurrencies),
                                            ("--find-max-rate", args.find_max_rate)) if given]
    if online_only and args.mode != "online":
        raise ValueError(f"{', '.join(online_only)} need --mode online")
    if args.rates and args.concurrencies:
        raise ValueError("give --rates or --concurrencies, not both")
    if args.find_max_rate and args.slo_scale is None:
        raise ValueError("--find-max-rate needs --slo-scale (the SLOs it must meet)")
    if args.max_rate_probes < 1:
        raise ValueError(f"--max-rate-probes must be >= 1, got {args.max_rate_probes}")
    if args.prompts is not None:
        if args.workload not in ("chat-mix", f"jsonl:{args.prompts}"):
            raise ValueError("give --prompts or --workload, not both")
        args.workload = f"jsonl:{args.prompts}"


def _bench_requests(args: argparse.Namespace, llm: LLM, bench) -> list:
    if args.workload.startswith("jsonl:"):
        if args.num_requests is not None:
            raise ValueError("--num-requests applies to generated workloads; a JSONL file runs "
                             "every line")
        return bench.load_jsonl_workload(args.workload.removeprefix("jsonl:"),
                                         tokenizer=llm.tokenizer,
                                         vocab_size=llm.model_config.vocab_size,
                                         default_max_tokens=args.max_tokens)
    num_requests = args.num_requests or (16 if args.quick else 64)
    requests = bench.make_workload(args.workload, num_requests=num_requests,
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
    print(f"{'policy':<11} {'out tok/s':>10} {'req/s':>7} {'prefill pad':>11} {'decode pad':>10} "
          f"{'host':>6} {'kv peak':>7} {'frag mean':>9} {'frag peak':>9} {'preempt':>7} "
          f"{'recompiles':>10} {'stage util':>10}")
    for policy in ("continuous", "static"):
        r = results[policy]
        kv = r["kv"]
        print(f"{policy:<11} {r['output_tokens_per_s']:>10.1f} {r['requests_per_s']:>7.2f} "
              f"{r['prefill_padding']:>11.1%} {r['decode_padding']:>10.1%} "
              f"{r['host_overhead']:>6.1%} {kv['peak_used_pages']:>7} "
              f"{kv['mean_fragmentation']:>9.1%} {kv['peak_fragmentation']:>9.1%} "
              f"{r['preemptions']:>7} {r['compiles_after_warmup']:>10} "
              f"{r['stage_utilisation']:>10.1%}")
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
                  f"{peer.get('ratio_continuous_output_tokens_per_s', float('nan')):.2f}x")
    print(f"continuous / static output tokens/s: {results['ratio_output_tokens_per_s']:.2f}x")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _print_latencies(results: dict) -> None:
    print(f"{'policy':<11} {'metric':<6} {'mean ms':>9} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9}")
    for policy in ("continuous", "static"):
        for metric in ("ttft", "tpot", "itl", "e2el"):
            d = results[policy][f"{metric}_s"]
            cells = " ".join(f"{'-' if d[k] is None else f'{d[k] * 1e3:.1f}':>9}"
                             for k in ("mean", "median", "p90", "p99"))
            print(f"{policy:<11} {metric:<6} {cells}")
        goodput = results[policy]["goodput"]
        if goodput["slos"] is not None:
            print(f"{policy:<11} goodput {goodput['requests_per_s']:.2f} req/s under "
                  f"{goodput['slos']['name']}")


def _load(args: argparse.Namespace, *, needs_tokenizer: bool, warmup: bool = True,
          cluster: multihost.ClusterConfig | None = None) -> LLM:
    """The model and engine; bad options and a missing tokenizer fail before the warm-up."""
    config = dataclass_from_args(EngineConfig, args)
    started = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, cluster=cluster,
              **(dataclasses.asdict(config) | {"warmup": False}))
    print(f"meshserve: loaded {llm.model_config.name} in {time.perf_counter() - started:.1f} s",
          file=sys.stderr, flush=True)
    if needs_tokenizer and llm.tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer; pass a GGUF file or an HF "
                         "directory with tokenizer.json")
    if warmup and config.warmup:
        llm.engine.warmup()
    return llm


# -- generate ----------------------------------------------------------------------------------

def run_generate(args: argparse.Namespace) -> None:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed)
    llm = _load(args, needs_tokenizer=True)
    engine = llm.engine
    for prompt in args.prompt:
        text = prompt if args.raw else _chat(llm, [{"role": "user", "content": prompt}])
        engine.add_request(text, params, request_id=prompt)
    shown = {p: 0 for p in args.prompt}
    started = time.perf_counter()
    num_tokens = 0
    stream_one = len(args.prompt) == 1
    first_token = None
    while engine.has_unfinished():
        for out in engine.step():
            if first_token is None and out.outputs[0].token_ids:
                first_token = time.perf_counter() - STARTED
                print(f"meshserve: first token after {first_token:.1f} s", file=sys.stderr,
                      flush=True)
            text = out.outputs[0].text
            if stream_one:
                print(text[shown[out.request_id]:], end="", flush=True)
                shown[out.request_id] = len(text)
            elif out.finished:
                print(f"\n>>> {out.request_id}\n{text.strip()}")
            num_tokens += len(out.outputs[0].token_ids) if out.finished else 0
    elapsed = time.perf_counter() - started
    print(f"\n\n{num_tokens} tokens in {elapsed:.2f}s: {num_tokens / elapsed:.1f} tokens/s")


def _chat(llm: LLM, messages: list[dict]) -> str:
    return llm.tokenizer.apply_chat_template(messages)


# -- batch -------------------------------------------------------------------------------------

def read_requests(path: Path) -> Iterator[dict[str, Any]]:
    """Parses and validates every line first, so a bad line fails before any work is done."""
    if not path.is_file():
        raise FileNotFoundError(f"batch input {path} does not exist")
    lines = path.read_text(encoding="utf-8").splitlines()
    entries, first_line = [], {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        entry = _parse_line(line, number, path)
        if entry["id"] in first_line:
            raise ValueError(f"{path}:{number}: id {entry['id']!r} is already used on line "
                             f"{first_line[entry['id']]}")
        first_line[entry["id"]] = number
        entries.append(entry)
    return iter(entries)


def _parse_line(line: str, number: int, path: Path) -> dict[str, Any]:
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from None
    if not isinstance(entry, dict):
        raise ValueError(f"{path}:{number}: each line must be a JSON object")
    prompts = [k for k in ("prompt", "prompt_token_ids", "messages") if k in entry]
    if len(prompts) != 1:
        raise ValueError(f"{path}:{number}: give exactly one of prompt, prompt_token_ids, messages")
    unknown = set(entry) - SAMPLING_FIELDS - {"id", "prompt", "prompt_token_ids", "messages"}
    if unknown:
        raise ValueError(f"{path}:{number}: unknown fields {sorted(unknown)}")
    sampling = {k: v for k, v in entry.items() if k in SAMPLING_FIELDS}
    try:
        params = SamplingParams(**sampling)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}:{number}: {err}") from None
    return {"id": str(entry.get("id", number)), "kind": prompts[0], "value": entry[prompts[0]],
            "params": params}


def finished_ids(path: Path) -> set[str]:
    """Ids already in the output. A torn last line (an interrupted write) is cut off."""
    if not path.exists():
        return set()
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
        path.write_text(text, encoding="utf-8")
    return {json.loads(line)["id"] for line in text.splitlines() if line.strip()}


def run_batch(args: argparse.Namespace, input_path: Path, output_path: Path, *,
              show: bool) -> None:
    cluster_config = _cluster_config(args) if hasattr(args, "coordinator") else None
    if cluster_config is not None:
        return _run_batch_on_cluster(args, cluster_config, input_path, output_path, show=show)
    todo = _pending(input_path, output_path)
    if not todo:
        return
    llm = _load(args, needs_tokenizer=any(e["kind"] != "prompt_token_ids" for e in todo))
    _run_entries(llm, todo, output_path, show=show)


def _pending(input_path: Path, output_path: Path, where: str = "") -> list[dict]:
    """The input's requests whose ids are not in the output yet; prints the counts."""
    entries = list(read_requests(input_path))
    done = finished_ids(output_path)
    todo = [e for e in entries if e["id"] not in done]
    print(f"{len(entries)} requests, {len(done & {e['id'] for e in entries})} already done, "
          f"{len(todo)} to run{where}")
    return todo


def _run_entries(llm: LLM, todo: list[dict], output_path: Path, *, show: bool) -> None:
    for entry in todo:
        prompt = _chat(llm, entry["value"]) if entry["kind"] == "messages" else entry["value"]
        llm.engine.add_request(prompt, entry["params"], request_id=entry["id"])
    _drain_to_file(llm, output_path, len(todo), show=show)


def _run_batch_on_cluster(args: argparse.Namespace, cluster_config: multihost.ClusterConfig,
                          input_path: Path, output_path: Path, *, show: bool) -> None:
    """`batch` on many processes: process 0 reads the input, schedules and writes the output;
    the others follow its plan stream until it stops them. Every process joins before anything
    is read, so an input with nothing left to run still ends the job cleanly."""
    llm = _load(args, needs_tokenizer=False, cluster=cluster_config)
    cluster = llm.cluster
    if not cluster.is_leader:
        _follow(llm, cluster)  # returns once process 0 stops the job, else exits non-zero
        return
    try:
        todo = _pending(input_path, output_path, f" on {cluster.num_processes} processes")
        if todo and llm.tokenizer is None and any(e["kind"] != "prompt_token_ids" for e in todo):
            raise ValueError(f"model {args.model!r} has no tokenizer; give prompt_token_ids")
        if todo:
            _run_entries(llm, todo, output_path, show=show)
            _print_plan_stream(llm, cluster)
    finally:
        if cluster.failed is None:
            cluster.shutdown()  # STOP: the followers leave with us, also after bad input


def _print_plan_stream(llm: LLM, cluster: multihost.Cluster) -> None:
    """How much of the step time went to sending plans (warm-up is not in it)."""
    stream, stats = cluster.stream, llm.engine.stats
    steps = max(stats.num_steps, 1)
    print(f"plan stream: {stream.num_messages} messages, {stream.seconds * 1e3 / steps:.2f} ms "
          f"per step ({stream.seconds / max(stats.step_seconds, 1e-9):.1%} of step time), "
          f"{4 * stream.num_payload_words / steps / 1024:.1f} KiB per step")


def _drain_to_file(llm: LLM, output_path: Path, total: int, *, show: bool) -> None:
    started, num_tokens = time.perf_counter(), 0
    output_path.parent.mkdir(parents=True, exist_ok=True)
    with output_path.open("a", encoding="utf-8") as out_file, \
            tqdm(total=total, desc="batch", unit="req") as bar:
        while llm.engine.has_unfinished():
            for out in llm.engine.step():
                if not out.finished:
                    continue
                out_file.write(json.dumps(_result_record(out), ensure_ascii=False) + "\n")
                out_file.flush()
                num_tokens += len(out.outputs[0].token_ids)
                bar.update(1)
                if show:
                    tqdm.write(f"\n>>> {out.request_id}\n{out.outputs[0].text.strip()}")
    elapsed = time.perf_counter() - started
    stats = llm.engine.stats
    print(f"{num_tokens} output tokens in {elapsed:.2f}s: {num_tokens / elapsed:.1f} tokens/s; "
          f"padding {stats.prefill_padding:.0%} prefill, {stats.decode_padding:.0%} decode; "
          f"{llm.engine.scheduler.num_preemptions} preemptions; "
          f"{stats.compiles_after_warmup} compiles after warm-up")


def _result_record(out) -> dict[str, Any]:
    completion = out.outputs[0]
    return {"id": out.request_id, "text": completion.text, "token_ids": completion.token_ids,
            "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
            "num_prompt_tokens": len(out.prompt_token_ids),
            "num_output_tokens": len(completion.token_ids)}


def demo_prompts() -> Path:
    return Path(str(resources.files("meshserve.serving") / "examples" / "demo_prompts.jsonl"))


# -- roofline ----------------------------------------------------------------------------------

def run_roofline(args: argparse.Namespace) -> None:
    from meshserve.serving.bench.bench import decode_runner

    llm = _load(args, needs_tokenizer=False, warmup=False)
    config, batches = llm.model_config, args.batch or [1]
    runner = decode_runner(llm.engine.model, max_batch=max(batches), context=args.context,
                           page_size=llm.engine.config.page_size,
                           layout=llm.engine.runner.layout)
    machine = roofline.measure_machine()
    print(f"bandwidth {machine.bandwidth / 1e9:.1f} GB/s (copy; in-place update "
          f"{machine.update_bandwidth / 1e9:.1f}), matmul {machine.matmul_rate / 1e9:.1f} "
          f"GFLOP/s, weights {weight_bytes(config) / 1e6:.0f} MB")
    print(f"{'batch':>5} {'step ms':>9} {'floor ms':>9} {'floor/step':>10}")
    rows = []
    for batch in batches:
        step = roofline.measure_decode_step(runner, batch=batch, context=args.context)
        floor = roofline.decode_floor(config, machine, batch=batch, context=args.context)
        print(f"{batch:>5} {step * 1e3:>9.2f} {floor * 1e3:>9.2f} {floor / step:>10.2f}")
        rows.append({"batch": batch, "step_s": step, "floor_s": floor,
                     "floor_over_step": floor / step})
    if args.output:
        from meshserve.serving.bench import bench

        bench.write_results(args.output, {
            "command": "meshserve " + " ".join(sys.argv[1:]), "model": config.name,
            "dtype": config.dtype, "context": args.context,
            "machine": dataclasses.asdict(machine), "environment": bench.environment(),
            "decode": rows})


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            run_generate(args)
        elif args.command == "batch":
            run_batch(args, args.input, args.output, show=args.show)
        elif args.command == "demo":
            with tempfile.TemporaryDirectory() as tmp:
                run_batch(args, demo_prompts(), Path(tmp) / "results.jsonl", show=True)
        elif args.command == "bench":
            run_bench(args, argv)
        elif args.command == "serve":
            return run_serve(args)
        elif args.command == "convert":
            run_convert(args)
        elif args.command == "plan":
            return run_plan(args)
        elif args.command == "mesh-sweep":
            return run_mesh_sweep(args, argv, dataclass_from_args(EngineConfig, args))
        elif args.command == "client":
            try:
                run_client(args)
            except ClientError as err:
                print(f"meshserve: error: {err.code.name}: {err.message}", file=sys.stderr)
                return 2
        else:
            run_roofline(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"meshserve: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
