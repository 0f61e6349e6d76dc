"""The engine: one loop that joins the scheduler (host) and the model runner (device).

    step():  plan = scheduler.schedule()      # host: what runs
             results = runner.execute(plan)   # device: one step, one copy back
             return self._update(plan, results)  # host: tokens, text, stops, outputs

A step with structured output overlaps its masks with the device (`_run_overlapped`): the
constrained requests' matchers take the last step's tokens in `_update`, but their next masks
are left due (`Scheduler.defers_masks`); the next step's forward pass is dispatched first
(`runner.forward`: it needs the tokens, not the masks), the masks are computed on the host
while the device runs it (`Scheduler.fill_due_masks`, one parallel fill), and then the
sampling runs with them (`runner.sample`). A step with no constrained row, or none whose mask is
due, runs as one call as above. The runner must split steps (`splits_sampling`: a
`ModelRunner` with `overlap_masks`, in one process); otherwise, and on a pipeline, every mask is
computed in `_update`, before the next plan, as the step's one call needs.
`EngineStats` counts how much of the mask time the forward pass hid (`overlap_*`).

A request comes in through the engine's admission check (`self.admission`,
`meshserve.serving.engine.admission`): `add_request` checks and queues it; a front end that
checked it on its own thread (`Admission.admit`) queues the `Admitted` request with `enqueue`,
which checks nothing again. A request with structured output (`SamplingParams.structured`) comes
with a matcher of its own (`Request.constraint`, its constraint compiled once per distinct
constraint by the admission's `GrammarCompiler`), which the scheduler advances with each sampled
token and whose mask each plan carries to the device sampler; a step's constrained requests have
their next masks computed together (`grammar.fill_masks`, the library's parallel fill).

With `enable_lora` a request may run with a LoRA adapter (`lora_request`): the registry reads
and checks it at the door (`serving/engine/adapter_registry.py`), the scheduler gives it a
device slot on admission, and the step first writes the adapters newly given slots into the
runner's slabs (`StepPlan.adapter_loads`); each token of the step then carries its adapter's
slot. A pipeline call writes the loads of all its rounds before it runs, and holds back every
slot released while its rounds are planned until its results are back
(`AdapterSlots.releases_held`), so no round's load rewrites a slot an earlier round reads.

With a `speculative_config` the engine speculates (`batching/speculative.py`): between schedule
and execute the `Speculator` adds drafted tokens to the plan as extra rows, and the step's
results are applied as rounds of one token per request, each an ordinary update, so every stop,
the prefix cache and preemption see only accepted tokens.

The scheduler owns each request's tokens, pages, token-level stops and preemption; a `Stream`
(`serving/engine/streams.py`) owns what the caller sees of it: text, stop strings and logprobs. The
engine applies a stream's stop-string cut through the scheduler. `EngineConfig`
(`meshserve.serving.engine.engine_config`) holds every knob once and derives the `RunnerConfig` and
the `SchedulerConfig` from them.

Not thread-safe: one thread owns an Engine (the gRPC server's engine loop, or `LLM`); only its
`admission` may be called from other threads.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from typing import Sequence

import numpy as np

from meshserve.batching.adapters import LoRARequest
from meshserve.batching.pipeline_schedule import PLACEHOLDER, PipelineSchedule, build_schedule
from meshserve.batching.plan import StepPlan
from meshserve.batching.request import Request, constrained_stop, stop_status_at
from meshserve.batching.sampling import SamplingParams
from meshserve.batching.scheduler import Scheduler, takes_token
from meshserve.batching.speculative import Speculation
from meshserve.batching.structured import BOUNDS
from meshserve.model.loading.hub import cache_root
from meshserve.batching.runner_protocol import Runner, SampledRows, SplitRunner, StepRunner
from meshserve.model.executor.runner import CompileCounter, ModelRunner, enable_compilation_cache
from meshserve.model.executor.pipeline_runner import PipelineRunner
from meshserve.model.quantized_weights import quantize_model
from meshserve.model.tokenizer import Tokenizer
from meshserve.model.transformer import for_context
from meshserve.serving.engine.adapter_registry import AdapterRegistry
from meshserve.serving.engine.admission import Admission, AdmissionError, Admitted, Prompt
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.grammar import fill_masks
from meshserve.serving.engine.multihost import payload_sizes
from meshserve.serving.engine.speculation import make_speculator
from meshserve.serving.engine.outputs import RequestOutput
from meshserve.serving.engine.streams import Stream
from meshserve.sharding.layout import prepare
from meshserve.sharding.pipeline_stages import stage_layout, unpadded_config


class Engine:
    def __init__(self, runner: Runner, tokenizer: Tokenizer | None,
                 config: EngineConfig = EngineConfig(), *, model=None):
        """An engine over `runner`: a `ModelRunner`, a `PipelineRunner` when the mesh has
        stages, or any runner that keeps the contract of `meshserve.batching.runner_protocol` (the tests'
        arithmetic `FakeRunner`). `from_model` builds the runner for a model. `model` is kept as
        `self.model` for the tools that build more runners of it (bench, roofline)."""
        self.config = config = config.for_model(runner.model_config)
        self.tokenizer = tokenizer
        self.is_pipelined = config.mesh_config.stage > 1
        self.model, self.model_config, self.runner = model, runner.model_config, runner
        eos = (tokenizer.eos_token_ids if tokenizer is not None
               else runner.model_config.eos_token_ids)
        self.scheduler = Scheduler(
            config.scheduler_config(eos, num_replicas=runner.num_replicas,
                                    attention_window=runner.model_config.attention_window),
            predictor=config.make_length_predictor(), fill_masks=fill_masks,
            defers_masks=runner.splits_sampling and not self.is_pipelined)
        self.admission = Admission(
            tokenizer=tokenizer, vocab_size=self.model_config.vocab_size,
            max_model_len=config.max_model_len, max_logprobs=config.max_logprobs,
            max_stop_ids=runner.config.max_stop_ids,
            eos_token_ids=self.scheduler.config.eos_token_ids,
            page_size=self.scheduler.config.page_size,
            cache_pages=self.scheduler.allocators[0].num_total,
            json_bounds={name: getattr(config, f"structured_{name}") for name in BOUNDS})
        self._streams: dict[str, Stream] = {}
        self._ids = itertools.count()
        # Speculative decoding (`batching/speculative.py`): drafts as extra rows of the step.
        self.speculator = make_speculator(config, runner)
        # LoRA adapters (`serving/engine/adapter_registry.py`): read at the door, loaded into the
        # runner's slots as the scheduler gives them out.
        if config.enable_lora and getattr(runner, "lora", None) is None:
            raise ValueError("enable_lora needs a runner with LoRA slabs (Engine.from_model "
                             "builds one)")
        self.adapters = None if not config.enable_lora else AdapterRegistry(
            self._adapter_model_config(), max_rank=config.max_lora_rank,
            max_cpu_loras=config.max_cpu_loras, in_use=self._adapters_in_use,
            head_multiple=config.mesh_config.model)
        self.stats = EngineStats()
        if config.compilation_cache:
            enable_compilation_cache(cache_root(None) / "xla")
        if config.warmup:
            self.warmup()

    @classmethod
    def from_model(cls, model, tokenizer: Tokenizer | None,
                   config: EngineConfig = EngineConfig(), *,
                   runner: ModelRunner | PipelineRunner | None = None) -> Engine:
        """An engine for `model`, placed on `config.mesh` (heads padded when the model axis
        needs it), its float kernels quantized in place by `config.quantization`.

        `runner` lets engines of the same shapes share one set of compiled programs (XLA:CPU
        runs out of memory maps after a few hundred loaded executables); it must come from an
        engine with the same model, mesh and runner config.
        """
        settled = config.for_model(model.config)
        # An attention backend the model cannot run is refused before any weight moves.
        settled.runner_config().backend(model.config)
        model = for_context(model, settled.max_model_len)  # LongRoPE's factors
        model = quantize_model(model, settled.quantization)  # kernels loaded quantized stay
        if runner is None:
            prepared = prepare(model, settled.mesh_config, lora=settled.lora_shape())
            stages = stage_layout(model.config.num_layers, settled.mesh_config.stage)
            runner = (PipelineRunner(prepared.model, settled.runner_config(), prepared.layout,
                                     settled.unit_shape(), layer_index=stages.layer_index())
                      if settled.mesh_config.stage > 1
                      else ModelRunner(prepared.model, settled.runner_config(), prepared.layout))
            model = prepared.model
        elif runner.config != settled.runner_config() or runner.model_config != model.config:
            raise ValueError("a shared runner must have this engine's model and runner config")
        return cls(runner, tokenizer, config, model=model)

    def warmup(self, *, progress: bool = True) -> None:
        """Compiles every bucket, the prompt-logprobs variants only with
        `warmup_prompt_logprobs` (else each on first use). In a multi-process job every process
        runs its own warm-up of every variant, at the same point and in the same order (the
        plan stream stays out of it), and then the broadcast of every plan size the buckets can
        send."""
        channel, self.runner.channel = self.runner.channel, None
        prompt_logprobs = self.config.warmup_prompt_logprobs or channel is not None
        started = time.perf_counter()
        try:
            with CompileCounter() as compiles:
                keys = self.runner.warmup(progress=progress, prompt_logprobs=prompt_logprobs)
                if self.speculator is not None:  # a draft model's own programs
                    self.speculator.warmup(progress=progress)
                if channel is not None:
                    channel.warmup(payload_sizes(self.runner, keys))
        finally:
            self.runner.channel = channel
        self.stats.warmup_compiles += compiles.count
        self.stats.warmup_seconds += time.perf_counter() - started
        if progress:
            print(f"meshserve: compiled {compiles.count} programs in "
                  f"{self.stats.warmup_seconds:.1f} s ({compiles.num_cache_hits} from the "
                  f"compilation cache)", file=sys.stderr, flush=True)

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> str:
        """Checks a request (`self.admission`) and queues it; raises `AdmissionError` (a
        ValueError), naming the field and what to change, if it can never run. `lora_request`
        runs it with that LoRA adapter (the engine needs `enable_lora`)."""
        if request_id is None:
            request_id = str(next(self._ids))
        admitted = self.admission.admit(Prompt.of(prompt), params or SamplingParams(),
                                        request_id=request_id)
        return self.enqueue(admitted, priority=priority, lora_request=lora_request)

    def enqueue(self, admitted: Admitted, *, priority: int = 0,
                lora_request: LoRARequest | None = None) -> str:
        """Queues a request the admission check passed, checking nothing again but its LoRA
        adapter (`lora_request`, else `admitted.lora_request`: read and checked on first use,
        `AdapterRegistry.resolve`); a request id already in use is a ValueError."""
        request_id = admitted.request_id
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        adapter_id = self._adapter_id(lora_request or admitted.lora_request)
        request = Request(request_id=request_id, prompt_token_ids=admitted.prompt_ids,
                          params=admitted.params, priority=priority, adapter_id=adapter_id)
        request.constraint = admitted.constraint
        self.scheduler.add(request)  # its fit check is an invariant here: admission checked it
        self._streams[request_id] = Stream.open(request, admitted.prompt_text, self.tokenizer)
        return request_id

    def _adapter_id(self, lora_request: LoRARequest | None) -> int:
        """The adapter id a request runs with (0: the base model)."""
        if lora_request is None:
            return 0
        if self.adapters is None:
            raise AdmissionError("lora_request", "this engine serves no LoRA adapters; start it "
                                                 "with enable_lora=True")
        if self.runner.channel is not None:  # the other processes would not load it
            raise AdmissionError("lora_request", "a multi-process engine serves no LoRA "
                                                 "adapters yet")
        try:
            return self.adapters.resolve(lora_request)
        except ValueError as err:
            raise AdmissionError("lora_request", str(err)) from err

    def _adapters_in_use(self) -> set[int]:
        return {stream.request.adapter_id for stream in self._streams.values()}

    def _adapter_model_config(self):
        """The config adapters are read against: the served model's, less the identity layers
        that pad pipeline stages (an adapter has the model's own layers; the runner lays them
        out over the stages)."""
        if not self.is_pipelined:
            return self.model_config
        return unpadded_config(self.model_config, self.runner.layer_index)

    def _load_adapters(self, loads: Sequence[tuple[int, int]]) -> None:
        """Writes the adapters the scheduler gave slots to (`StepPlan.adapter_loads`) into the
        runner's slabs, before the step that first reads them; a compile here would count as
        one after warm-up."""
        assert len({slot for slot, _ in loads}) == len(loads), "a slot is loaded once a call"
        with CompileCounter() as compiles:
            for slot, adapter_id in loads:
                self.runner.load_adapter(slot, self.adapters.weights(adapter_id).weights)
        self.stats.compiles_after_warmup += compiles.count
        self.stats.num_adapter_loads += len(loads)

    def step(self) -> list[RequestOutput]:
        """Runs one step (one pipeline call, of up to `pipeline_rounds` steps, when the mesh has
        stages); returns an output for every request that advanced or finished."""
        self._claim_runner()
        if self.is_pipelined:
            return self._pipeline_step()
        plan = self.scheduler.schedule()
        if plan.adapter_loads:
            self._load_adapters(plan.adapter_loads)
        overlaps = self.scheduler.has_due_masks and _has_constrained(plan)
        ended = [] if overlaps else self._fill_due_masks()  # of rows this plan does not sample
        if plan.is_empty:
            return ended
        speculation = None if overlaps else self._speculate(plan)
        if speculation is not None:
            plan = speculation.plan
        started = time.perf_counter()
        with CompileCounter() as compiles:
            if overlaps:
                masked, results = self._run_overlapped(plan)
                ended += masked
            else:
                results = self.runner.execute(plan)
        self.stats.record_step(plan, self.runner, time.perf_counter() - started, compiles.count)
        self.stats.device_wait_seconds += self.runner.last_wait_seconds
        if speculation is not None:
            return ended + self._update_verified(speculation, results)
        return ended + self._update(plan, results)

    def _run_overlapped(self, plan: StepPlan
                        ) -> tuple[list[RequestOutput], list[SampledRows]]:
        """Runs `plan` as its forward pass, then its sampling, computing the due masks in
        between (see the module docstring). Returns the outputs of the requests their masks
        ended (their rows' results are dropped), and the step's results."""
        runner: SplitRunner = self.runner
        forward = runner.forward(plan.sub_batches)
        began = time.perf_counter()
        ended = self._fill_due_masks()
        ready = time.perf_counter()
        results = runner.sample(forward, self.scheduler.masked(plan).sampling)
        self.stats.record_overlap(began, ready, runner.finished_at(forward))
        return ended, results

    def _fill_due_masks(self) -> list[RequestOutput]:
        """Computes the masks the last step left due; the outputs of the requests they end."""
        return [self._output(self._streams[request.request_id])
                for request in self.scheduler.fill_due_masks()
                if request.request_id in self._streams]

    # -- speculative decoding -------------------------------------------------------------------

    def _speculate(self, plan: StepPlan) -> Speculation | None:
        """The plan with drafts as extra rows, when the engine speculates and the step can take
        some (`Speculator.expand`); else None."""
        if self.speculator is None:
            return None
        return self.speculator.expand(plan, self.scheduler)

    def _update_verified(self, speculation: Speculation,
                         results: list[SampledRows]) -> list[RequestOutput]:
        """Applies a step with drafts round by round (`Speculation.rounds`): each round is an
        ordinary update of one token per request, so stops cut the accepted runs; then the
        pages of rejected drafts go back (`Speculator.settle`). One output per request, its
        last."""
        tokens = [rows.tokens for rows in results]
        outputs: dict[str, RequestOutput] = {}
        for round_plan in speculation.rounds(tokens):
            outputs.update((out.request_id, out) for out in self._update(round_plan, results))
        self.speculator.settle(speculation, tokens, self.scheduler)
        return list(outputs.values())

    def _claim_runner(self) -> None:
        """Engines that share a runner share its KV cache, one engine at a time: when another
        engine has run since this one did, the pages this one's prefix cache points at hold the
        other's tokens, so that cache is dropped; so is what its LoRA slots held."""
        last = self.runner.last_user
        if last is not None and last is not self:
            if self.scheduler.num_running:
                raise RuntimeError("another engine ran on this engine's shared runner while it "
                                   "had requests running: their KV pages were overwritten")
            self.scheduler.forget_prefixes()
            self.scheduler.adapter_slots.forget()
        self.runner.last_user = self

    def abort(self, request_id: str) -> bool:
        """Frees the request's pages at once. False if it is unknown or already finished."""
        is_aborted = self.scheduler.abort(request_id)
        self._streams.pop(request_id, None)
        return is_aborted

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def shutdown(self) -> None:
        """Aborts everything still queued or running; the engine is empty afterwards."""
        for request_id in list(self._streams):
            self.abort(request_id)

    # -- pipeline parallelism -------------------------------------------------------------------

    def _pipeline_step(self) -> list[RequestOutput]:
        """Plans up to `pipeline_rounds` steps ahead, runs them as one pipeline call, then puts
        the sampled tokens where the plans left placeholders (`_resolve`).

        The scheduler plans round k + 1 before round k's tokens exist: its outputs are
        PLACEHOLDERs, which the device fills by feedback. Planning stops early after a
        preemption (a recomputed prompt must not contain placeholders) and after any round
        with a penalty (penalties read every earlier token). A constrained request takes one
        token a call: once a round samples it, the later rounds leave it out
        (`Request.awaits_output`), since its next mask needs that token, while the other rows
        go on for every round.

        LoRA adapters: every round's loads are written before the call, and a slot that a
        request lets go of while the rounds are planned stays pinned until the call's results
        are back (`AdapterSlots.releases_held`), so a later round never loads another adapter
        into a slot an earlier round of the call reads.
        """
        with self.scheduler.adapter_slots.releases_held():
            plans = self._plan_rounds()
            if not plans:
                return []
            schedule = build_schedule(plans, self.runner.shape,
                                      bubble_filling=self.config.bubble_filling)
            loads = [load for plan in plans for load in plan.adapter_loads]
            if loads:
                self._load_adapters(loads)
            started = time.perf_counter()
            with CompileCounter() as compiles:
                results = self.runner.execute(schedule)
        self.stats.record_pipeline(schedule, time.perf_counter() - started, compiles.count)
        self.stats.device_wait_seconds += self.runner.last_wait_seconds
        return self._resolve(plans, results)

    def _plan_rounds(self) -> list[StepPlan]:
        """Up to `pipeline_rounds` plans, each applied with placeholder outputs, as long as the
        call has units for another round (see `_pipeline_step`)."""
        plans, shape = [], self.runner.shape
        while len(plans) < self.config.pipeline_rounds:
            preemptions = self.scheduler.num_preemptions
            plan = self.scheduler.schedule()
            if plan.is_empty:
                break
            plans.append(plan)
            self.scheduler.update(plan, [np.full(b.num_rows, PLACEHOLDER, np.int32)
                                         for b in plan.sub_batches])
            laid_out = build_schedule(plans, shape, bubble_filling=self.config.bubble_filling)
            if (self.scheduler.num_preemptions != preemptions or _has_penalty(plan)
                    or laid_out.num_units + self.config.units_per_round() > shape.num_units):
                break
        return plans

    def _resolve(self, plans: Sequence[StepPlan], results) -> list[RequestOutput]:
        """Fills each placeholder output with its sampled token, round by round; a token that
        stops its request (EOS, a stop id) cuts off what the later rounds generated. The
        constrained requests' matchers take their tokens together at the end (one mask fill):
        each sampled once in the call (`Request.awaits_output`), so no later round is cut."""
        touched: dict[str, Stream] = {}
        pending = []
        eos = self.scheduler.config.eos_token_ids
        for plan, batches in zip(plans, results):
            for row in plan.real_rows():
                stream = self._streams.get(row.request_id)
                if stream is None:
                    continue
                rows, request = batches[row.batch], stream.request
                stream.record_prompt_logprobs(rows, row.row, plan.sub_batches[row.batch])
                if not row.is_sampled:
                    continue
                index = int(plan.sampling[row.batch].steps[row.row])
                if index >= len(request.output_token_ids):
                    continue  # generated after a stop: discarded
                token = int(rows.tokens[row.row])
                self.scheduler.set_output(request, index, token)
                stream.record_token(rows, row.row)
                touched.setdefault(row.request_id, stream)
                stop = stop_status_at(request, index, eos)
                if takes_token(request, token, stop):
                    pending.append((request, index, token, stop))
                elif stop is not None:
                    self.scheduler.end_at(request, index + 1, *stop)
        assert len({id(r) for r, *_ in pending}) == len(pending), "one token a call each"
        ends = self.scheduler.advance_constraints([(r, token) for r, _, token, _ in pending])
        for (request, index, _, stop), end in zip(pending, ends):
            stop = constrained_stop(request, stop, end)
            if stop is not None:
                self.scheduler.end_at(request, index + 1, *stop)
        return [self._output(stream) for stream in touched.values()]

    def _output(self, stream: Stream) -> RequestOutput:
        cut = stream.advance()
        if cut is not None:
            self.scheduler.end_at(stream.request, cut.num_outputs, "stop", cut.stop)
        if stream.request.is_finished:
            self._streams.pop(stream.request.request_id, None)
        return stream.output()

    def _update(self, plan: StepPlan, results: list[SampledRows]) -> list[RequestOutput]:
        for row in plan.real_rows():
            stream = self._streams.get(row.request_id)
            if stream is None:
                continue  # aborted during the step
            rows = results[row.batch]
            stream.record_prompt_logprobs(rows, row.row, plan.sub_batches[row.batch])
            if row.is_sampled:
                stream.record_token(rows, row.row)
        touched = self.scheduler.update(plan, [rows.tokens for rows in results])
        return [self._output(self._streams[req.request_id]) for req in touched
                if req.request_id in self._streams]


@dataclasses.dataclass
class EngineStats:
    """Counters of what the engine computed, for benchmarks and metrics."""

    num_steps: int = 0
    warmup_compiles: int = 0  # programs compiled (or loaded from the cache) at warm-up
    warmup_seconds: float = 0.0
    compiles_after_warmup: int = 0
    num_adapter_loads: int = 0  # LoRA adapters written into device slots
    step_seconds: float = 0.0  # in `runner.execute`, host preparation included
    device_wait_seconds: float = 0.0  # of which waiting for the device once all was dispatched
    prefill_tokens: int = 0
    prefill_slots: int = 0  # padded token slots computed for prefill
    decode_tokens: int = 0
    decode_slots: int = 0
    stage_busy_slots: int = 0  # pipeline (tick, stage, replica) slots that ran a real row
    stage_slots: int = 0  # all pipeline slots, idle ones included
    # Steps whose masks were computed while their forward pass ran (`_run_overlapped`): the
    # host's mask time there, the part of it the device was still running the forward pass
    # (hidden; the rest the device sat idle, waiting for the masks), and the forward pass's
    # time left once the masks were ready (the host then only waited).
    overlap_steps: int = 0
    overlap_mask_seconds: float = 0.0
    overlap_hidden_seconds: float = 0.0
    overlap_forward_left_seconds: float = 0.0

    def record_step(self, plan: StepPlan, runner: StepRunner, seconds: float,
                    compiles: int) -> None:
        self.num_steps += 1
        self.step_seconds += seconds
        self.compiles_after_warmup += compiles
        # Decodes take one slot each. A step's padding (its token bucket less its tokens)
        # counts as prefill padding when the step has any prefill, else as decode padding.
        is_decode = [b.tokens.shape[1] == 1 for b in plan.sub_batches]
        decode = sum(b.num_tokens for b, d in zip(plan.sub_batches, is_decode) if d)
        slots = runner.padded_tokens(plan.sub_batches)
        self.decode_tokens += decode
        self.prefill_tokens += plan.num_tokens - decode
        if all(is_decode):
            self.decode_slots += slots
        else:
            self.decode_slots += decode
            self.prefill_slots += slots - decode

    def record_overlap(self, began: float, ready: float, finished: float | None) -> None:
        """An overlapped step: its masks computed from `began` to `ready`, its forward pass
        done at `finished` (`time.perf_counter()`; None: unknown, nothing counts as hidden)."""
        self.overlap_steps += 1
        self.overlap_mask_seconds += ready - began
        if finished is not None:
            self.overlap_hidden_seconds += max(0.0, min(ready, finished) - began)
            self.overlap_forward_left_seconds += max(0.0, finished - ready)

    def record_pipeline(self, schedule: PipelineSchedule, seconds: float, compiles: int) -> None:
        """A pipeline call: its rounds count as steps; its units' slots as padding."""
        shape = schedule.shape
        self.num_steps += len(schedule.plans)
        self.step_seconds += seconds
        self.compiles_after_warmup += compiles
        self.decode_tokens += int(schedule.decode.num_new.sum())
        self.decode_slots += schedule.decode.busy_units() * shape.decode_rows
        self.prefill_tokens += int(schedule.prefill.num_new.sum())
        self.prefill_slots += schedule.prefill.busy_units() * shape.prefill_tokens
        self.stage_busy_slots += schedule.num_busy * shape.num_stages
        self.stage_slots += schedule.num_ticks * shape.num_stages * shape.num_replicas

    @property
    def stage_utilisation(self) -> float:
        """Busy pipeline stage-slots / all stage-slots; 1.0 without pipeline stages."""
        return self.stage_busy_slots / self.stage_slots if self.stage_slots else 1.0

    @property
    def prefill_padding(self) -> float:
        return 1 - self.prefill_tokens / self.prefill_slots if self.prefill_slots else 0.0

    @property
    def decode_padding(self) -> float:
        return 1 - self.decode_tokens / self.decode_slots if self.decode_slots else 0.0


def _has_constrained(plan: StepPlan) -> bool:
    """Whether some row of `plan` samples under a structured-output mask."""
    return any(np.any(s.is_constrained) for s in plan.sampling)


def _has_penalty(plan: StepPlan) -> bool:
    return any(np.any(s.repetition_penalty != 1) or np.any(s.presence_penalty != 0)
               or np.any(s.frequency_penalty != 0) for s in plan.sampling)
