"""Prometheus metrics of a serving engine, named as vLLM's with the prefix `meshserve:`.

Every metric has a `model_name` label. Counters are exported with prometheus_client's `_total`
suffix (and its `_created` sample).

Histograms (seconds):
    meshserve:time_to_first_token_seconds   arrival -> first output token, one per request
    meshserve:inter_token_latency_seconds   one per output token after the first: the time since
                                            the previous token. When one output brings several
                                            new tokens, the gap since the previous output is split
                                            evenly among them (the engine brings one per step).
    meshserve:e2e_request_latency_seconds   arrival -> finish, one per request the engine finished
                                            ("stop" or "length"; aborts are not timed)
    meshserve:step_duration_seconds         wall time of each engine step that ran
    meshserve:structured_mask_seconds       host time of each engine step (pipeline call) whose
                                            constrained requests took tokens: their matchers
                                            advancing and their next masks computed, all rows'
                                            masks in one parallel fill (its sum over its count
                                            is the mean per such step)
    (vLLM's request_queue_time_seconds is not exported: RequestMetrics does not record when a
    request was first scheduled.)

Gauges, as of the last `observe_step`:
    meshserve:num_requests_running          requests holding a seat (scheduler.num_running)
    meshserve:num_requests_waiting          requests queued, preempted ones included
    meshserve:kv_cache_usage_perc           used KV pages / usable KV pages, a fraction in [0, 1]
    meshserve:kv_cache_cached_pages         pages held by no request that keep a prefix-cache
                                            page (evictable); free + used + cached = usable
    meshserve:kv_cache_fragmentation_ratio  allocated token slots holding no KV / allocated slots
    meshserve:kv_cache_reserved_unused_pages  pages held beyond the requests' current tokens
    meshserve:prefill_padding_ratio         padded prefill token slots / all prefill token slots
                                            computed, over the engine's life
    meshserve:decode_padding_ratio          the same for decode rows
    meshserve:warmup_programs               programs compiled (or loaded from the compilation
                                            cache) at warm-up: the bounded compiled set
    meshserve:warmup_seconds                wall time of that warm-up
    meshserve:stage_utilisation             busy pipeline stage-slots / all stage-slots, over the
                                            engine's life, from the schedules it ran
                                            (`EngineStats.stage_utilisation`); 1.0 on a mesh of
                                            one stage once a step has run (0 before).

Counters:
    meshserve:num_preemptions_total         requests sent back to the queue for want of KV pages
    meshserve:prefix_cache_hits_total       tokens found in the prefix cache on admission, so
                                            not computed
    meshserve:kv_cache_window_freed_pages_total  KV pages given back to the pool because every
                                            layer's sliding window had passed them (models whose
                                            layers all slide: Mistral, Phi-3)
    meshserve:prompt_tokens_total           prompt tokens of each request, counted at its first
                                            output token (recomputation after preemption is not
                                            counted again)
    meshserve:generation_tokens_total       output tokens, counted as they are produced
    meshserve:request_success_total         finished requests, by `finished_reason`: "stop",
                                            "length" (from outputs) or "abort" (observe_aborted)
    meshserve:recompiles_total              programs compiled while serving, after warm-up
                                            (EngineStats.compiles_after_warmup)
    meshserve:requests_rejected_total       requests refused at admission, by `reason`:
                                            queue_full, invalid, unauthenticated, draining, deadline
    meshserve:plan_broadcast_seconds_total  multi-process only: time process 0 spent sending
                                            step plans to the other processes (divide by the
                                            step count of step_duration_seconds for per step)
    meshserve:structured_mask_overlapped_seconds_total  host time of the masks computed while
                                            their step's forward pass was dispatched
                                            (`EngineStats.overlap_mask_seconds`)
    meshserve:structured_mask_hidden_seconds_total  of which the device was still running the
                                            forward pass (the rest, it sat idle for the masks)

Speculative decoding (engines with a `speculative_config`; `batching/speculative.py`), vLLM's
names:
    meshserve:spec_decode_num_drafts_total  verifications: (request, step) pairs with drafts
    meshserve:spec_decode_num_draft_tokens_total     tokens drafted
    meshserve:spec_decode_num_accepted_tokens_total  drafts the verification accepted
    meshserve:spec_decode_num_emitted_tokens_total   outputs of the speculating requests in
                                            those steps (accepted drafts' tokens plus the
                                            correction or bonus, less what a stop cut)
    meshserve:spec_decode_num_accepted_tokens_per_pos_total  by `position` (0 is the first
                                            draft): drafts accepted there
    meshserve:spec_decode_num_draft_tokens_per_pos_total     by `position`: drafts there
    meshserve:spec_decode_num_steps_disabled_total   steps the load rule (disable_by_batch_size)
                                            kept from speculating
    meshserve:spec_decode_draft_acceptance_rate  gauge: accepted / drafted tokens, over the
                                            engine's life
    meshserve:spec_decode_mean_acceptance_length  gauge: tokens per verification, 1 + accepted
                                            drafts / verifications, over the engine's life

LoRA adapters (engines with `enable_lora`; docs/lora.md), exported with or without them:
    meshserve:lora_requests_total           requests queued with an adapter, by `lora_name`
                                            (the adapter's served name); requests of the base
                                            model are not counted here
    meshserve:lora_adapter_loads_total      adapters written into a device slot
                                            (`EngineStats.num_adapter_loads`)
    meshserve:lora_adapter_evictions_total  adapters a load pushed out of their device slot
                                            (`AdapterSlots.num_evictions`)
    meshserve:lora_resident_adapters        gauge: device slots holding an adapter
    meshserve:lora_max_adapters             gauge: device slots (`max_loras`; 0 without LoRA)
    meshserve:lora_cpu_adapters             gauge: adapters kept read in host memory

The engine's cumulative counters (preemptions, compiles) are read in `observe_step`, which adds
what changed since the previous call, so the exported totals equal the engine's over its life.

Threads: `observe_step`, `observe_output`, `observe_aborted` and `observe_adapter_request`
belong to the thread that owns the engine (they keep per-request state without a lock).
`observe_rejected`, `render` and the HTTP endpoint may run on any thread.
"""

from __future__ import annotations

import dataclasses

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from meshserve.serving.engine.outputs import RequestOutput

PREFIX = "meshserve:"
FINISHED_REASONS = ("stop", "length", "abort", "unsatisfiable")
REJECTED_REASONS = ("queue_full", "invalid", "unauthenticated", "draining", "deadline")

# vLLM's boundaries for TTFT and end-to-end latency.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vLLM's, with 1 to 5 ms added below: a decode step on one accelerator is often under 10 ms.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Matchers and masks of a step's constrained rows: tens of microseconds a row on the host.
MASK_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                0.025, 0.05, 0.1, 0.25, 1.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25,
                0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclasses.dataclass
class _Seen:
    """What has been counted of one unfinished request."""

    num_tokens: int  # output tokens counted so far
    last_token_time: float  # time.monotonic() of the last of them


class ServerMetrics:
    def __init__(self, model_name: str,
                 registry: prometheus_client.CollectorRegistry | None = None):
        """Registers every metric on `registry`; None makes a fresh one (never the global
        default, so that several servers, or tests, coexist in one process)."""
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ("model_name",)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, registry=self.registry,
                             buckets=buckets).labels(model_name)

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first output token.",
            TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Time from arrival to finish of finished requests.",
            E2E_BUCKETS)
        self.step_duration = histogram(
            "step_duration_seconds", "Wall time of one engine step.", STEP_BUCKETS)
        self.structured_mask = histogram(
            "structured_mask_seconds", "Host time of one step's structured-output matchers and "
            "masks, on steps with constrained rows.", MASK_BUCKETS)

        self.num_requests_running = gauge("num_requests_running", "Requests holding a seat.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests queued.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc",
                                    "KV-cache usage: used pages / usable pages (1 is full).")
        self.kv_cache_cached_pages = gauge(
            "kv_cache_cached_pages", "Evictable pages kept for the prefix cache.")
        self.kv_cache_fragmentation = gauge(
            "kv_cache_fragmentation_ratio", "Allocated token slots holding no KV / allocated.")
        self.kv_cache_reserved_unused = gauge(
            "kv_cache_reserved_unused_pages", "Pages held beyond the requests' current tokens.")
        self.prefill_padding_ratio = gauge(
            "prefill_padding_ratio", "Padded share of the prefill token slots computed.")
        self.decode_padding_ratio = gauge(
            "decode_padding_ratio", "Padded share of the decode rows computed.")
        self.stage_utilisation = gauge(
            "stage_utilisation", "Busy pipeline stage-slots / all stage-slots.")
        self.warmup_programs = gauge("warmup_programs", "Programs compiled at warm-up.")
        self.warmup_seconds = gauge("warmup_seconds", "Wall time of the warm-up.")

        self.num_preemptions = counter("num_preemptions", "Requests preempted for KV pages.")
        self.prefix_cache_hits = counter("prefix_cache_hits",
                                         "Tokens found in the prefix cache, not computed.")
        self.window_freed_pages = counter(
            "kv_cache_window_freed_pages", "KV pages freed behind every layer's sliding window.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started.")
        self.generation_tokens = counter("generation_tokens", "Output tokens produced.")
        self.recompiles = counter("recompiles", "Programs compiled after warm-up.")
        self.plan_broadcast_seconds = counter(
            "plan_broadcast_seconds", "Seconds spent broadcasting step plans to other processes.")
        self.structured_mask_overlapped = counter(
            "structured_mask_overlapped_seconds",
            "Host time of structured-output masks computed while their step's forward pass "
            "was dispatched.")
        self.structured_mask_hidden = counter(
            "structured_mask_hidden_seconds",
            "Of the overlapped mask time, the part during which the device ran the forward "
            "pass.")
        success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                          labels + ("finished_reason",), registry=self.registry)
        self.request_success = {reason: success.labels(model_name, reason)
                                for reason in FINISHED_REASONS}
        rejected = Counter(PREFIX + "requests_rejected", "Requests refused at admission.",
                           labels + ("reason",), registry=self.registry)
        self.requests_rejected = {reason: rejected.labels(model_name, reason)
                                  for reason in REJECTED_REASONS}

        self._requests: dict[str, _Seen] = {}  # unfinished requests seen in an output
        self._num_steps = 0  # engine counters as of the previous observe_step
        self._num_preemptions = 0
        self._num_cached_tokens = 0
        self._num_window_freed = 0
        self._compiles = 0
        self._broadcast_seconds = 0.0
        self._overlapped_seconds = 0.0
        self._hidden_seconds = 0.0
        self._constraint_seconds = 0.0
        self._constraint_batches = 0
        self._http: tuple | None = None  # (server, thread) of start_http_server
        self._add_speculative(labels)
        self._add_lora(labels)

    def _add_speculative(self, labels: tuple[str, ...]) -> None:
        """The speculative decoding counters and gauges (exported with or without it)."""
        def counter(name, doc):
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(
                self.model_name)

        self.spec_counters = {
            "num_drafts": counter("spec_decode_num_drafts", "Verifications (request, step)."),
            "num_draft_tokens": counter("spec_decode_num_draft_tokens", "Tokens drafted."),
            "num_accepted_tokens": counter("spec_decode_num_accepted_tokens",
                                           "Drafted tokens accepted."),
            "num_emitted_tokens": counter("spec_decode_num_emitted_tokens",
                                          "Tokens emitted by speculating requests."),
            "num_steps_off": counter("spec_decode_num_steps_disabled",
                                     "Steps the load rule kept from speculating."),
        }
        self.spec_per_position = {
            name: Counter(PREFIX + metric, doc, labels + ("position",), registry=self.registry)
            for name, metric, doc in (
                ("accepted_tokens_per_position", "spec_decode_num_accepted_tokens_per_pos",
                 "Drafted tokens accepted, by position."),
                ("draft_tokens_per_position", "spec_decode_num_draft_tokens_per_pos",
                 "Tokens drafted, by position."))}
        self.spec_acceptance_rate = Gauge(
            PREFIX + "spec_decode_draft_acceptance_rate", "Accepted / drafted tokens.", labels,
            registry=self.registry).labels(self.model_name)
        self.spec_mean_acceptance_length = Gauge(
            PREFIX + "spec_decode_mean_acceptance_length", "Tokens per verification.", labels,
            registry=self.registry).labels(self.model_name)
        self._spec_seen = None  # the speculator's stats as of the previous observe_step

    def _add_lora(self, labels: tuple[str, ...]) -> None:
        """The LoRA adapters' counters and gauges (exported with or without LoRA)."""
        def metric(kind, name, doc):
            return kind(PREFIX + name, doc, labels, registry=self.registry).labels(
                self.model_name)

        self.lora_requests = Counter(PREFIX + "lora_requests",
                                     "Requests queued with a LoRA adapter, by adapter.",
                                     labels + ("lora_name",), registry=self.registry)
        self.lora_adapter_loads = metric(Counter, "lora_adapter_loads",
                                         "LoRA adapters written into a device slot.")
        self.lora_adapter_evictions = metric(Counter, "lora_adapter_evictions",
                                             "LoRA adapters a load pushed out of their slot.")
        self.lora_resident_adapters = metric(Gauge, "lora_resident_adapters",
                                             "Device slots holding a LoRA adapter.")
        self.lora_max_adapters = metric(Gauge, "lora_max_adapters",
                                        "Device slots for LoRA adapters (max_loras).")
        self.lora_cpu_adapters = metric(Gauge, "lora_cpu_adapters",
                                        "LoRA adapters kept read in host memory.")
        self._adapter_loads = 0
        self._adapter_evictions = 0

    def _observe_adapters(self, engine) -> None:
        slots, registry = engine.scheduler.adapter_slots, getattr(engine, "adapters", None)
        self._adapter_loads = _add_growth(self.lora_adapter_loads, self._adapter_loads,
                                          engine.stats.num_adapter_loads)
        self._adapter_evictions = _add_growth(self.lora_adapter_evictions,
                                              self._adapter_evictions, slots.num_evictions)
        self.lora_resident_adapters.set(slots.num_resident)
        self.lora_max_adapters.set(slots.num_slots)
        self.lora_cpu_adapters.set(0 if registry is None else registry.num_loaded)

    def observe_adapter_request(self, lora_name: str) -> None:
        """A request with the LoRA adapter served as `lora_name` was queued."""
        self.lora_requests.labels(self.model_name, lora_name).inc()

    def _observe_speculation(self, speculator) -> None:
        """Adds what the speculator counted since the previous call."""
        if speculator is None:
            return
        stats = speculator.stats
        grown = stats.since(self._spec_seen) if self._spec_seen is not None else stats
        for name, counter in self.spec_counters.items():
            if getattr(grown, name) > 0:
                counter.inc(getattr(grown, name))
        for name, counter in self.spec_per_position.items():
            for position, count in enumerate(getattr(grown, name)):
                if count > 0:
                    counter.labels(self.model_name, str(position)).inc(count)
        if stats.acceptance_rate is not None:
            self.spec_acceptance_rate.set(stats.acceptance_rate)
            self.spec_mean_acceptance_length.set(stats.mean_acceptance_length)
        self._spec_seen = stats.copy()

    # -- the engine loop ------------------------------------------------------------------------

    def observe_step(self, engine, seconds: float) -> None:
        """After `engine.step()`: `seconds` is its wall time. Refreshes the gauges and adds the
        engine counters' growth. A call after a step that ran nothing (empty plan), or after an
        abort, only refreshes the gauges and counters: `seconds` is then ignored."""
        stats, scheduler = engine.stats, engine.scheduler
        if stats.num_steps > self._num_steps:
            self.step_duration.observe(seconds)
            self.stage_utilisation.set(stats.stage_utilisation)
        self._num_steps = stats.num_steps
        self._num_preemptions = _add_growth(self.num_preemptions, self._num_preemptions,
                                            scheduler.num_preemptions)
        self._num_cached_tokens = _add_growth(self.prefix_cache_hits, self._num_cached_tokens,
                                              scheduler.num_cached_tokens)
        self._num_window_freed = _add_growth(self.window_freed_pages, self._num_window_freed,
                                             scheduler.num_window_freed_pages)
        self._compiles = _add_growth(self.recompiles, self._compiles, stats.compiles_after_warmup)
        self._overlapped_seconds = _add_growth(self.structured_mask_overlapped,
                                               self._overlapped_seconds,
                                               stats.overlap_mask_seconds)
        self._hidden_seconds = _add_growth(self.structured_mask_hidden, self._hidden_seconds,
                                           stats.overlap_hidden_seconds)
        num_batches = scheduler.num_constraint_batches - self._constraint_batches
        for _ in range(num_batches):  # one a step; where steps went unobserved, their mean
            self.structured_mask.observe(
                (scheduler.constraint_seconds - self._constraint_seconds) / num_batches)
        self._constraint_batches = scheduler.num_constraint_batches
        self._constraint_seconds = scheduler.constraint_seconds
        channel = engine.runner.channel
        if channel is not None:
            self._broadcast_seconds = _add_growth(self.plan_broadcast_seconds,
                                                  self._broadcast_seconds, channel.seconds)
        self._observe_speculation(getattr(engine, "speculator", None))
        self._observe_adapters(engine)
        self.num_requests_running.set(scheduler.num_running)
        self.num_requests_waiting.set(scheduler.num_waiting)
        self.warmup_programs.set(stats.warmup_compiles)
        self.warmup_seconds.set(stats.warmup_seconds)
        usage = scheduler.kv_usage()
        self.kv_cache_usage.set(usage.num_used_pages / usage.num_total_pages)
        self.kv_cache_cached_pages.set(usage.num_cached_pages)
        self.kv_cache_fragmentation.set(usage.fragmentation)
        self.kv_cache_reserved_unused.set(usage.num_reserved_unused_pages)
        self.prefill_padding_ratio.set(stats.prefill_padding)
        self.decode_padding_ratio.set(stats.decode_padding)

    def observe_output(self, output: RequestOutput) -> None:
        """Once for each RequestOutput a step returned, before the next step."""
        completion, times = output.outputs[0], output.metrics
        seen = self._requests.get(output.request_id)
        num_new = len(completion.token_ids) - (seen.num_tokens if seen else 0)
        if num_new > 0:
            self.generation_tokens.inc(num_new)
            if seen is None:
                self.prompt_tokens.inc(len(output.prompt_token_ids))
                self.time_to_first_token.observe(times.time_to_first_token)
                num_gaps, since = num_new - 1, times.first_token_time
            else:
                num_gaps, since = num_new, seen.last_token_time
            for _ in range(num_gaps):
                self.inter_token_latency.observe((times.last_token_time - since) / num_gaps)
        if output.finished:
            self._requests.pop(output.request_id, None)
            self._count_finished(completion.finish_reason)
            end = times.finished_time if times.finished_time is not None else times.last_token_time
            if end is not None:
                self.e2e_request_latency.observe(end - times.arrival_time)
        elif num_new > 0:
            self._requests[output.request_id] = _Seen(len(completion.token_ids),
                                                      times.last_token_time)

    def observe_aborted(self, request_id: str) -> None:
        """Once for each request the engine aborted (`engine.abort(request_id)` returned True):
        counts it as finished_reason="abort" and forgets it. Aborted requests produce no
        RequestOutput, so without this call their state would stay. The gauges catch up at the
        next observe_step; when no step follows (the engine is now idle), call
        observe_step(engine, 0.0) to refresh them."""
        self._requests.pop(request_id, None)
        self._count_finished("abort")

    def observe_rejected(self, reason: str) -> None:
        """A request refused before it reached the engine; `reason` is one of REJECTED_REASONS."""
        if reason not in self.requests_rejected:
            raise ValueError(f"unknown rejection reason {reason!r}: one of {REJECTED_REASONS}")
        self.requests_rejected[reason].inc()

    def _count_finished(self, reason: str) -> None:
        counter = self.request_success.get(reason)
        if counter is None:
            raise ValueError(f"unknown finish reason {reason!r}: one of {FINISHED_REASONS}")
        counter.inc()

    # -- exposition -----------------------------------------------------------------------------

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return prometheus_client.generate_latest(self.registry)

    def start_http_server(self, port: int, host: str = "127.0.0.1") -> int:
        """Serves /metrics for this registry on a daemon thread; returns the bound port (port 0
        picks a free one). Stop it with stop_http_server()."""
        if self._http is not None:
            raise RuntimeError("the metrics HTTP server is already running")
        server, thread = prometheus_client.start_http_server(port, addr=host,
                                                             registry=self.registry)
        self._http = (server, thread)
        return server.server_port

    def stop_http_server(self) -> None:
        """Stops the HTTP server and frees its port; does nothing if none is running."""
        if self._http is None:
            return
        server, thread = self._http
        self._http = None
        server.shutdown()
        server.server_close()
        thread.join()


def _add_growth(counter, last: float, now: float) -> float:
    """Adds `now - last` of a cumulative engine counter to `counter`; returns `now`."""
    if now > last:
        counter.inc(now - last)
    return now
