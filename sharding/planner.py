"""The mesh planner: an analytic cost model of serving a model on each (data, stage, model) mesh
of some devices, and a ranking of those meshes against a workload and its latency SLOs.

It stays one file past 600 lines on purpose: a third of it is the cost model written out below,
and each function computes one term of it, so the formulas and their code are read side by side.

Nothing here runs a model: every figure is counted from the config, meshserve's sharding rules
and a `HardwareSpec`. Per device, for the mesh's largest pipeline stage:

    weights       every weight at the config's dtype, its `heads`, `kv_heads`, `ffw`, `vocab`
                  and `expert` dimensions split over `model` when they divide (otherwise
                  replicated, as
                  `meshserve.sharding.rules` does), its `layers` dimension cut to ceil(L / stage);
                  kv heads padded up to a multiple of `model` (`meshserve.sharding.head_padding`)
    KV / token    2 * (K' / model) * head_dim * bytes * ceil(L / stage)
    max batch     data * floor((hbm * (1 - headroom) - weights) / (KV / token * context)),
                  context = prompt + output rounded up to whole pages

A step of `rows` rows, `tokens` new tokens each, attending to `context` positions, costs

    max(bytes / hbm_bw, flops / peak_flops) + tp_comm
    bytes  = streamed weights + rows * (context + tokens) * KV / token     (read, then write new)
    flops  = 2 * rows * tokens * layer matmul params + 2 * rows * lm_head params
             + 4 * rows * tokens * context * (H' / model) * head_dim * layers
    a mixture of experts: the routed experts count k / E of their params in the flops, and
             in the streamed bytes the share of experts that rows * tokens tokens choose,
             1 - (1 - k / E) ** (rows * tokens), as if each picked at random
    tp_comm = per layer 2 ring all-reduces of [rows * tokens, D] (a mixture: attention's, the
              experts' combine when they split over `model`, the shared expert's when it
              splits), plus, when the vocabulary is
              split, the embedding's all-reduce of [rows * tokens, D], an all-gather of the
              [rows, V] float32 logits (steps returning logprobs) and SAMPLER_COLLECTIVES
              per-row collectives;
              ring all-reduce = 2 (m - 1) / m * bytes / link_bw + COLLECTIVE_LATENCY_S

Logits are computed at each row's last token only, and attention covers the whole context for
every new token (meshserve's masked attention does not skip the causal upper triangle), as in
the compiled step. Weights streamed per step are all the device's weights except lookup tables
that are only gathered (an untied embedding, GPT-2's positions). Weights without a `layers` axis
(embeddings, final norm, lm_head) sit on every stage, as the rules table would place them, and
the largest stage is charged their work and the vocabulary collectives too.

Serving, per data replica holding b rows, is a cycle in which every row is prefilled once and
then decodes `output` tokens. Each sub-batch is its own compiled call in meshserve, so prefill
and decode do not share weight reads: a cycle is b prompts of `prompt` tokens plus `output`
decode rounds. With S stages and M microbatches of ceil(b / M) rows, a tick is one microbatch on
the largest stage plus its activation send [rows * tokens, D] to the next stage:

    fill-drain:     cycle = output * (M + S - 1) * t_decode + (b + S - 1) * t_prefill
    filled bubbles: the (S - 1) idle decode ticks of each round run prefill instead; only the
                    prefill work beyond them adds to the cycle, with its own S - 1 ticks of fill
    utilisation:    busy / cycle per stage, busy = output * M * t_decode + b * t_prefill
                    (M / (M + S - 1) in a decode-only round)
    throughput = sum over replicas of b * output / cycle;  TPOT = cycle / output;
    TTFT = one decode round (the step in flight) + S * t_prefill

Without pipelining (S = 1, M = 1) this is b prefills plus `output` decode steps of the whole batch.

Invariants: the counts that the compiled step shows (per-device weight and KV bytes, residual
all-reduces per layer) equal this module's, which `tests/sharding/test_planner.py` checks
against the partitioned HLO on fake devices. The planner mirrors the rules table and the head
padding rather than importing them, because both modules import jax; the tests pin the mirror.

It is one piece (over 600 lines) because it is one cost model: each section computes a term of
the formulas above from the same mirrors of the rules and the padding, and its callers and tests
read them as one module.

This module imports neither jax nor flax: it is plain Python.
"""

from __future__ import annotations

import dataclasses
import math

from meshserve.model.canonical import expected_shapes
from meshserve.model.config import (PRESETS, ModelConfig, MoeConfig, bytes_per_element,
                                    kv_bytes_per_token, weight_bytes)
from meshserve.model.families import config_from_hf
from meshserve.sharding.hardware import HardwareSpec

# Seconds every collective costs on top of its bytes: kernel launch and synchronisation. An
# assumption of the order of NCCL's small-message all-reduce latency within one NVLink node
# (microseconds to tens of microseconds); no datasheet gives it, and it is used for ICI as well.
COLLECTIVE_LATENCY_S = 10e-6
# Per-row collectives of the sampler on the vocabulary-split logits in every step (the greedy
# path of the compiled step): maxima and sums, candidate gathers, and the scalar votes on the
# shortcuts. The all-gather of the [rows, V] float32 logits for the top-k logprobs runs only on
# steps where a row returns logprobs; the cost model charges it anyway (the costlier step). The
# penalty and min-tokens passes run only on steps where a row needs them.
SAMPLER_COLLECTIVES = 6
LOGITS_BYTES = 4  # the sampler works on float32 logits
DEFAULT_HEADROOM = 0.1

# `meshserve.sharding.rules.DEFAULT_RULES`: the logical axes split over `model`. Only `layers`
# is split over `stage`, in contiguous shares (`stage_config`).
MODEL_SPLIT_AXES = ("heads", "kv_heads", "ffw", "vocab", "expert")
# The logical axes of every weight, as `meshserve.model.layers.param` declares them, by the
# canonical key that `meshserve.model.canonical.expected_shapes` lists with its shape.
WEIGHT_AXES: dict[str, tuple[str, ...]] = {
    "embed/embedding": ("vocab", "embed"),
    "pos_embed/embedding": ("positions", "embed"),
    "layers/attn_norm/scale": ("layers", "embed"),
    "layers/attn_norm/bias": ("layers", "embed"),
    "layers/attn/q/kernel": ("layers", "embed", "heads", "head_dim"),
    "layers/attn/k/kernel": ("layers", "embed", "kv_heads", "head_dim"),
    "layers/attn/v/kernel": ("layers", "embed", "kv_heads", "head_dim"),
    "layers/attn/q_norm/scale": ("layers", "head_dim"),
    "layers/attn/k_norm/scale": ("layers", "head_dim"),
    "layers/attn/q/bias": ("layers", "heads", "head_dim"),
    "layers/attn/k/bias": ("layers", "kv_heads", "head_dim"),
    "layers/attn/v/bias": ("layers", "kv_heads", "head_dim"),
    "layers/attn/qkv/kernel": ("layers", "embed", "qkv", "heads", "head_dim"),
    "layers/attn/qkv/bias": ("layers", "qkv", "heads", "head_dim"),
    "layers/attn/o/kernel": ("layers", "heads", "head_dim", "embed"),
    "layers/attn/o/bias": ("layers", "embed"),
    "layers/mlp_norm/scale": ("layers", "embed"),
    "layers/mlp_norm/bias": ("layers", "embed"),
    "layers/mlp/gate/kernel": ("layers", "embed", "ffw"),
    "layers/mlp/up/kernel": ("layers", "embed", "ffw"),
    "layers/mlp/up/bias": ("layers", "ffw"),
    "layers/mlp/down/kernel": ("layers", "ffw", "embed"),
    "layers/mlp/down/bias": ("layers", "embed"),
    "final_norm/scale": ("embed",),
    "final_norm/bias": ("embed",),
    "lm_head/kernel": ("embed", "vocab"),
    # A mixture of experts (`meshserve.model.moe`) in place of the MLP.
    "layers/mlp/router/kernel": ("layers", "embed", "router"),
    "layers/mlp/experts/gate": ("layers", "expert", "embed", "expert_ffw"),
    "layers/mlp/experts/up": ("layers", "expert", "embed", "expert_ffw"),
    "layers/mlp/experts/down": ("layers", "expert", "expert_ffw", "embed"),
    "layers/mlp/shared/gate/kernel": ("layers", "embed", "ffw"),
    "layers/mlp/shared/up/kernel": ("layers", "embed", "ffw"),
    "layers/mlp/shared/down/kernel": ("layers", "ffw", "embed"),
    "layers/mlp/shared/scale/kernel": ("layers", "embed", None),
}
# The routed experts' weights: a step reads and multiplies only the experts its tokens chose.
EXPERT_WEIGHTS = ("layers/mlp/experts/gate", "layers/mlp/experts/up", "layers/mlp/experts/down")
GATHERED_TABLES = ("pos_embed/embedding",)  # read by row, never streamed whole

# Shapes meshserve has no preset for, built with `config_from_hf` from the published HF
# config.json (meta-llama/Meta-Llama-3-8B), for planning only.
PLANNING_MODELS: dict[str, ModelConfig] = {
    "llama-3-8b": config_from_hf({
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 128000,
        "eos_token_id": 128001,
    }, name="llama-3-8b"),
    # Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json, all of whose layers are sparse.
    "qwen3-30b-a3b": ModelConfig(
        name="qwen3-30b-a3b", arch="llama", vocab_size=151936, hidden_size=2048,
        intermediate_size=768, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
        max_position_embeddings=40960, rope_theta=1e6, norm_eps=1e-6, eos_token_ids=(151645,),
        qk_norm=True, moe=MoeConfig(num_experts=128, experts_per_token=8, renormalize=True)),
    "qwen3-235b-a22b": ModelConfig(
        name="qwen3-235b-a22b", arch="llama", vocab_size=151936, hidden_size=4096,
        intermediate_size=1536, num_layers=94, num_heads=64, num_kv_heads=4, head_dim=128,
        max_position_embeddings=40960, rope_theta=1e6, norm_eps=1e-6, eos_token_ids=(151645,),
        qk_norm=True, moe=MoeConfig(num_experts=128, experts_per_token=8, renormalize=True)),
}


# --- Inputs -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """(data, stage, model). Not `MeshConfig`, whose module imports jax; `str` matches its."""

    data: int
    stage: int
    model: int

    def __post_init__(self):
        for axis in ("data", "stage", "model"):
            _check_positive_int(f"mesh axis {axis}", getattr(self, axis))

    @property
    def num_devices(self) -> int:
        return self.data * self.stage * self.model

    def __str__(self) -> str:
        return f"data={self.data},stage={self.stage},model={self.model}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """Every request has `prompt_len` tokens and generates `output_len`; `concurrency` requests
    are in flight at once (None: as many as fit, an offline run)."""

    prompt_len: int
    output_len: int
    concurrency: int | None = None
    page_size: int = 16

    def __post_init__(self):
        for field in ("prompt_len", "output_len", "page_size"):
            _check_positive_int(field, getattr(self, field))
        if self.concurrency is not None:
            _check_positive_int("concurrency", self.concurrency)

    @property
    def context_slots(self) -> int:
        """KV slots one sequence holds at its end: whole pages."""
        pages = -(-(self.prompt_len + self.output_len) // self.page_size)
        return pages * self.page_size

    @property
    def mean_decode_context(self) -> float:
        """Positions a decode step attends to, averaged over the output: P + (O + 1) / 2."""
        return self.prompt_len + (self.output_len + 1) / 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class Slo:
    """Latency limits, in seconds. The defaults are MLPerf's Llama-2-70B Server SLOs."""

    ttft: float = 2.0
    tpot: float = 0.2

    def __post_init__(self):
        for field in ("ttft", "tpot"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"SLO {field} must be a number of seconds > 0, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanOptions:
    headroom: float = DEFAULT_HEADROOM  # share of HBM left free for activations and workspace
    microbatches: int | None = None  # per pipeline; None: as many as stages
    fill_bubbles: bool = False  # run prefill in the pipeline's idle decode ticks

    def __post_init__(self):
        if not 0 <= self.headroom < 1:
            raise ValueError(f"headroom must be a fraction in [0, 1), got {self.headroom!r}")
        if self.microbatches is not None:
            _check_positive_int("microbatches", self.microbatches)


def _check_positive_int(field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field} must be an int >= 1, got {value!r}")


def resolve_model(model: str | ModelConfig, dtype: str | None = None) -> ModelConfig:
    """A preset name (`PRESETS` or `PLANNING_MODELS`) or a config, at `dtype` when given."""
    if isinstance(model, str):
        known = {**PRESETS, **PLANNING_MODELS}
        if model not in known:
            raise ValueError(f"unknown model {model!r} for planning; use one of {sorted(known)}")
        model = known[model]
    return model if dtype is None else model.replace(dtype=dtype)


def mesh_shapes(num_devices: int) -> list[MeshShape]:
    """Every (data, stage, model) whose product is `num_devices`."""
    _check_positive_int("devices", num_devices)
    divisors = [k for k in range(1, num_devices + 1) if num_devices % k == 0]
    return [MeshShape(d, s, num_devices // (d * s)) for d in divisors for s in divisors
            if (num_devices // d) % s == 0]


# --- What a device holds ------------------------------------------------------------------------


def padded_head_counts(config: ModelConfig, model_size: int) -> tuple[int, int]:
    """(num_heads, num_kv_heads) after `meshserve.sharding.head_padding` pads the kv heads up to a
    multiple of `model_size` (the same formula; that module imports jax)."""
    kv_heads = -(-config.num_kv_heads // model_size) * model_size
    return kv_heads * (config.num_heads // config.num_kv_heads), kv_heads


def stage_config(config: ModelConfig, mesh: MeshShape) -> ModelConfig:
    """The config one device of the largest stage runs: heads padded for `model` (llama only;
    GPT-2's must divide) and ceil(L / stage) layers, the first stages taking the extra ones."""
    num_heads, num_kv_heads = config.num_heads, config.num_kv_heads
    if config.arch == "llama":
        num_heads, num_kv_heads = padded_head_counts(config, mesh.model)
    return config.replace(num_heads=num_heads, num_kv_heads=num_kv_heads,
                          num_layers=-(-config.num_layers // mesh.stage))


def structural_problem(config: ModelConfig, mesh: MeshShape) -> str | None:
    """Why `mesh` cannot split `config` at all, or None."""
    if mesh.stage > config.num_layers:
        return f"stage={mesh.stage} exceeds the {config.num_layers} layers"
    if config.arch == "gpt2" and config.num_heads % mesh.model:
        return (f"{config.num_heads} heads do not divide over model={mesh.model} (GPT-2 has no "
                f"kv heads to pad)")
    return None


def device_weight_shapes(config: ModelConfig, mesh: MeshShape) -> dict[str, tuple[int, ...]]:
    """Each weight's shard shape on one device of the largest stage."""
    shapes = expected_shapes(stage_config(config, mesh))
    return {key: shard_shape(shape, WEIGHT_AXES[key], mesh.model) for key, shape in shapes.items()}


def shard_shape(shape: tuple[int, ...], axes: tuple[str, ...], model_size: int) -> tuple[int, ...]:
    # A dimension that does not divide stays whole (replicated), as the rules table does.
    return tuple(dim // model_size if axis in MODEL_SPLIT_AXES and dim % model_size == 0 else dim
                 for dim, axis in zip(shape, axes))


def device_weight_bytes(config: ModelConfig, mesh: MeshShape) -> int:
    shapes = device_weight_shapes(config, mesh)
    return sum(math.prod(s) for s in shapes.values()) * bytes_per_element(config.dtype)


def streamed_weight_bytes(config: ModelConfig, mesh: MeshShape, tokens: int | None = None) -> int:
    """Weight bytes one step of `tokens` tokens reads whole: all but the tables it only gathers
    rows of, and of the routed experts only the share its tokens choose (`experts_read`; all of
    them when `tokens` is None)."""
    gathered = GATHERED_TABLES + (() if config.tie_embeddings else ("embed/embedding",))
    shapes = device_weight_shapes(config, mesh)
    share = 1.0 if tokens is None else experts_read(config, tokens)
    elements = sum(math.prod(s) * (share if key in EXPERT_WEIGHTS else 1)
                   for key, s in shapes.items() if key not in gathered)
    return round(elements * bytes_per_element(config.dtype))


def experts_read(config: ModelConfig, tokens: int) -> float:
    """The share of the experts a step of `tokens` tokens runs: each token picks k of E, as if
    at random, so an expert is left idle with probability (1 - k / E) ** tokens. Real routers
    are less even (fewer experts, more often), which this overestimates; expert parallelism
    splits the experts evenly, so the share holds on every device."""
    if config.moe is None:
        return 1.0
    return 1 - (1 - config.moe.experts_per_token / config.moe.num_experts) ** tokens


def is_expert_split(config: ModelConfig, mesh: MeshShape) -> bool:
    """The rules table splits the experts over `model` when their count divides."""
    return (config.moe is not None and mesh.model > 1
            and config.moe.num_experts % mesh.model == 0)


def device_kv_bytes_per_token(config: ModelConfig, mesh: MeshShape) -> int:
    """K and V bytes of one token on one device: its kv heads, its stage's layers."""
    return kv_bytes_per_token(stage_config(config, mesh)) // mesh.model


def is_vocab_split(config: ModelConfig, mesh: MeshShape) -> bool:
    return mesh.model > 1 and config.vocab_size % mesh.model == 0


def residual_all_reduces_per_layer(config: ModelConfig, mesh: MeshShape) -> int:
    """Megatron: one after the row-parallel attention-out projection, one after MLP down. A
    mixture of experts has, instead of down's, one that adds the devices' experts
    (`meshserve.sharding.experts`) when they are split, and one after its shared expert's down
    when that splits."""
    if mesh.model == 1:
        return 0
    moe = config.moe
    if moe is None:
        return 2
    shared = moe.shared_expert_size > 0 and moe.shared_expert_size % mesh.model == 0
    return 1 + int(is_expert_split(config, mesh)) + int(shared)


def step_all_reduces_of_residual(config: ModelConfig, mesh: MeshShape) -> int:
    """All-reduces of the [tokens, D] residual in one step of the largest stage: the layers'
    and the vocabulary-split embedding lookup's."""
    layers = stage_config(config, mesh).num_layers
    return (residual_all_reduces_per_layer(config, mesh) * layers
            + int(is_vocab_split(config, mesh)))


def max_batch_per_replica(config: ModelConfig, hardware: HardwareSpec, mesh: MeshShape,
                          workload: Workload, headroom: float) -> int:
    free = usable_hbm(hardware, headroom) - device_weight_bytes(config, mesh)
    per_sequence = device_kv_bytes_per_token(config, mesh) * workload.context_slots
    return max(0, int(free // per_sequence))


def usable_hbm(hardware: HardwareSpec, headroom: float) -> float:
    return hardware.hbm * (1 - headroom)


# --- What a step costs --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepCost:
    """Seconds of one step on one device of the largest stage."""

    memory_s: float
    compute_s: float
    comm_s: float

    @property
    def seconds(self) -> float:
        # Collectives are not overlapped with the matmuls that wait for them.
        return max(self.memory_s, self.compute_s) + self.comm_s


def step_cost(config: ModelConfig, hardware: HardwareSpec, mesh: MeshShape, *, rows: int,
              tokens: int, context: float) -> StepCost:
    """`rows` rows of `tokens` new tokens each, attending to `context` positions (theirs
    included)."""
    kv = rows * (context + tokens) * device_kv_bytes_per_token(config, mesh)
    moved = streamed_weight_bytes(config, mesh, rows * tokens) + kv
    return StepCost(memory_s=moved / hardware.hbm_bw,
                    compute_s=step_flops(config, mesh, rows=rows, tokens=tokens,
                                         context=context) / hardware.peak_flops(config.dtype),
                    comm_s=tensor_parallel_seconds(config, hardware, mesh, rows=rows,
                                                   tokens=tokens))


def step_flops(config: ModelConfig, mesh: MeshShape, *, rows: int, tokens: int,
               context: float) -> float:
    """Per device: the layers' matmuls for every token, the logits for each row's last token,
    and attention (QK^T and AV) of every token over the whole context. A token runs k of the E
    routed experts: on average k / E of each device's expert weights."""
    stage = stage_config(config, mesh)
    shapes = device_weight_shapes(config, mesh)
    layer_params = sum(math.prod(s) for key, s in shapes.items()
                       if key.startswith("layers/") and key.endswith("/kernel"))
    if config.moe is not None:
        routed = config.moe.experts_per_token / config.moe.num_experts
        layer_params += routed * sum(math.prod(shapes[key]) for key in EXPERT_WEIGHTS)
    head_params = math.prod(shapes["embed/embedding" if config.tie_embeddings
                                   else "lm_head/kernel"])
    heads = stage.num_heads // mesh.model
    attention = 4 * rows * tokens * context * heads * stage.head_dim * stage.num_layers
    return 2 * rows * tokens * layer_params + 2 * rows * head_params + attention


def all_reduce_seconds(num_bytes: float, group: int, bandwidth: float) -> float:
    """A ring all-reduce of `num_bytes` over `group` devices."""
    if group == 1:
        return 0.0
    return 2 * (group - 1) / group * num_bytes / bandwidth + COLLECTIVE_LATENCY_S


def all_gather_seconds(num_bytes: float, group: int, bandwidth: float) -> float:
    """A ring all-gather whose result is `num_bytes`."""
    if group == 1:
        return 0.0
    return (group - 1) / group * num_bytes / bandwidth + COLLECTIVE_LATENCY_S


def send_seconds(num_bytes: float, bandwidth: float) -> float:
    return num_bytes / bandwidth + COLLECTIVE_LATENCY_S


def tensor_parallel_seconds(config: ModelConfig, hardware: HardwareSpec, mesh: MeshShape, *,
                            rows: int, tokens: int) -> float:
    """The step's collectives over `model` on the largest stage, which is charged the
    embedding's and the sampler's as well."""
    bandwidth = model_link_bandwidth(hardware, mesh)
    residual = rows * tokens * config.hidden_size * bytes_per_element(config.dtype)
    seconds = step_all_reduces_of_residual(config, mesh) * all_reduce_seconds(
        residual, mesh.model, bandwidth)
    if is_vocab_split(config, mesh):
        logits = rows * config.vocab_size * LOGITS_BYTES
        seconds += all_gather_seconds(logits, mesh.model, bandwidth)
        seconds += SAMPLER_COLLECTIVES * COLLECTIVE_LATENCY_S
    return seconds


def stage_send_seconds(config: ModelConfig, hardware: HardwareSpec, mesh: MeshShape, *,
                       rows: int, tokens: int) -> float:
    """Activations [rows * tokens, D] from one stage to the next; 0 without pipelining."""
    if mesh.stage == 1:
        return 0.0
    activations = rows * tokens * config.hidden_size * bytes_per_element(config.dtype)
    return send_seconds(activations, stage_link_bandwidth(hardware, mesh))


# Devices are numbered row-major over (data, stage, model), a plain reshape of the device list,
# and nodes hold consecutive ids: a `model` group is consecutive, stage neighbours `model` apart.

def model_link_bandwidth(hardware: HardwareSpec, mesh: MeshShape) -> float:
    starts = range(0, mesh.num_devices, mesh.model)
    crosses = any(_node(hardware, s) != _node(hardware, s + mesh.model - 1) for s in starts)
    return _link(hardware, crosses)


def stage_link_bandwidth(hardware: HardwareSpec, mesh: MeshShape) -> float:
    senders = [i for i in range(mesh.num_devices) if (i // mesh.model) % mesh.stage
               != mesh.stage - 1]
    crosses = any(_node(hardware, i) != _node(hardware, i + mesh.model) for i in senders)
    return _link(hardware, crosses)


def _node(hardware: HardwareSpec, device: int) -> int:
    return device // hardware.per_node


def _link(hardware: HardwareSpec, crosses_nodes: bool) -> float:
    if not crosses_nodes:
        return hardware.link_bw
    assert hardware.inter_node_bw is not None, "plan() refuses multi-node meshes without it"
    return hardware.inter_node_bw


# --- Serving: the cycle of one replica ----------------------------------------------------------


def fill_drain_utilisation(microbatches: int, stages: int) -> float:
    """Share of a fill-drain round each stage is busy: M / (M + S - 1)."""
    return microbatches / (microbatches + stages - 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaCycle:
    """One data replica serving `rows` sequences: each is prefilled once and decodes `output`."""

    rows: int
    microbatches: int
    decode_tick: StepCost  # one microbatch's decode step on the largest stage
    decode_send_s: float  # ... its activations to the next stage
    decode_tick_s: float  # the two together
    prefill_tick_s: float  # one prompt on the largest stage, plus its send
    seconds: float
    busy_s: float  # per stage
    ttft_s: float
    tpot_s: float

    @property
    def utilisation(self) -> float:
        return self.busy_s / self.seconds


def replica_cycle(config: ModelConfig, hardware: HardwareSpec, mesh: MeshShape,
                  workload: Workload, options: PlanOptions, rows: int) -> ReplicaCycle:
    stages, prompt, output = mesh.stage, workload.prompt_len, workload.output_len
    microbatches = 1 if stages == 1 else min(options.microbatches or stages, rows)
    tick_rows = -(-rows // microbatches)
    decode = step_cost(config, hardware, mesh, rows=tick_rows, tokens=1,
                       context=workload.mean_decode_context)
    send = stage_send_seconds(config, hardware, mesh, rows=tick_rows, tokens=1)
    t_decode = decode.seconds + send
    t_prefill = (step_cost(config, hardware, mesh, rows=1, tokens=prompt, context=prompt).seconds
                 + stage_send_seconds(config, hardware, mesh, rows=1, tokens=prompt))
    decode_round = (microbatches + stages - 1) * t_decode
    seconds = output * decode_round + prefill_seconds(
        rows=rows, stages=stages, t_prefill=t_prefill,
        idle=output * (stages - 1) * t_decode if options.fill_bubbles else 0.0)
    return ReplicaCycle(rows=rows, microbatches=microbatches, decode_tick=decode,
                        decode_send_s=send, decode_tick_s=t_decode, prefill_tick_s=t_prefill,
                        seconds=seconds,
                        busy_s=output * microbatches * t_decode + rows * t_prefill,
                        ttft_s=decode_round + stages * t_prefill, tpot_s=seconds / output)


def prefill_seconds(*, rows: int, stages: int, t_prefill: float, idle: float) -> float:
    """Time a cycle adds for `rows` prompts piped through `stages`, after `idle` seconds of each
    stage's idle decode ticks have absorbed what they can."""
    left = rows * t_prefill - idle
    return left + (stages - 1) * t_prefill if left > 0 else 0.0


# --- Ranking the meshes -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshPlan:
    """The prediction for one mesh. `reason` says why it cannot serve (then the rates are None)."""

    mesh: MeshShape
    reason: str | None = None
    notes: tuple[str, ...] = ()
    weight_bytes: int | None = None  # per device
    kv_bytes_per_token: int | None = None  # per device
    max_batch: int | None = None  # sequences of the workload's context, all replicas
    batch: int | None = None  # sequences in flight: the concurrency, capped by max_batch
    decode_tick_s: float | None = None
    decode_memory_s: float | None = None  # of one decode tick: bytes / hbm_bw
    decode_compute_s: float | None = None  # ... flops / peak_flops
    tp_comm_s: float | None = None  # of one decode tick
    pp_send_s: float | None = None  # of one decode tick
    prefill_s: float | None = None  # one prompt, all stages
    utilisation: float | None = None  # of each stage, over a cycle
    ttft_s: float | None = None
    tpot_s: float | None = None
    throughput: float | None = None  # output tokens / s, all replicas
    meets_slo: bool = False

    @property
    def feasible(self) -> bool:
        return self.reason is None

    def slo_excess(self, slo: Slo) -> float:
        """How far the tighter SLO is missed, as a ratio (<= 1: met)."""
        return max(self.ttft_s / slo.ttft, self.tpot_s / slo.tpot)

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["mesh"] = dataclasses.asdict(self.mesh)
        out["notes"] = list(self.notes)
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    config: ModelConfig
    hardware: HardwareSpec
    num_devices: int
    workload: Workload
    slo: Slo
    options: PlanOptions
    # Ranked: those meeting the SLOs by throughput, then the rest by SLO excess, then infeasible.
    meshes: tuple[MeshPlan, ...]

    @property
    def recommended(self) -> MeshPlan | None:
        """The highest throughput meeting the SLOs."""
        return next((m for m in self.meshes if m.meets_slo), None)

    @property
    def closest(self) -> MeshPlan | None:
        """The recommended mesh, or else the feasible one that misses the SLOs least."""
        return next((m for m in self.meshes if m.feasible), None)

    def to_json(self) -> dict:
        closest = self.closest
        return {
            "model": dataclasses.asdict(self.config),
            "hardware": dataclasses.asdict(self.hardware),
            "devices": self.num_devices,
            "workload": dataclasses.asdict(self.workload),
            "slo": dataclasses.asdict(self.slo),
            "options": dataclasses.asdict(self.options),
            "recommended": None if self.recommended is None else str(self.recommended.mesh),
            "closest": None if closest is None else str(closest.mesh),
            "meshes": [m.to_json() for m in self.meshes],
        }


def plan(model: str | ModelConfig, hardware: HardwareSpec, num_devices: int, workload: Workload,
         slo: Slo = Slo(), options: PlanOptions = PlanOptions(), *,
         dtype: str | None = "bfloat16") -> Plan:
    """Predicts every mesh of `num_devices` and ranks them. `dtype` None keeps the config's."""
    config = resolve_model(model, dtype)
    hardware.peak_flops(config.dtype)  # refuses a dtype the hardware has no rate for
    if num_devices > hardware.per_node and hardware.inter_node_bw is None:
        raise ValueError(f"{num_devices} devices span nodes of {hardware.per_node}, but hardware "
                         f"{hardware.name} gives no inter_node_bw; give it, or plan at most "
                         f"{hardware.per_node} devices")
    predicted = [plan_mesh(config, hardware, mesh, workload, slo, options)
                 for mesh in mesh_shapes(num_devices)]
    return Plan(config=config, hardware=hardware, num_devices=num_devices, workload=workload,
                slo=slo, options=options, meshes=tuple(sorted(predicted,
                                                              key=lambda m: _rank(m, slo))))


def _rank(mesh_plan: MeshPlan, slo: Slo) -> tuple:
    if mesh_plan.meets_slo:
        return (0, -mesh_plan.throughput)
    if mesh_plan.feasible:
        return (1, mesh_plan.slo_excess(slo))
    return (2, 0.0)


def plan_mesh(config: ModelConfig, hardware: HardwareSpec, mesh: MeshShape, workload: Workload,
              slo: Slo, options: PlanOptions) -> MeshPlan:
    problem = structural_problem(config, mesh)
    if problem is not None:
        return MeshPlan(mesh=mesh, reason=problem)
    weights = device_weight_bytes(config, mesh)
    kv = device_kv_bytes_per_token(config, mesh)
    memory = dict(weight_bytes=weights, kv_bytes_per_token=kv)
    problem = memory_problem(hardware, workload, options.headroom, weights, kv)
    if problem is not None:
        return MeshPlan(mesh=mesh, reason=problem, **memory)
    max_batch = mesh.data * max_batch_per_replica(config, hardware, mesh, workload,
                                                  options.headroom)
    batch = max_batch if workload.concurrency is None else min(workload.concurrency, max_batch)
    cycles = [replica_cycle(config, hardware, mesh, workload, options, rows)
              for rows in rows_per_replica(batch, mesh.data) if rows]
    busiest = cycles[0]
    return MeshPlan(
        mesh=mesh, notes=mesh_notes(config, hardware, mesh, workload, max_batch,
                                    -(-busiest.rows // busiest.microbatches)), **memory,
        max_batch=max_batch, batch=batch, decode_tick_s=busiest.decode_tick_s,
        decode_memory_s=busiest.decode_tick.memory_s,
        decode_compute_s=busiest.decode_tick.compute_s,
        tp_comm_s=busiest.decode_tick.comm_s, pp_send_s=busiest.decode_send_s,
        prefill_s=mesh.stage * busiest.prefill_tick_s, utilisation=busiest.utilisation,
        ttft_s=busiest.ttft_s, tpot_s=busiest.tpot_s,
        throughput=sum(c.rows * workload.output_len / c.seconds for c in cycles),
        meets_slo=busiest.ttft_s <= slo.ttft and busiest.tpot_s <= slo.tpot)


def memory_problem(hardware: HardwareSpec, workload: Workload, headroom: float, weights: int,
                   kv_per_token: int) -> str | None:
    usable = usable_hbm(hardware, headroom)
    if weights > usable:
        return (f"weights need {weights / 1e9:.1f} GB per device, over the {usable / 1e9:.1f} GB "
                f"usable ({hardware.hbm / 1e9:.0f} GB less {headroom:.0%} headroom)")
    sequence = kv_per_token * workload.context_slots
    if weights + sequence > usable:
        return (f"weights leave {(usable - weights) / 1e9:.2f} GB per device, under one "
                f"{workload.context_slots}-token sequence's KV ({sequence / 1e9:.2f} GB)")
    return None


def rows_per_replica(batch: int, replicas: int) -> list[int]:
    """Rows dealt round robin: the busiest replica first."""
    return [batch // replicas + (1 if r < batch % replicas else 0) for r in range(replicas)]


def mesh_notes(config: ModelConfig, hardware: HardwareSpec, mesh: MeshShape, workload: Workload,
               max_batch: int, decode_rows: int = 1) -> tuple[str, ...]:
    notes = []
    stage = stage_config(config, mesh)
    if stage.num_kv_heads != config.num_kv_heads:
        notes.append(f"kv heads padded {config.num_kv_heads}->{stage.num_kv_heads}")
    if mesh.model > 1 and not is_vocab_split(config, mesh):
        notes.append(f"vocab {config.vocab_size} replicated over model={mesh.model}")
    if config.moe is not None:
        if mesh.model > 1 and not is_expert_split(config, mesh):
            notes.append(f"{config.moe.num_experts} experts replicated over model={mesh.model}")
        share = experts_read(config, decode_rows)
        if share < 0.995:  # the mixture's saving at small batch
            notes.append(f"a decode tick reads {share:.0%} of the experts")
    if model_link_bandwidth(hardware, mesh) != hardware.link_bw:
        notes.append("model axis crosses nodes")
    if mesh.stage > 1 and stage_link_bandwidth(hardware, mesh) != hardware.link_bw:
        notes.append("stages cross nodes")
    if workload.concurrency is not None and workload.concurrency > max_batch:
        notes.append(f"concurrency capped at {max_batch}")
    return tuple(notes)


def model_summary(config: ModelConfig) -> str:
    active = "" if config.moe is None else f", {config.num_active_params / 1e9:.2f}B active"
    return (f"{config.name} ({config.dtype}, {config.num_params / 1e9:.2f}B params{active}, "
            f"{weight_bytes(config) / 1e9:.1f} GB of weights)")
