"""Many hosts, one program: meshserve on `jax.distributed`, process 0 leading.

Every process runs the same model on one global mesh over all processes' devices, and each one
holds only its own devices' shards of the weights and the KV cache. Only process 0 decides:

    process 0 (leader)                          process i > 0 (follower)
    ------------------                          ------------------------
    scheduler, gRPC, metrics, `LLM` calls       no RPCs, no scheduler
    runner.execute(step):                       follow():
      host arrays of each compiled call           header  <- broadcast
      header, payload  -> broadcast  --------->    payload <- broadcast (shapes from the header)
      run the compiled calls                       run the same compiled calls
      sampled tokens (replicated) -> host         (outputs stay on device)

Every process thus enqueues the same programs in the same order, which is what a multi-controller
JAX program needs; the collectives inside them (all-reduces over `model`, ppermutes over `stage`)
meet across processes. The plan goes out as fixed-shape int32 arrays (`meshserve.batching.wire`):
a 64-word header, then the step's host arrays padded to a power of two of words, so a handful of
broadcast programs serve every step.

Failure. Each process writes a heartbeat to the coordination service's key-value store every
0.25 s, and process 0 watches every other one (followers watch process 0):
  - a process that dies breaks the next collective at once: the survivors see the error, wait
    until the dead process's heartbeat is clearly stale (about a second), and name it;
  - a process that hangs stops beating: after `peer_timeout` seconds the others give up on it
    (followers read process 0's heartbeat with that deadline, since a frozen process 0 freezes
    the coordination service too);
  - a follower whose own step fails records why under `meshserve/failed/<id>` before exiting,
    and process 0 reports that reason.
Process 0 then runs its failure callbacks (the server sets health NOT_SERVING and fails every
open stream with UNAVAILABLE) and exits non-zero with a message naming the lost process. JAX's own
heartbeat timeout is set longer than `peer_timeout`, so it does not abort the process first.
If process 0 itself dies, the coordination service (which runs inside it) goes with it, and JAX
ends every follower at once (exit status 134).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from meshserve.batching import wire
from meshserve.batching.knobs import knob

log = logging.getLogger(__name__)

DEFAULT_PEER_TIMEOUT = 10.0
BEAT_INTERVAL = 0.25  # seconds between heartbeats
STALE_AFTER_ERROR = 1.0  # a heartbeat this old after a failed collective marks its process dead
_BEAT_KEY = "meshserve/beat/"
_FAILED_KEY = "meshserve/failed/"
_EXIT_GRACE = 0.5  # seconds failure callbacks get to reach clients before the process exits


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """How this process joins a multi-process job. Leave all three of `coordinator`,
    `num_processes` and `process_id` None to let `jax.distributed.initialize` read them from
    the cluster's environment (SLURM, Open MPI, Kubernetes, Cloud TPU)."""

    coordinator: str | None = knob(None, "where process 0 runs JAX's coordination service",
                                   metavar="HOST:PORT")
    num_processes: int | None = knob(None, "processes in the job, one per host")
    process_id: int | None = knob(None, "this process's id, 0 to num_processes - 1")
    peer_timeout: float = knob(DEFAULT_PEER_TIMEOUT, "seconds a silent process is waited for "
                                                     "before the job fails")
    initialization_timeout: int = knob(300, "seconds to wait for every process to join")

    def __post_init__(self):
        if self.coordinator is not None:
            host, sep, port = self.coordinator.rpartition(":")
            if not sep or not host or not port.isascii() or not port.isdigit() \
                    or not 0 < int(port) < 65536:
                raise ValueError(f"coordinator must be HOST:PORT, got {self.coordinator!r}")
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None:
            if self.process_id < 0:
                raise ValueError(f"process_id must be >= 0, got {self.process_id}")
            if self.num_processes is not None and self.process_id >= self.num_processes:
                last = self.num_processes - 1
                raise ValueError(f"process_id {self.process_id} is out of range for "
                                 f"{self.num_processes} processes (ids 0..{last})")
        if not 0 < self.peer_timeout < float("inf"):
            raise ValueError(f"peer_timeout must be > 0 seconds, got {self.peer_timeout}")
        if self.initialization_timeout < 1:
            raise ValueError("initialization_timeout must be >= 1 second")

    @property
    def jax_heartbeat_timeout(self) -> int:
        """JAX's own timeout, kept well past ours so that our account of a failure comes first."""
        return int(max(2 * self.peer_timeout, self.peer_timeout + 10))


class PeerLost(RuntimeError):
    """A process of the job died, hung or failed; the job cannot go on."""

    def __init__(self, process_id: int | None, message: str):
        super().__init__(message)
        self.process_id = process_id


_CLUSTER: "Cluster | None" = None


def initialize(config: ClusterConfig = ClusterConfig()) -> "Cluster":
    """Joins the job (`jax.distributed.initialize`) and starts the heartbeat; once per process.

    Call it before anything else touches JAX's devices. Returns the process's `Cluster`.
    """
    global _CLUSTER
    if _CLUSTER is not None:
        raise RuntimeError("this process already joined a multi-process job")
    try:
        jax.distributed.initialize(
            coordinator_address=config.coordinator, num_processes=config.num_processes,
            process_id=config.process_id, initialization_timeout=config.initialization_timeout,
            heartbeat_timeout_seconds=config.jax_heartbeat_timeout)
    except ValueError as err:
        raise ValueError(f"cannot join the job: {err} No cluster environment (SLURM, Open MPI, "
                         "Kubernetes) gave it: pass --coordinator, --num-processes and "
                         "--process-id") from err
    _CLUSTER = Cluster(config.peer_timeout)
    log.info("process %d of %d joined; %d local devices of %d", _CLUSTER.process_id,
             _CLUSTER.num_processes, jax.local_device_count(), jax.device_count())
    return _CLUSTER


def current() -> "Cluster | None":
    """The job this process joined, or None when it runs alone."""
    return _CLUSTER


class Cluster:
    """This process's place in the job: the plan stream, the heartbeat and failure handling."""

    def __init__(self, peer_timeout: float = DEFAULT_PEER_TIMEOUT):
        self.process_id = jax.process_index()
        self.num_processes = jax.process_count()
        self.peer_timeout = peer_timeout
        self.stream = PlanStream(self)
        self.failed: PeerLost | None = None
        self._client = _kv_client()
        self._callbacks: list[Callable[[PeerLost], None]] = []
        self._stop = threading.Event()
        self._seen: dict[int, tuple[str, float]] = {}  # process -> (last beat, when it changed)
        self._lock = threading.Lock()
        self._beats = 0
        self._beat()
        # Two threads: a write to a frozen coordinator blocks, and must not stop the watch.
        self._beater = threading.Thread(target=self._beat_loop, name="meshserve-heartbeat",
                                        daemon=True)
        self._thread = threading.Thread(target=self._watch, name="meshserve-watch", daemon=True)
        self._beater.start()
        self._thread.start()
        atexit.register(self._exit_if_failed)

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    def on_failure(self, callback: Callable[[PeerLost], None]) -> None:
        """Runs `callback(error)` once a peer is known lost, before this process exits."""
        self._callbacks.append(callback)

    # -- failure --------------------------------------------------------------------------------

    def failure(self, error: BaseException) -> PeerLost:
        """The account of a failed collective: which process was lost, and why.

        Waits until a peer's heartbeat is stale (a dead process's stops at once) or a peer has
        recorded its own failure; runs the failure callbacks; returns the error to raise.
        """
        if isinstance(error, PeerLost):
            return error
        lost = self.find_lost(wait=self.peer_timeout)
        if lost is None:
            return self._record(None, "a collective failed while every process still beats: "
                                      f"{_first_line(error)}")
        return lost

    def find_lost(self, *, wait: float) -> PeerLost | None:
        """The lost peer (recorded, callbacks run), looking for up to `wait` seconds; None if
        every watched peer kept beating."""
        if self.failed is not None:
            return self.failed
        deadline = time.monotonic() + wait
        while True:
            lost = self._find_lost(stale_after=STALE_AFTER_ERROR)
            if lost is not None:
                return self._record(*lost)
            if time.monotonic() >= deadline:
                return None
            time.sleep(BEAT_INTERVAL)

    def abandon(self, reason: str) -> None:
        """This process cannot go on: tell the others why, then exit non-zero."""
        try:
            self._client.key_value_set(f"{_FAILED_KEY}{self.process_id}", reason,
                                       allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the coordinator may be gone already
            pass
        _exit(f"meshserve: error: process {self.process_id} of {self.num_processes} failed: "
              f"{reason}")

    def _record(self, process_id: int | None, message: str) -> PeerLost:
        with self._lock:
            if self.failed is None:
                self.failed = PeerLost(process_id, message)
                log.error("%s", message)
                for callback in self._callbacks:
                    try:
                        callback(self.failed)
                    except Exception:  # noqa: BLE001 - one bad callback must not block the exit
                        log.exception("a failure callback failed")
            return self.failed

    def _find_lost(self, *, stale_after: float) -> tuple[int | None, str] | None:
        """A peer that recorded a failure, or whose heartbeat is older than `stale_after`."""
        try:
            failed = self._client.key_value_dir_get(_FAILED_KEY)
            beats = dict(self._client.key_value_dir_get(_BEAT_KEY))
        except Exception as err:  # noqa: BLE001 - the coordination service lives in process 0
            return 0, (f"lost process 0 of {self.num_processes}: its coordination service "
                       f"stopped answering ({_first_line(err)})")
        for key, reason in failed:
            peer = int(key.rsplit("/", 1)[1])
            if peer != self.process_id:
                return peer, f"lost process {peer} of {self.num_processes}: it failed: {reason}"
        now = time.monotonic()
        for peer in self._watched():
            value = beats.get(f"{_BEAT_KEY}{peer}")  # None until its first beat
            if peer not in self._seen or value != self._seen[peer][0]:
                self._seen[peer] = (value, now)
            elif now - (since := self._seen[peer][1]) > stale_after:
                return peer, (f"lost process {peer} of {self.num_processes}: no heartbeat for "
                              f"{now - since:.1f}s")
        return None

    def _watched(self) -> list[int]:
        if self.is_leader:
            return [p for p in range(self.num_processes) if p != self.process_id]
        return [0]

    def _beat(self) -> None:
        self._beats += 1
        self._client.key_value_set(f"{_BEAT_KEY}{self.process_id}", str(self._beats),
                                   allow_overwrite=True)

    def _beat_loop(self) -> None:
        while not self._stop.wait(BEAT_INTERVAL):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the watch judges peers; a lost coordinator
                pass  # shows there as process 0 not answering

    def _watch(self) -> None:
        """Gives up on a peer silent for `peer_timeout`. A follower first reads process 0's
        heartbeat with that deadline: process 0 runs the coordination service, and a read
        from it while it is frozen would otherwise block for good."""
        while not self._stop.wait(BEAT_INTERVAL):
            if self.failed is not None:
                continue  # the thread that found it handles the exit
            if not self.is_leader:
                try:
                    self._client.blocking_key_value_get(f"{_BEAT_KEY}0",
                                                        int(self.peer_timeout * 1000))
                except Exception as err:  # noqa: BLE001 - no answer within the deadline
                    lost = (0, f"lost process 0 of {self.num_processes}: its coordination "
                               f"service did not answer for {self.peer_timeout:.0f}s "
                               f"({_first_line(err)})")
                    self._give_up(lost)
                    continue
            lost = self._find_lost(stale_after=self.peer_timeout)
            if lost is not None:
                self._give_up(lost)

    def _give_up(self, lost: tuple[int | None, str]) -> None:
        if self._stop.is_set():
            return
        error = self._record(*lost)
        time.sleep(_EXIT_GRACE)
        _exit(f"meshserve: error: {error}")

    def _exit_if_failed(self) -> None:
        """At interpreter exit after a failure: skip JAX's shutdown barrier, which would wait
        for the lost process until JAX's heartbeat timeout and then abort."""
        if self.failed is not None:
            _exit(None)

    # -- the end --------------------------------------------------------------------------------

    def shutdown(self, runner=None) -> None:
        """Leaves the job: process 0 sends STOP, each follower waits for it (running whatever
        process 0 still sends, on `runner`); then every process stops beating and meets the
        others at JAX's shutdown barrier."""
        global _CLUSTER
        if self.failed is None and not self.stream.stopped:
            if self.is_leader:
                self.stream.send(wire.STOP)
            else:
                header, _ = follow_or_exit(runner, self)
                if header.command != wire.STOP:
                    self.abandon(f"process 0 sent {header.name} where STOP was due: every "
                                 "process must make the same calls")
        self._stop.set()
        self._thread.join()
        self._beater.join()
        if self.failed is not None:
            _exit(None)
        jax.distributed.shutdown()
        _CLUSTER = None


class PlanStream:
    """Process 0's plan broadcast and the followers' receiving end (`broadcast_one_to_all`)."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.sequence = 0
        self.stopped = False  # STOP went out (process 0) or came in (the others)
        self.num_messages = 0
        self.num_runs = 0  # RUN messages: one per engine step (per pipeline call with stages)
        self.num_payload_words = 0
        self.seconds = 0.0  # spent broadcasting (either end)

    # -- process 0 ------------------------------------------------------------------------------

    def publish_run(self, keys: Sequence[tuple[int, ...]], arrays: Sequence[Any]) -> None:
        """Sends one RUN: the calls' bucket keys in the header, then each call's arrays as one
        payload (so payload sizes are those of the warmed-up buckets). Followers call their
        runner's `run_calls` too, which must not send: only process 0 does."""
        if not self.cluster.is_leader:
            return
        payloads = [wire.pack(jax.tree.leaves(entry)) for entry in arrays]
        self.send(wire.RUN, _key_words(keys), payloads)

    def send(self, command: int, words: Sequence[int] = (),
             payloads: Sequence[np.ndarray] = ()) -> None:
        if self.cluster.failed is not None:
            raise self.cluster.failed
        header = wire.Header(command=command, sequence=self.sequence,
                             payload_words=sum(p.size for p in payloads), words=tuple(words))
        started = time.perf_counter()
        try:
            _broadcast(header.encode())
            for payload in payloads:
                _broadcast(payload)
        except Exception as err:
            raise self.cluster.failure(err) from err
        self._count(started, payloads)
        self.num_runs += command == wire.RUN
        self.stopped |= command == wire.STOP

    def warmup(self, payload_words: Sequence[int]) -> None:
        """Compiles the broadcast of a header and of each payload size, on every process at the
        same point (outside the message sequence), so serving compiles nothing new."""
        for size in sorted({wire.HEADER_WORDS, *payload_words}):
            _broadcast(np.zeros(size, np.int32))

    # -- followers ------------------------------------------------------------------------------

    def receive(self, payload_sizes: Callable[[wire.Header], Sequence[int]] = lambda h: (
            [h.payload_words] if h.payload_words else [])) -> tuple[wire.Header, list[np.ndarray]]:
        """The next message from process 0 (blocks until it is sent): its header, and its
        payloads, sized by `payload_sizes(header)` (default: one of `payload_words`)."""
        started = time.perf_counter()
        header = wire.Header.decode(_broadcast(np.zeros(wire.HEADER_WORDS, np.int32)),
                                    wire.HEADER_WORDS - 4)
        if header.sequence != self.sequence % wire.SEQUENCE_MODULUS:
            raise RuntimeError(f"plan message {header.sequence} arrived where "
                               f"{self.sequence} was due: the processes are out of step")
        sizes = list(payload_sizes(header))
        if sum(sizes) != header.payload_words:
            raise RuntimeError(f"a {header.name} message of {header.payload_words} payload words "
                               f"does not match the expected {sum(sizes)}: the processes do not "
                               "run the same configuration")
        payloads = [_broadcast(np.zeros(size, np.int32)) for size in sizes]
        self._count(started, payloads)
        self.num_runs += header.command == wire.RUN
        self.stopped |= header.command == wire.STOP
        return header, payloads

    def _count(self, started: float, payloads: Sequence[np.ndarray]) -> None:
        self.seconds += time.perf_counter() - started
        self.sequence += 1
        self.num_messages += 1
        self.num_payload_words += sum(p.size for p in payloads)

    def failure(self, error: BaseException) -> PeerLost:
        return self.cluster.failure(error)

    def stats(self) -> dict[str, float]:
        return {"messages": self.num_messages, "runs": self.num_runs, "seconds": self.seconds,
                "payload_bytes": 4 * self.num_payload_words}


def check_mesh(mesh_config) -> None:
    """A job's mesh covers every device of every process: a process with no device in the mesh
    could not run its share of the steps."""
    if mesh_config.num_devices != jax.device_count():
        raise ValueError(
            f"mesh {mesh_config} has {mesh_config.num_devices} devices, but the job has "
            f"{jax.device_count()} ({jax.process_count()} processes with "
            f"{jax.local_device_count()} each): a multi-process mesh must use them all")


def follow(runner, stream: PlanStream) -> tuple[wire.Header, list[np.ndarray]]:
    """Runs process 0's RUN messages on this process's devices until another command (not NOOP)
    arrives; returns it. `runner` is this process's `ModelRunner` or `PipelineRunner`, built
    exactly as process 0 built its own."""
    templates: dict[tuple[int, ...], tuple[list, Any]] = {}

    def template(key):
        if key not in templates:
            templates[key] = jax.tree.flatten(runner.template(key))
        return templates[key]

    def sizes(header: wire.Header) -> list[int]:
        if header.command != wire.RUN:
            return [header.payload_words] if header.payload_words else []
        return [_payload_words(template(key)[0]) for key in _keys(header.words)]

    while True:
        header, payloads = stream.receive(sizes)
        if header.command == wire.NOOP:
            continue
        if header.command != wire.RUN:
            return header, payloads
        keys = _keys(header.words)
        arrays = []
        for key, payload in zip(keys, payloads):
            flat, treedef = template(key)
            arrays.append(jax.tree.unflatten(treedef, wire.unpack(payload, flat)))
        runner.run_calls(keys, arrays)


def payload_sizes(runner, keys: Sequence[tuple[int, ...]]) -> list[int]:
    """The padded payload size of a call with each bucket key (for `PlanStream.warmup`)."""
    return [_payload_words(jax.tree.leaves(runner.template(k))) for k in keys]


def _payload_words(leaves: Sequence[np.ndarray]) -> int:
    """The size `wire.pack` gives a payload of `leaves`."""
    return wire.payload_bucket(sum(leaf.size for leaf in leaves))


def follow_or_exit(runner, cluster: Cluster) -> tuple[wire.Header, list[np.ndarray]]:
    """`follow`, ending this process (status 1, with a message) if it fails: naming the lost
    peer when one stopped beating, else recording this process's own failure for the others."""
    try:
        return follow(runner, cluster.stream)
    except Exception as err:  # noqa: BLE001 - a follower that cannot follow must go
        lost = cluster.find_lost(wait=2 * STALE_AFTER_ERROR)
        if lost is not None:
            _exit(f"meshserve: error: {lost}")
        cluster.abandon(f"{type(err).__name__}: {_first_line(err)}")
        raise  # not reached: abandon exits


def _key_words(keys: Sequence[tuple[int, ...]]) -> list[int]:
    """[number of keys, key length, key 0..., key 1...]; every key of a call has one length."""
    width = len(keys[0]) if keys else 0
    assert all(len(k) == width for k in keys)
    return [len(keys), width, *(v for k in keys for v in k)]


def _keys(words: Sequence[int]) -> list[tuple[int, ...]]:
    count, width = words[0], words[1]
    body = words[2:2 + count * width]
    return [tuple(body[i * width:(i + 1) * width]) for i in range(count)]


def _broadcast(words: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(words))


def _kv_client():
    """The coordination service's key-value client (JAX keeps it on its distributed state)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _exit(message: str | None) -> None:
    """Ends the process now with status 1, skipping interpreter teardown (see above)."""
    if message:
        print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
