"""A step as two calls: its forward pass, then its sampling (`ModelRunner.forward`, `.sample`).

A step whose structured-output masks are still to be computed runs this way, and the engine
computes them in between (`meshserve.serving.engine.core`): the forward pass
(`steps.ragged_forward`) is dispatched and returns at once (JAX dispatch is asynchronous), the
logits of each sequence's last token [S, V] staying on the device; then the sampler
(`sampler.sample`) runs on them, with the masks, as a program of its own. The two compute what
the one-call step (`steps.ragged_step`) computes.

`SplitPrograms` is the compiled set this adds to a runner's: a forward pass per bucket key and a
sampler per number of sequence slots, compiled (or loaded from the persistent compilation cache)
on first use or at warm-up. The sampler reads the logits split by rows only, so on a mesh that
splits the vocabulary the forward pass gathers them whole. `ReadyTimes` notes, off the caller's
thread, when each forward pass finished: the engine's account of how much of the host's mask
time the device hid.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import queue
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshserve.batching.sampling import SamplingArrays
from meshserve.model import native_dot
from meshserve.model.attention import KVCache, RaggedBatch
from meshserve.model.executor.device_layout import DeviceLayout, jit_rows, jit_step
from meshserve.model.executor.sampler import sample
from meshserve.model.executor.steps import RaggedOutput, ragged_forward


@dataclasses.dataclass(frozen=True)
class Forward:
    """A dispatched forward pass: its outputs stay on the device until the sampling."""

    out: RaggedOutput  # device: `logits`, and the prompt logprobs when the step has targets
    bucket: tuple[int, int]  # (token slots per replica, has targets)
    seq_index: tuple[np.ndarray, ...]  # per sub-batch [B]: each row's sequence slot
    token_index: tuple[np.ndarray, ...]  # per sub-batch [B, W]: each row's token slots
    finished_at: concurrent.futures.Future  # `time.perf_counter()` once the device finished it


class ReadyTimes:
    """When device arrays become ready, noted off the caller's thread: one daemon thread blocks
    on each watched array in turn and sets its future to `time.perf_counter()`, so the caller
    never waits for the device to learn it."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def watch(self, array: jax.Array) -> concurrent.futures.Future:
        done: concurrent.futures.Future = concurrent.futures.Future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="meshserve-ready-times",
                                            daemon=True)
            self._thread.start()
        self._queue.put((array, done))
        return done

    def _run(self) -> None:
        while True:
            array, done = self._queue.get()
            try:
                array.block_until_ready()
            except Exception:  # noqa: BLE001 - the step that reads the array reports it
                pass
            done.set_result(time.perf_counter())


class SplitPrograms:
    """One runner's forward passes (by bucket key) and samplers (by sequence slots, all
    replicas together), jitted over its layout as its one-call step is."""

    def __init__(self, graphdef: nnx.GraphDef, layout: DeviceLayout | None, *,
                 num_top_logprobs: int, attention: str, block_pages: int, vocab_size: int,
                 native_kernels: bool):
        self.layout = layout
        forward = functools.partial(
            ragged_forward, graphdef, num_top_logprobs=num_top_logprobs, attention=attention,
            block_pages=block_pages, constrain=None if layout is None else layout.constrain)
        self._forward = jit_step(forward, layout, num_row_args=1)
        self._sample = jit_rows(functools.partial(
            sample, num_top_logprobs=num_top_logprobs,
            replica_axes=() if layout is None else layout.replica_axes), layout, num_row_args=2)
        self.vocab_size, self.native_kernels = vocab_size, native_kernels
        self._forwards: dict[tuple[int, int], jax.stages.Compiled] = {}
        self._samplers: dict[int, jax.stages.Compiled] = {}
        self.ready_times = ReadyTimes()

    def forward_program(self, bucket: tuple[int, int], params: nnx.State, cache: KVCache,
                        batch: RaggedBatch) -> jax.stages.Compiled:
        """The forward pass of `bucket` (token slots per replica, has targets), compiled on
        first use for arguments shaped as these (`batch` on the devices)."""
        if bucket not in self._forwards:
            with native_dot.enabled(self.native_kernels):
                self._forwards[bucket] = self._forward.lower(params, cache, batch).compile()
        return self._forwards[bucket]

    def sampler_program(self, sampling: SamplingArrays) -> jax.stages.Compiled:
        """The sampler of steps whose sampling arrays are shaped as `sampling`'s (on the
        devices, every replica's sequence slots), compiled on first use."""
        rows = sampling.temperature.shape[0]
        if rows not in self._samplers:
            logits = jax.ShapeDtypeStruct(  # [S, V], as `ragged_forward` leaves them
                (rows, self.vocab_size), jnp.float32,
                sharding=None if self.layout is None else self.layout.rows)
            self._samplers[rows] = self._sample.lower(logits, sampling).compile()
        return self._samplers[rows]
