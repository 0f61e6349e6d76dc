"""`EngineConfig`: the engine's knobs, each declared once, and the layer configs derived from them.

The scheduling knobs (cache geometry, per-step limits, policy, ordering) are declared and
validated in `meshserve.batching.knobs.SchedulingKnobs`, which `EngineConfig` extends; the
runner's own knobs (`max_logprobs`, `attention`) are declared on `RunnerConfig` and held here
with `same_knob`. `scheduler_config()` and `runner_config()` hand each layer its config, with what
the engine settles at runtime (EOS ids, replicas, buckets) filled in. Each field's metadata holds
its help text and whether it costs a compile; the command line is generated from it
(`meshserve.serving.options`).

Knobs that change compiled shapes (and so cost a recompile): `mesh`, `quantization`,
`num_pages`, `page_size`, `max_num_seqs`, `max_num_batched_tokens`, `prefill_chunk`,
`max_model_len`, `max_logprobs`, `attention`, `overlap_masks` (adds programs),
`pipeline_rounds`, and `enable_lora` with `max_loras` and `max_lora_rank` (the adapter slabs'
shapes; which adapters run never compiles anything). The rest are host policy,
`speculative_config` included (drafts are rows of the ragged step: `batching/speculative.py`)
and `max_cpu_loras`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from meshserve.batching.knobs import SchedulerConfig, SchedulingKnobs, knob, same_knob
from meshserve.batching.pipeline_schedule import UnitShape
from meshserve.batching.speculative import SpeculativeConfig
from meshserve.batching.structured import BOUNDS, check_bound
from meshserve.model.length_predictor import LearnedPredictor
from meshserve.model.lora import LoraShape
from meshserve.model.quant_formats import SCHEMES
from meshserve.model.executor.runner import RunnerConfig
from meshserve.sharding.mesh import MeshConfig

DEFAULT_MAX_MODEL_LEN = 2048


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig(SchedulingKnobs):
    """Engine knobs: the scheduling knobs of `SchedulingKnobs` and the engine's and runner's own.

    With data parallelism (`mesh` with data > 1) `num_pages`, `max_num_seqs` and
    `max_num_batched_tokens` are per replica: each replica is one engine's worth of rows and pages.
    """

    mesh: str | MeshConfig | None = knob(None, "the device mesh, data=D,stage=S,model=M (in "
                                               "Python also a MeshConfig); unset: one device",
                                         compile=True)
    quantization: str = knob("auto", "weight-only quantized kernels. auto: a GGUF's quantized "
                                     "blocks kept exactly (in int8 containers on the CPU, "
                                     "elsewhere int4 where codes fit 4 bits, else int8), float "
                                     "weights left float; int8 (a scale per "
                                     "output channel), int4 (a scale and a minimum per 32 "
                                     "weights), int4-g64 (per 64): float kernels quantized too; "
                                     "none: everything float", compile=True, choices=SCHEMES)
    length_predictor: str | None = knob(None, "ordering predicted: a saved predictor (.npz) to "
                                              "start from; unset starts from the prior, and it "
                                              "keeps learning from finished requests")
    max_logprobs: int = same_knob(RunnerConfig, "max_logprobs")
    attention: str = same_knob(RunnerConfig, "attention")
    native_kernels: bool | None = same_knob(RunnerConfig, "native_kernels")
    overlap_masks: bool | None = same_knob(RunnerConfig, "overlap_masks")
    pipeline_rounds: int = knob(4, "stage > 1: steps one pipeline call runs before the host steps "
                                   "in (1 for a call with a penalty)", compile=True)
    bubble_filling: bool = knob(True, "stage > 1: overlap rounds and fill idle stage slots with "
                                      "prefill chunks; off: every round fills and drains")
    structured_max_string_length: int | None = knob(
        None, "JSON constraints a request leaves unbounded: the longest string or free object "
              "key, in characters; unset: none")
    structured_max_integer_digits: int | None = knob(
        None, "JSON constraints a request leaves unbounded: the most digits before a number's "
              "point; unset: none")
    speculative_config: str | dict | SpeculativeConfig | None = knob(
        None, "speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", "
              "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
              "\"prompt_lookup_min\": 2}, or {\"method\": \"draft_model\", \"model\": "
              "NAME, \"num_speculative_tokens\": 4}; \"disable_by_batch_size\": no drafts in "
              "a step where more rows sample (default 4); unset: off. Drafts are rows of the "
              "ragged step: no program is added (a draft model compiles its own)",
        metavar="JSON")
    enable_lora: bool = knob(False, "serve LoRA adapters, which requests name (lora_request): "
                                    "every step computes the adapters' deltas for its tokens",
                             compile=True)
    max_loras: int = knob(1, "enable_lora: adapters one step can mix (their slots on the "
                             "device)", compile=True)
    max_lora_rank: int = knob(16, "enable_lora: the largest adapter rank served; smaller ranks "
                                  "are padded to it", compile=True)
    max_cpu_loras: int | None = knob(None, "enable_lora: adapters kept read in host memory, "
                                           "least recently used out; unset: max_loras")
    warmup: bool = knob(True, "compile every bucket at start")
    warmup_prompt_logprobs: bool = knob(
        False, "with warmup: also compile each bucket's prompt-logprobs variant at start "
               "(about 18 MB of memory a program on the CPU); off: a bucket's variant compiles "
               "when a request first asks for prompt logprobs at it (a multi-process engine "
               "always compiles them at start)")
    compilation_cache: bool = knob(True, "keep compiled programs in <cache dir>/xla across runs "
                                         "(process-wide: once on, on for every engine)")

    def __post_init__(self):
        object.__setattr__(self, "mesh", str(MeshConfig.coerce(self.mesh)))
        self._trial_runner_config()  # the runner's checks, before the scheduler's
        super().__post_init__()
        if self.length_predictor is not None and self.ordering != "predicted":
            raise ValueError("length_predictor is used only with ordering='predicted'")
        if self.quantization not in SCHEMES:
            raise ValueError(f"quantization must be one of {SCHEMES}, got {self.quantization!r}")
        for name in BOUNDS:
            check_bound(f"structured_{name}", name, getattr(self, f"structured_{name}"))
        if not isinstance(self.pipeline_rounds, int) or self.pipeline_rounds < 1:
            raise ValueError(f"pipeline_rounds must be >= 1, got {self.pipeline_rounds}")
        if self.native_kernels and self.mesh_config.num_devices > 1:
            raise ValueError("native_kernels runs on one CPU device; it does not split over a "
                             f"mesh ({self.mesh})")
        self._check_speculation()
        self._check_lora()

    def _check_lora(self) -> None:
        """The LoRA knobs' sizes, and the combinations that cannot serve adapters, by name."""
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        if isinstance(self.max_cpu_loras, bool) or not isinstance(self.max_cpu_loras, int) \
                or self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras must be an int >= max_loras ({self.max_loras}), "
                             f"got {self.max_cpu_loras!r}")
        if not self.enable_lora:
            return
        if self.policy != "continuous":
            raise ValueError(f"enable_lora needs policy 'continuous', not {self.policy!r}")

    def lora_shape(self) -> LoraShape | None:
        """The LoRA slabs' sizes, or None without `enable_lora`."""
        if not self.enable_lora:
            return None
        return LoraShape(num_slots=self.max_loras, max_rank=self.max_lora_rank)

    def _check_speculation(self) -> None:
        """The speculative config parsed (a dict, JSON text or a `SpeculativeConfig`), and the
        combinations that cannot speculate refused by name."""
        spec = SpeculativeConfig.coerce(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)
        if spec is None:
            return
        if spec.method == "draft_model" and self.mesh_config.num_devices > 1:
            raise ValueError("speculative_config: method 'draft_model' runs its draft model on "
                             f"one device; it is not supported on a mesh ({self.mesh})")
        if self.policy != "continuous":
            raise ValueError(f"speculative_config needs policy 'continuous'; the {self.policy} "
                             "baseline never speculates")
        if self.mesh_config.stage > 1:
            raise ValueError("speculative_config is not supported with pipeline stages "
                             f"(mesh {self.mesh}): a pipeline call plans its rounds before "
                             "their tokens exist")
        if spec.num_speculative_tokens + 1 > self.max_num_seqs:
            raise ValueError(f"speculative_config.num_speculative_tokens "
                             f"({spec.num_speculative_tokens}) + 1 must be <= max_num_seqs "
                             f"({self.max_num_seqs}): each draft takes a sequence slot of the "
                             "step")

    def _trial_runner_config(self) -> RunnerConfig:
        """The runner's validation of its knobs, run as soon as the config is built."""
        return RunnerConfig(num_pages=self.num_pages, page_size=self.page_size,
                            max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            max_logprobs=self.max_logprobs, attention=self.attention,
                            native_kernels=self.native_kernels,
                            overlap_masks=self.overlap_masks)

    @property
    def mesh_config(self) -> MeshConfig:
        return MeshConfig.parse(self.mesh)

    def for_model(self, model_config) -> "EngineConfig":
        """This config with `max_model_len` settled against the model's context."""
        context = model_config.max_position_embeddings
        if self.max_model_len is None:
            return dataclasses.replace(self, max_model_len=min(context, DEFAULT_MAX_MODEL_LEN))
        if self.max_model_len > context:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's context "
                             f"of {context} positions")
        return self

    def runner_config(self) -> RunnerConfig:
        assert self.max_model_len is not None, "call for_model() first"
        return dataclasses.replace(self._trial_runner_config(),
                                   max_pages_per_seq=-(-self.max_model_len // self.page_size))

    def unit_shape(self) -> UnitShape:
        """The shapes of a pipeline call: S decode lanes of ceil(max_num_seqs / S) rows, prefill
        units of `prefill_chunk` token slots packing up to `max_num_seqs` chunks, and room for
        `pipeline_rounds` rounds."""
        mesh = self.mesh_config
        stages = mesh.stage
        return UnitShape(num_stages=stages, num_replicas=mesh.data,
                         num_units=self.pipeline_rounds * self.units_per_round(),
                         decode_rows=-(-self.max_num_seqs // stages),
                         prefill_tokens=self.prefill_chunk,
                         prefill_rows=min(self.max_num_seqs, self.prefill_chunk),
                         max_pages=-(-self.max_model_len // self.page_size),
                         page_size=self.page_size)

    def units_per_round(self) -> int:
        """The most units one round can take: a prefill unit per row, the lanes, a drain and
        the idle units the feedback rule may put in."""
        stages = self.mesh_config.stage
        return self.max_num_seqs + stages + 2 * (stages - 1)

    def scheduler_config(self, eos_token_ids: Sequence[int], *, num_replicas: int = 1,
                         attention_window: int = 0) -> SchedulerConfig:
        """The scheduling knobs as they are, and what this engine settles: EOS ids, replicas,
        how prefill chunks are cut, and the model's attention window (pages behind it are
        freed)."""
        knobs = {f.name: getattr(self, f.name) for f in dataclasses.fields(SchedulingKnobs)}
        return SchedulerConfig(**knobs, **self._chunking(), eos_token_ids=tuple(eos_token_ids),
                               num_replicas=num_replicas, attention_window=attention_window,
                               max_loras=self.max_loras if self.enable_lora else 0)

    def _chunking(self) -> dict[str, Any]:
        """How the scheduler cuts prefill chunks for this engine's runner. The ragged step pads
        only a step's total, so a chunk is cut to land the step on the nearer token bucket and
        never to a per-chunk bucket. A pipeline packs chunks into prefill units of prefill_chunk
        token slots, so there a chunk is cut by the budget alone."""
        if self.mesh_config.stage > 1:
            return dict(token_buckets=(self.prefill_chunk,), bound_padded_prefill=False)
        return dict(token_buckets=(self.prefill_chunk,), bound_padded_prefill=False,
                    step_buckets=self.runner_config().token_buckets)

    def make_length_predictor(self) -> LearnedPredictor | None:
        """The predictor "predicted" ordering uses: loaded from `length_predictor`, or new."""
        if self.ordering != "predicted":
            return None
        if self.length_predictor is None:
            return LearnedPredictor()
        return LearnedPredictor.load(self.length_predictor)
