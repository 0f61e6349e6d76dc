"""`meshserve serve`: the gRPC server (meshserve.v1.Generation): streaming Generate, Abort,
GetServerInfo, health, reflection, admission control, drain on SIGTERM, Prometheus metrics
(`--metrics-port`); with `--http-port`, the OpenAI-compatible HTTP API too, on the same engine loop
(`meshserve.serving.http_api.app`); on many hosts with --coordinator/--num-processes/--process-id
(`meshserve.serving.engine.multihost`)."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading

from meshserve.batching import wire
from meshserve.serving.engine import multihost
from meshserve.serving import options
from meshserve.serving.python_api.llm import LLM
from meshserve.serving.grpc_api.server import GenerationServer, ServerConfig

HELP = "the gRPC server (meshserve.v1.Generation), and the OpenAI HTTP API with --http-port"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_config_args(parser, ServerConfig)
    options.add_cluster_args(parser)
    options.add_model_args(parser)


def run(args: argparse.Namespace) -> int:
    """Serves until SIGTERM or SIGINT (drain, exit 0) or an engine failure (exit 1).

    In a multi-process job only process 0 serves; the others follow its plan stream
    (`follow`) until it stops them.
    """
    config = served_under_model_name(options.dataclass_from_args(ServerConfig, args), args.model)
    config.check_lora(args.enable_lora)  # before the model loads
    cluster_config = options.cluster_config_from_args(args)
    llm = options.load_llm(args, needs_tokenizer=False, cluster=cluster_config)
    cluster = llm.cluster
    if cluster is not None and not cluster.is_leader:
        return follow(llm, cluster)
    server = GenerationServer(llm.engine, config)
    if cluster is not None:
        cluster.on_failure(server.peer_lost)
    port = server.start()
    processes = "" if cluster is None else f", {cluster.num_processes} processes"
    print(f"meshserve: serving {llm.model_config.name} on {config.host}:{port} "
          f"(mesh {llm.engine.config.mesh}{processes})", flush=True)
    if server.http_port is not None:
        print(f"meshserve: OpenAI-compatible HTTP API on {config.host}:{server.http_port} "
              f"(/v1/completions, /v1/chat/completions), model "
              f"{', '.join(repr(n) for n in config.served_model_name)}", flush=True)
    if server.adapters is not None and server.adapters.requests():
        print(f"meshserve: LoRA adapters "
              f"{', '.join(repr(r.lora_name) for r in server.adapters.requests())}", flush=True)
    drain = lambda *_: threading.Thread(target=server.drain, daemon=True).start()  # noqa: E731
    signal.signal(signal.SIGTERM, drain)
    signal.signal(signal.SIGINT, drain)
    if server.wait():
        if cluster is not None:
            print_plan_stream(llm, cluster)
            cluster.shutdown()  # STOP: every follower leaves with us
        print("meshserve: drained and stopped", flush=True)
        return 0
    if cluster is not None and cluster.failed is not None:
        print(f"meshserve: error: {cluster.failed}", file=sys.stderr, flush=True)
    else:
        print("meshserve: error: the engine failed; see the log above", file=sys.stderr,
              flush=True)
    return 1


def served_under_model_name(config: ServerConfig, model: str) -> ServerConfig:
    """`config`, serving the model under the name the user gave with --model (as vLLM does)
    unless --served-model-name gave names."""
    if config.served_model_name:
        return config
    return dataclasses.replace(config, served_model_name=(model,))


def follow(llm: LLM, cluster: multihost.Cluster) -> int:
    """A follower of `serve` or `batch`: runs process 0's steps until process 0 stops the job.
    SIGTERM and SIGINT here are noted and otherwise ignored: process 0 drains, then stops
    everyone."""
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


def print_plan_stream(llm: LLM, cluster: multihost.Cluster) -> None:
    """How much of the step time went to sending plans (warm-up is not in it)."""
    stream, stats = cluster.stream, llm.engine.stats
    steps = max(stats.num_steps, 1)
    print(f"plan stream: {stream.num_messages} messages, {stream.seconds * 1e3 / steps:.2f} ms "
          f"per step ({stream.seconds / max(stats.step_seconds, 1e-9):.1%} of step time), "
          f"{4 * stream.num_payload_words / steps / 1024:.1f} KiB per step")
