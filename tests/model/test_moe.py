"""The mixture-of-experts MLP (meshserve.model.moe) and its families against HF transformers.

- The grouped matmul of sorted tokens equals every expert computed densely and then picked, and
  equals `jax.lax.ragged_dot` (on one device, and partitioned with its experts split over two
  fake devices), for groups that are empty, span several tiles or hold every row.
- Routing: softmax then top-k, renormalised or not.
- Tiny random Mixtral, Qwen2-MoE (shared expert) and Qwen3-MoE models saved by HF
  (tests/golden, scripts/make_moe_golden.py): logits of a full forward pass within 1e-4 of HF's
  and logprobs within 2e-3; a GGUF written with gguf's writer from the same weights loads to the
  same logits.
- Quantized experts: the grouped matmul on int8, int4 and mixed-block-type (GGUF) codes equals
  it on the dequantized float experts, one expert dequantized at a time (the compiled HLO's
  largest float buffer), and split over two fake devices by experts or by width as on one; a GGUF
  mixture's expert blocks (layers in different block types) load kept exactly under `auto` and
  generate the dequantized float model's greedy tokens; HF experts quantize at load like
  `quantize_model`; a quantized mixture's checkpoint round-trips, onto an expert-parallel mesh.
- Configs and checkpoints the model cannot run fail with a message naming the problem.
"""

import dataclasses
import functools
import json

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from meshserve.model import moe
from meshserve.model.config import ModelConfig, MoeConfig
from meshserve.model.executor.runner import ModelRunner, RunnerConfig
from meshserve.model.executor.steps import forward_dense
from meshserve.model.families import config_from_gguf, config_from_hf
from meshserve.model.loading import load_gguf, load_hf
from meshserve.model.loading.pretrained import load_pretrained, scheme_plans
from meshserve.model.quant_formats import (LayerMix, MixedArray, QuantFormat, QuantizedArray,
                                           dequantize, from_codes, quantize, scheme_format)
from meshserve.model.quantized_weights import quantize_model, quantized_arrays
from meshserve.model.transformer import create_model, model_from_params
from meshserve.serving.engine.greedy_reference import generate_greedy
from meshserve.sharding.experts import split_experts
from meshserve.sharding.rules import DEFAULT_RULES, ShardingRules
from tests.model.test_loaders import gguf_llama_metadata, llamacpp_permute, write_gguf
from tests.model.test_quant import _f32_buffers, random_blocks

FAMILIES = ["tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe"]


def dense_reference(x, chosen, weights, gate, up, down):
    """Every expert on every token, then the chosen ones weighted (numpy, float64)."""
    x, gate, up, down = (np.asarray(a, np.float64) for a in (x, gate, up, down))
    g, u = np.einsum("nd,edf->enf", x, gate), np.einsum("nd,edf->enf", x, up)
    every = np.einsum("enf,efd->ned", g / (1 + np.exp(-g)) * u, down)  # [N, E, D]
    picked = np.take_along_axis(every, np.asarray(chosen)[:, :, None], axis=1)  # [N, k, D]
    return np.einsum("nkd,nk->nd", picked, np.asarray(weights, np.float64))


def _expert_weights(rng, num_experts=4, dim=8, width=6):
    shape = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    return (shape(num_experts, dim, width), shape(num_experts, dim, width),
            shape(num_experts, width, dim))


@pytest.mark.parametrize("tile", [1, 2, 4, 16])
def test_grouped_swiglu_equals_every_expert_picked_and_ragged_dot(tile):
    rng = np.random.default_rng(0)
    gate, up, down = _expert_weights(rng)
    rows = jnp.asarray(rng.standard_normal((20, 8)), jnp.float32)
    # An empty group, groups spanning several tiles, and 3 rows past the groups (left 0).
    sizes = jnp.array([7, 0, 9, 1], jnp.int32)
    got = jax.jit(functools.partial(moe.grouped_swiglu, tile=tile))(rows, sizes, gate, up, down)
    experts = np.repeat(np.arange(4), np.asarray(sizes))
    want = dense_reference(rows[:17], experts[:, None], np.ones((17, 1)), gate, up, down)
    np.testing.assert_allclose(got[:17], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[17:], 0)
    ragged = moe.grouped_swiglu_ragged(rows, sizes, gate, up, down)
    np.testing.assert_allclose(got[:17], ragged[:17], rtol=1e-5, atol=1e-5)


def test_ragged_dot_runs_with_its_experts_split_over_a_fake_mesh():
    """jax.lax.ragged_dot on XLA:CPU, partitioned by XLA with the experts split over 2 devices."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    rng = np.random.default_rng(3)
    gate, up, down = _expert_weights(rng)
    rows = jnp.asarray(rng.standard_normal((20, 8)), jnp.float32)
    sizes = jnp.array([7, 0, 9, 1], jnp.int32)
    mesh = jax.make_mesh((2,), ("model",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:2])
    split = lambda a: jax.device_put(a, NamedSharding(mesh, PartitionSpec("model")))  # noqa: E731
    got = jax.jit(moe.grouped_swiglu_ragged)(rows, sizes, split(gate), split(up), split(down))
    assert len(got.sharding.device_set) == 2
    want = moe.grouped_swiglu(rows, sizes, gate, up, down, tile=4)
    np.testing.assert_allclose(got[:17], want[:17], rtol=1e-5, atol=1e-5)


def test_one_expert_taking_every_assignment_runs_them_all():
    rng = np.random.default_rng(1)
    gate, up, down = _expert_weights(rng)
    x = jnp.asarray(rng.standard_normal((9, 8)), jnp.float32)
    chosen = jnp.array([[2, 3]] * 9, jnp.int32)  # expert 2 gets 9 rows; a tile holds 8 at most
    weights = jnp.asarray(rng.uniform(size=(9, 2)), jnp.float32)
    got = jax.jit(functools.partial(moe.local_experts, first_expert=0))(
        x, chosen, weights, gate, up, down)
    np.testing.assert_allclose(got, dense_reference(x, chosen, weights, gate, up, down),
                               rtol=1e-5, atol=1e-5)


def test_local_experts_of_each_device_add_up_to_all_experts():
    """Expert parallelism's arithmetic: each device's share of the experts, summed."""
    rng = np.random.default_rng(2)
    gate, up, down = _expert_weights(rng)
    x = jnp.asarray(rng.standard_normal((6, 8)), jnp.float32)
    weights, chosen = moe.route(jnp.asarray(rng.standard_normal((6, 4)), jnp.float32), 2, True)
    local = jax.jit(moe.local_experts)
    shares = [local(x, chosen, weights, gate[i:i + 2], up[i:i + 2], down[i:i + 2],
                    first_expert=i) for i in (0, 2)]
    np.testing.assert_allclose(shares[0] + shares[1],
                               dense_reference(x, chosen, weights, gate, up, down),
                               rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(shares[0])).max() > 0 and np.abs(np.asarray(shares[1])).max() > 0


def test_routing_is_softmax_then_top_k_renormalised_or_not():
    logits = jnp.log(jnp.array([[0.1, 0.5, 0.3, 0.1]], jnp.float32))
    weights, chosen = moe.route(logits, 2, renormalize=False)
    assert chosen.tolist() == [[1, 2]]
    np.testing.assert_allclose(weights, [[0.5, 0.3]], rtol=1e-6)
    weights, _ = moe.route(logits, 2, renormalize=True)
    np.testing.assert_allclose(weights, [[0.625, 0.375]], rtol=1e-6)


def test_tile_rows_follow_the_expected_rows_per_expert():
    assert moe.tile_rows(2, 8) == 1  # a decode step of one token: one row per expert
    assert moe.tile_rows(64, 8) == 8
    assert moe.tile_rows(100, 8) == 16  # 13 rounded up
    assert moe.tile_rows(1 << 16, 8) == moe.MAX_TILE_ROWS


# --- Quantized experts -----------------------------------------------------------------------

# What `kept_format` keeps a stack whose layers mix Q6_K and Q4_K blocks in: codes in groups of
# 16, float32 scales and mins; in int8 on the CPU without native kernels, elsewhere in 6 bits
# (codes stored plus 32).
MIXED = QuantFormat(bits=8, group=16, num_contracted=1, num_out=1, has_mins=True)
MIXED_6 = QuantFormat(bits=6, group=16, num_contracted=1, num_out=1, has_mins=True, offset=32)
# Q6_K with Q4_K kept in their int8 sub-scales times a float32 scale per super group (of 64 here:
# the stacks' contracted axes are 64 and 128 long).
SUPER_6 = dataclasses.replace(MIXED_6, scale_dtype="int8", super_group=64)
EXPERT_FORMATS = {"int8": scheme_format("int8", 1, 1), "int4": scheme_format("int4", 1, 1),
                  "int4-g64": scheme_format("int4-g64", 1, 1), "mixed": MIXED,
                  "mixed-6-bit": MIXED_6, "super-6-bit": SUPER_6}


def _quantized_stacks(rng, fmt: QuantFormat, num_experts=4, dim=64, width=128):
    """gate, up [E, D, F] and down [E, F, D] in `fmt` (on the device), and their dequantized
    float32 weights."""
    stacks = []
    for shape in ((num_experts, dim, width), (num_experts, dim, width), (num_experts, width, dim)):
        if fmt in (MIXED, MIXED_6):  # codes of Q6_K's range, as a GGUF's blocks give them
            groups = (shape[0], shape[1] // 16, shape[2])
            q = from_codes(rng.integers(-32, 32, (groups[0], groups[1], 16, groups[2])),
                           rng.uniform(0.001, 0.01, groups), rng.uniform(-0.05, 0.05, groups),
                           fmt)
        elif fmt.super_group:  # integer sub-scales and mins, float32 d and -dmin
            groups = (shape[0], shape[1] // 16, shape[2])
            supers = (shape[0], shape[1] // fmt.super_group, shape[2])
            q = from_codes(rng.integers(-32, 32, (groups[0], groups[1], 16, groups[2])),
                           rng.integers(-64, 64, groups), rng.integers(0, 64, groups), fmt,
                           super_scales=rng.uniform(1e-4, 1e-3, supers),
                           super_mins=-rng.uniform(1e-4, 1e-3, supers))
        else:
            q = quantize(rng.standard_normal(shape).astype(np.float32) * 0.1, fmt)
        stacks.append(q)
    floats = [jnp.asarray(dequantize(q)) for q in stacks]
    return [q.map(jnp.asarray) for q in stacks], floats


@pytest.mark.parametrize("scheme", list(EXPERT_FORMATS))
def test_quantized_grouped_matmul_equals_it_on_the_dequantized_experts(scheme):
    rng = np.random.default_rng(5)
    quantized, floats = _quantized_stacks(rng, EXPERT_FORMATS[scheme])
    rows = jnp.asarray(rng.standard_normal((20, 64)), jnp.float32)
    sizes = jnp.array([7, 0, 9, 1], jnp.int32)
    grouped = jax.jit(functools.partial(moe.grouped_swiglu, tile=4))
    got, want = grouped(rows, sizes, *quantized), grouped(rows, sizes, *floats)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(got[17:], 0)
    # The ragged_dot cross-check dequantizes a quantized stack whole first.
    ragged = moe.grouped_swiglu_ragged(rows, sizes, *quantized)
    np.testing.assert_allclose(ragged[:17], want[:17], rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_tile_dequantizes_only_its_own_expert(scheme):
    """In the compiled grouped matmul of 8 quantized experts, the largest float32 buffer is one
    expert's kernel (int8) or half of it (int4, its low and high nibbles apart): the stack is
    never converted whole, nor hoisted out of the tile loop."""
    num_experts, dim, width = 8, 256, 512
    quantized, _ = _quantized_stacks(np.random.default_rng(6), EXPERT_FORMATS[scheme],
                                     num_experts, dim, width)
    rows = jnp.ones((12, dim), jnp.float32)
    sizes = jnp.array([3, 0, 2, 1, 0, 4, 0, 2], jnp.int32)
    grouped = jax.jit(functools.partial(moe.grouped_swiglu, tile=2))
    biggest = max(_f32_buffers(grouped.lower(rows, sizes, *quantized).compile().as_text()))
    assert biggest == (dim * width if scheme == "int8" else dim * width // 2)


@pytest.mark.parametrize("split", ["expert", "width"])
@pytest.mark.parametrize("scheme", ["int8", "int4", "mixed-6-bit", "super-6-bit"])
def test_quantized_experts_split_over_two_fake_devices_match_one_device(scheme, split):
    """Under shard_map the codes, scales and mins of each stack split by their own logical axes:
    each device holds 2 of the 4 experts, or half of every expert's width (down's codes and
    grouped scales split along the contracted axis, per-channel scales not at all; 6-bit codes
    in whole units of 32)."""
    rng = np.random.default_rng(7)
    quantized, _ = _quantized_stacks(rng, EXPERT_FORMATS[scheme])
    x = jnp.asarray(rng.standard_normal((6, 64)), jnp.float32)
    weights, chosen = moe.route(jnp.asarray(rng.standard_normal((6, 4)), jnp.float32), 2, True)
    mesh = jax.make_mesh((2,), ("model",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])
    axes = {"expert_axis": "model"} if split == "expert" else {"width_axis": "model"}
    routed = jax.jit(moe.routed_experts, static_argnums=6)
    one = routed(x, chosen, weights, *quantized, None)
    two = routed(x, chosen, weights, *quantized, moe.ExpertSplit(mesh, **axes))
    np.testing.assert_allclose(two, one, rtol=1e-5, atol=1e-5 * np.abs(one).max())


# A mixture written as llama.cpp writes Mixtral (`llama` with an expert count), rows of 256 so
# K-quants fit, every layer's experts stacked [E, out, in] in the block types a Q4_K_M file mixes:
# layer 0's ffn_down_exps in Q6_K and layer 1's in Q4_K, gate in Q4_0 then Q8_0.
MOE_256 = dict(D=256, F=256, L=2, H=4, K=2, V=64)
NUM_EXPERTS = 4
GGML = gguf.GGMLQuantizationType
EXPERT_TYPES = {"ffn_gate_exps": (GGML.Q4_0, GGML.Q8_0), "ffn_up_exps": (GGML.Q4_K, GGML.Q4_K),
                "ffn_down_exps": (GGML.Q6_K, GGML.Q4_K)}


@pytest.fixture(scope="module")
def quantized_moe_gguf(tmp_path_factory):
    d, e = MOE_256, NUM_EXPERTS
    rng = np.random.default_rng(8)
    w = lambda *shape, std=0.05: (rng.standard_normal(shape) * std).astype(np.float32)  # noqa: E731
    h = d["D"] // d["H"]
    tensors = {"token_embd.weight": w(d["V"], d["D"], std=1.0),
               "output_norm.weight": 1 + w(d["D"]), "output.weight": w(d["V"], d["D"])}
    for i in range(d["L"]):
        p = f"blk.{i}."
        tensors.update({
            p + "attn_norm.weight": 1 + w(d["D"]), p + "attn_q.weight": w(d["H"] * h, d["D"]),
            p + "attn_k.weight": w(d["K"] * h, d["D"]), p + "attn_v.weight": w(d["K"] * h, d["D"]),
            p + "attn_output.weight": w(d["D"], d["H"] * h), p + "ffn_norm.weight": 1 + w(d["D"]),
            p + "ffn_gate_inp.weight": w(e, d["D"], std=0.5)})
        for name, types in EXPERT_TYPES.items():
            rows, width = (d["D"], d["F"]) if name == "ffn_down_exps" else (d["F"], d["D"])
            qtype = types[i]
            if qtype in (GGML.Q4_0, GGML.Q8_0):
                raw = gguf.quants.quantize(w(e, rows, width), qtype)
            else:  # gguf cannot quantize K-quants: random blocks with weights of about 0.05
                raw = random_blocks(qtype, e * rows, width, seed=i, scale=2e-4).reshape(
                    e, rows, -1)
            tensors[f"{p}{name}.weight"] = (raw, qtype)
    meta = gguf_llama_metadata("llama", **d) | {"llama.expert_count": e,
                                                "llama.expert_used_count": 2}
    path = tmp_path_factory.mktemp("moe-gguf") / "moe.gguf"
    return write_gguf(path, "llama", meta, tensors)


@pytest.mark.parametrize("platform, want_bits", [("cpu", {"gate": 8, "up": 8, "down": 8}),
                                                 ("gpu", {"gate": (4, 8), "up": 4, "down": (6, 4)})])
def test_auto_keeps_a_gguf_mixtures_expert_blocks_exactly(quantized_moe_gguf, platform,
                                                          want_bits):
    """Every expert stack is kept and dequantizes to exactly the float loader's weights. Where
    the layers' codes keep in different widths (GPU: down Q6_K then Q4_K, gate Q4_0 then Q8_0)
    a mixed stack holds each layer in its own type's format; in 8-bit containers (the CPU
    without native kernels) one format holds every layer (down: Q6_K's groups of 16 and Q4_K's
    minimums; gate: Q4_0's minimums)."""
    _, floats = load_gguf(quantized_moe_gguf)
    _, params = load_gguf(quantized_moe_gguf, plans=scheme_plans("auto", platform=platform))
    experts = {key.split("/")[-1]: value for key, value in params.items()
               if key.startswith("layers/mlp/experts/")}
    bits = lambda f: tuple(p.bits for p in f.formats) if isinstance(f, LayerMix) else f.bits  # noqa: E731
    assert {name: bits(q.format) for name, q in experts.items()} == want_bits
    for name, q in experts.items():
        np.testing.assert_array_equal(dequantize(q), floats[f"layers/mlp/experts/{name}"])
    if platform == "cpu":
        down = experts["down"].format
        assert (down.group, down.has_mins, down.scale_dtype, down.super_group) == (
            16, True, "int8", 256)
        assert experts["gate"].format.has_mins
        return
    gate, up, down = (experts[name].format for name in ("gate", "up", "down"))
    assert gate.part_of == down.part_of == (0, 1)  # layer 0 the first part, layer 1 the second
    q6_k, q4_k = down.formats  # Q6_K's groups of 16, no mins; Q4_K's 32 with minimums
    assert (q6_k.group, q6_k.has_mins, q4_k.group, q4_k.has_mins) == (16, False, 32, True)
    assert (q6_k.scale_dtype, q4_k.scale_dtype, q6_k.super_group, q4_k.super_group) == (
        "int8", "uint8", 256, 256)  # integer sub-scales, float32 per 256
    assert (down.uniform.group, down.uniform.has_mins) == (16, True)  # where stages need one
    q4_0, q8_0 = gate.formats
    assert q4_0.has_mins and not q8_0.has_mins and q4_0.scale_dtype == "float16"
    assert (up.scale_dtype, up.super_group) == ("uint8", 256)
    for name, q in experts.items():
        assert isinstance(q, MixedArray if name != "up" else QuantizedArray)


def test_experts_whose_super_groups_a_width_split_would_cut_keep_their_width(quantized_moe_gguf):
    """Experts of width 256 hold one super group of 256 along down's contracted width: split
    over two devices, each would hold half of it, so the width is left whole; the same experts
    in float32 split."""
    config, floats = load_gguf(quantized_moe_gguf)
    _, params = load_gguf(quantized_moe_gguf, plans=scheme_plans("auto", platform="gpu"))
    mesh = jax.make_mesh((2,), ("model",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])
    rules = ShardingRules({**DEFAULT_RULES.table, "expert": None, "expert_ffw": "model"})
    kept = model_from_params(config, params)
    assert split_experts(kept, mesh, rules) is kept  # nothing to split
    split = split_experts(model_from_params(config, floats), mesh, rules).layers.mlp.split
    assert split.width_axis == "model"


def test_a_gguf_mixture_with_kept_experts_generates_the_float_models_tokens(quantized_moe_gguf):
    """auto as the engine loads it with native kernels (the file's own bits: gate and down are
    mixed stacks, each layer's experts in their own type's format, the grouped matmul of a
    layer run in its parts' branch) against the same file dequantized to float32: the same
    greedy tokens, and logprobs equal up to summation order through XLA's dots; through the
    native kernels (on by default on one CPU device), whose integer dots round x to 16 bits per
    group, within 1e-4 (measured: 2.6e-5)."""
    config, floats = load_gguf(quantized_moe_gguf)
    params = load_gguf(quantized_moe_gguf,
                       plans=scheme_plans("auto", platform="cpu", native=True))[1]
    kept = model_from_params(config, params)
    stacks = quantized_arrays(kept)
    assert set(stacks) == {"layers/mlp/experts/gate", "layers/mlp/experts/up",
                           "layers/mlp/experts/down"}
    assert {key for key, q in stacks.items() if isinstance(q, MixedArray)} == {
        "layers/mlp/experts/gate", "layers/mlp/experts/down"}
    outputs = []
    for model, native in ((model_from_params(config, floats), False), (kept, False), (kept, None)):
        runner = ModelRunner(model, RunnerConfig(num_pages=16, page_size=16, max_num_seqs=2,
                                                 max_num_batched_tokens=32, max_pages_per_seq=4,
                                                 native_kernels=native))
        outputs.append(generate_greedy(runner, [[1, 5, 9, 13], [7, 3, 2]], max_new_tokens=10))
    for want, xla, native in zip(*outputs):
        assert xla.token_ids == native.token_ids == want.token_ids
        np.testing.assert_allclose(xla.logprobs, want.logprobs, atol=1e-5)
        np.testing.assert_allclose(native.logprobs, want.logprobs, atol=1e-4)


def write_hf_mixtral(directory, golden_dir, *, D=64, F=64, H=2, K=1, E=4):
    """A random Mixtral saved as HF saves one (each expert's tensors apart), wide enough for
    int4's groups of 32: tiny-mixtral's config with these sizes."""
    from safetensors.numpy import save_file

    hf = _hf_mixtral(golden_dir) | dict(hidden_size=D, intermediate_size=F, num_attention_heads=H,
                                        num_key_value_heads=K, num_local_experts=E)
    rng = np.random.default_rng(9)
    w = lambda *shape: (rng.standard_normal(shape) * 0.1).astype(np.float32)  # noqa: E731
    h, V = D // H, hf["vocab_size"]
    tensors = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": 1 + w(D),
               "lm_head.weight": w(V, D)}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": 1 + w(D), p + "post_attention_layernorm.weight": 1 + w(D),
            p + "self_attn.q_proj.weight": w(H * h, D), p + "self_attn.k_proj.weight": w(K * h, D),
            p + "self_attn.v_proj.weight": w(K * h, D), p + "self_attn.o_proj.weight": w(D, H * h),
            p + "block_sparse_moe.gate.weight": w(E, D)})
        for e in range(E):
            q = f"{p}block_sparse_moe.experts.{e}."
            tensors.update({q + "w1.weight": w(F, D), q + "w3.weight": w(F, D),
                            q + "w2.weight": w(D, F)})
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(hf))
    return directory


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_hf_experts_quantize_as_they_load_like_quantize_model(golden_dir, tmp_path, scheme):
    """A Mixtral's experts (HF: each expert its own tensor) are quantized as they are read, as
    attention's kernels are, to what `quantize_model` makes of the float model."""
    directory = write_hf_mixtral(tmp_path / "mixtral", golden_dir)
    got = quantized_arrays(load_pretrained(str(directory), quantization=scheme).model)
    want = quantized_arrays(quantize_model(model_from_params(*load_hf(directory)), scheme))
    assert set(got) == set(want) == {
        "layers/attn/q/kernel", "layers/attn/k/kernel", "layers/attn/v/kernel",
        "layers/attn/o/kernel", "layers/mlp/experts/gate", "layers/mlp/experts/up",
        "layers/mlp/experts/down"}
    for key, q in want.items():
        assert got[key].format == q.format == scheme_format(scheme, q.format.num_contracted,
                                                           q.format.num_out)
        np.testing.assert_allclose(dequantize(got[key]), dequantize(q), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_mixtures_checkpoint_round_trips_onto_an_expert_parallel_mesh(scheme,
                                                                                  tmp_path):
    """The experts' codes, scales and mins are saved as ordinary arrays with their format in
    the manifest, restored bit for bit, and placed on `model=2` split as the float experts are:
    each device holds two of the four experts' codes and scales."""
    from meshserve.model.loading.checkpoint import load_checkpoint, read_manifest, save_checkpoint
    from meshserve.sharding.sharded_loading import load_sharded

    config = ModelConfig.preset("tiny-mixtral", head_dim=32)  # o's head_dim divides into 32s
    model = quantize_model(create_model(config), scheme)
    want = quantized_arrays(model)
    directory = save_checkpoint(model, None, tmp_path / "ckpt")
    assert read_manifest(directory).quantized == {key: q.format for key, q in want.items()}
    _, restored, _ = load_checkpoint(directory)
    placed = load_sharded(str(directory), "model=2").model
    for back in (quantized_arrays(restored), quantized_arrays(placed)):
        for key, q in want.items():
            assert back[key].format == q.format
            for name, array in q.arrays().items():
                np.testing.assert_array_equal(np.asarray(back[key].arrays()[name]),
                                              np.asarray(array), err_msg=f"{key}/{name}")
    for name, array in quantized_arrays(placed)["layers/mlp/experts/down"].arrays().items():
        shards = array.addressable_shards
        assert len(shards) == 2 and all(s.data.shape[1] == 2 for s in shards), name  # [L, E/2..]
    tokens = np.arange(12, dtype=np.int32).reshape(2, 6) % config.vocab_size
    np.testing.assert_allclose(_logits(placed, tokens), _logits(model, tokens), rtol=1e-5,
                               atol=1e-5)


# --- The families against HF ------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def _dense_logits(graphdef, params, tokens):
    rows, width = tokens.shape
    return forward_dense(graphdef, params, tokens, jnp.full((rows,), width))


def _logits(model, tokens) -> np.ndarray:
    from flax import nnx

    graphdef, params = nnx.split(model)
    return np.asarray(_dense_logits(graphdef, params, jnp.asarray(tokens)))


def _assert_logits_match(got, want):
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    logprob = lambda z: z - jax.scipy.special.logsumexp(z, axis=-1, keepdims=True)  # noqa: E731
    assert np.abs(logprob(got) - logprob(want)).max() < 2e-3


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, golden_dir):
    directory = golden_dir / request.param
    config, params = load_hf(directory)
    return directory, config, params, np.load(directory / "logits.npz")


def test_hf_checkpoint_loads_to_hf_logits(family):
    directory, config, params, reference = family
    hf = json.loads((directory / "config.json").read_text())
    assert config.moe.num_experts == 8 and config.moe.experts_per_token == 2
    assert config.moe.renormalize == (hf["model_type"] != "qwen2_moe")
    assert config.moe.shared_expert_size == hf.get("shared_expert_intermediate_size", 0)
    _assert_logits_match(_logits(model_from_params(config, params), reference["input_ids"]),
                         reference["logits"])


def test_gguf_written_from_the_same_weights_loads_to_hf_logits(family, tmp_path):
    directory, config, _, reference = family
    path = write_moe_gguf(directory, tmp_path / "model.gguf")
    gguf_config, params = load_gguf(path)
    assert gguf_config.moe == config.moe
    assert (gguf_config.qkv_bias, gguf_config.qk_norm) == (config.qkv_bias, config.qk_norm)
    _assert_logits_match(_logits(model_from_params(gguf_config, params),
                                 reference["input_ids"]), reference["logits"])


# llama.cpp's converter writes Mixtral as `llama` (Q and K rows permuted for its RoPE) with an
# expert count, Qwen2-MoE as `qwen2moe` and Qwen3-MoE as `qwen3moe`; experts stacked
# [E, out, in] as `ffn_*_exps`.
GGUF_ARCHS = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
GGUF_ATTENTION = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
                  "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                  "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
                  "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                  "block_sparse_moe.gate": "ffn_gate_inp", "mlp.gate": "ffn_gate_inp",
                  "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
                  "mlp.shared_expert.up_proj": "ffn_up_shexp",
                  "mlp.shared_expert.down_proj": "ffn_down_shexp",
                  "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
GGUF_EXPERTS = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps",
                "gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                "down_proj": "ffn_down_exps"}


def write_moe_gguf(directory, path):
    """The HF checkpoint in `directory` as llama.cpp's converter would write it (F32)."""
    hf = json.loads((directory / "config.json").read_text())
    arch = GGUF_ARCHS[hf["model_type"]]
    tensors = load_file(directory / "model.safetensors")
    out = {"token_embd.weight": tensors.pop("model.embed_tokens.weight"),
           "output_norm.weight": tensors.pop("model.norm.weight"),
           "output.weight": tensors.pop("lm_head.weight")}
    experts: dict[str, list] = {}
    for name in sorted(tensors, key=_natural):
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        module, _, kind = rest.rpartition(".")
        if ".experts." in module:  # ...experts.{e}.w1
            projection = module.rsplit(".", 1)[1]
            experts.setdefault(f"blk.{layer}.{GGUF_EXPERTS[projection]}.{kind}", []).append(
                tensors[name])
            continue
        value = tensors[name]
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = hf["num_attention_heads" if "q_proj" in module else "num_key_value_heads"]
            value = llamacpp_permute(value, heads)
        if module == "mlp.shared_expert_gate":
            value = value.reshape(-1)  # llama.cpp keeps it a vector
        out[f"blk.{layer}.{GGUF_ATTENTION[module]}.{kind}"] = value
    out.update({name: np.stack(parts) for name, parts in experts.items()})
    meta = {f"{arch}.block_count": hf["num_hidden_layers"],
            f"{arch}.context_length": hf["max_position_embeddings"],
            f"{arch}.embedding_length": hf["hidden_size"],
            f"{arch}.feed_forward_length": hf["intermediate_size"],
            f"{arch}.attention.head_count": hf["num_attention_heads"],
            f"{arch}.attention.head_count_kv": hf["num_key_value_heads"],
            f"{arch}.rope.freq_base": float(hf["rope_theta"]),
            f"{arch}.attention.layer_norm_rms_epsilon": float(hf["rms_norm_eps"]),
            f"{arch}.expert_count": hf.get("num_local_experts") or hf["num_experts"],
            f"{arch}.expert_used_count": hf["num_experts_per_tok"]}
    if "moe_intermediate_size" in hf:
        meta[f"{arch}.expert_feed_forward_length"] = hf["moe_intermediate_size"]
    if hf.get("shared_expert_intermediate_size"):
        meta[f"{arch}.expert_shared_feed_forward_length"] = hf["shared_expert_intermediate_size"]
    return write_gguf(path, arch, meta, out)


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in name.split(".")]


# --- What cannot run --------------------------------------------------------------------------


def _hf_mixtral(golden_dir) -> dict:
    return json.loads((golden_dir / "tiny-mixtral" / "config.json").read_text())


@pytest.mark.parametrize("change, message", [
    (dict(model_type="qwen2_moe", num_experts=8, moe_intermediate_size=16, decoder_sparse_step=2),
     "dense MLP layers among the sparse ones"),
    (dict(model_type="qwen2_moe", num_experts=8, moe_intermediate_size=16, mlp_only_layers=[1]),
     r"mlp_only_layers=\[1\]"),
    (dict(hidden_act="gelu"), "expert activation 'gelu' is not supported"),
    (dict(num_experts_per_tok=9), r"experts_per_token \(9\) must be at most num_experts \(8\)"),
    (dict(model_type="olmoe"), "model_type 'olmoe' is not supported"),
])
def test_configs_meshserve_cannot_run_are_refused_by_name(golden_dir, change, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf(_hf_mixtral(golden_dir) | change)


def test_gguf_architectures_without_a_mapping_are_refused_by_name():
    with pytest.raises(ValueError, match="GGUF architecture 'deepseek2' is not supported"):
        config_from_gguf({"general.architecture": "deepseek2"})


def test_a_checkpoint_missing_an_expert_names_the_tensor(golden_dir, tmp_path):
    from safetensors.numpy import save_file

    tensors = load_file(golden_dir / "tiny-mixtral" / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    (tmp_path / "config.json").write_text(json.dumps(_hf_mixtral(golden_dir)))
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks tensor 'model\.layers\.1\.block_sparse_moe\."
                                         r"experts\.\{e\}\.w3\.weight'"):
        load_hf(tmp_path)


def test_moe_config_round_trips_through_a_checkpoints_json():
    from meshserve.model.loading.checkpoint import config_from_json, config_to_json

    config = ModelConfig.preset("tiny-mixtral", qk_norm=True)
    assert config_from_json(config_to_json(config)) == config
    with pytest.raises(ValueError, match=r"moe fields .* unknown \['experts'\], missing "
                                         r"\['num_experts'\]"):
        config_from_json(config_to_json(config).replace('"num_experts"', '"experts"'))


def test_moe_config_counts_total_and_active_parameters():
    mixtral = ModelConfig.preset("mixtral-8x7b")
    # Mistral AI's figures for Mixtral 8x7B: 46.7B parameters, 12.9B used per token.
    assert round(mixtral.num_params / 1e9, 1) == 46.7
    assert round(mixtral.num_active_params / 1e9, 1) == 12.9
    dense = ModelConfig.preset("tiny-llama")
    assert dense.num_active_params == dense.num_params
    with pytest.raises(ValueError, match="needs the llama architecture"):
        ModelConfig.preset("tiny-gpt2", moe=MoeConfig(num_experts=2, experts_per_token=1,
                                                      renormalize=True))
