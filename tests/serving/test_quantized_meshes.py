"""Quantized weights on meshes: a tensor-, data- and pipeline-parallel engine gives the tokens
and logprobs of one device with the same quantized weights, the codes and scales are split the way
the float kernels are, and an orbax checkpoint of a sharded quantized model restores them
exactly, on another mesh too. A mixture's quantized experts split over `model` (expert
parallelism) give one device's tokens too. A Q4_K_M-like file's mixed stacks (v and down: Q4_K
and Q6_K layers, each format in its own part) split part by part over `model`, and become one
stack where pipeline stages split the layers, in the engine and in the loaders alike."""

import numpy as np
import pytest
from flax import nnx

from meshserve import LoRARequest
from meshserve.batching.sampling import SamplingParams
from meshserve.model.loading import load_gguf
from meshserve.model.loading.checkpoint import load_checkpoint, read_manifest, save_checkpoint
from meshserve.model.loading.pretrained import scheme_plans
from meshserve.model.config import ModelConfig
from meshserve.model.quant_formats import MixedArray, QuantizedArray, dequantize
from meshserve.model.quantized_kernel import MixedKernel, QuantizedKernel
from meshserve.model.quantized_weights import quantize_model, quantized_arrays, uniform_layers
from meshserve.model.transformer import model_from_params
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.core import Engine
from meshserve.sharding.head_padding import pad_heads
from meshserve.sharding.mesh import MeshConfig
from meshserve.sharding.sharded_loading import MeshPlacement, load_sharded
from tests.conftest import random_params
from tests.model.test_quant import q4_k_m_gguf  # noqa: F401 - a fixture
from tests.model.test_lora import write_adapter
from tests.model.test_moe import quantized_moe_gguf  # noqa: F401 - a fixture
from tests.serving.test_meshes import ENGINE, _assert_same, _run, _tiny_requests, _top_logprobs

# head_dim 32: the o projection's contracted head_dim divides into int4 groups of 32. Three
# layers: two pipeline stages pad the stack to four with a layer of zero codes and scales.
CONFIG = ModelConfig.preset("tiny-llama", head_dim=32, num_layers=3)
REQUESTS = _tiny_requests()[:3]
# The one-device reference runs XLA's dots, as a mesh does: native kernels (on by default on one
# CPU device) round x to 16 bits in their integer dots, a difference of their own, held to its
# bound in tests/model/test_native_dot.py, not the sharding's.
XLA_DOTS = dict(native_kernels=False)


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized(request):
    """(scheme, a quantized tiny model, its one-device outputs)."""
    model = quantize_model(model_from_params(CONFIG, random_params(CONFIG)), request.param)
    want = _run(Engine.from_model(model, None, EngineConfig(**ENGINE, **XLA_DOTS)), REQUESTS)
    return request.param, model, want


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["data=2,model=2"])
def test_quantized_mesh_matches_one_device(quantized, mesh):
    scheme, model, want = quantized
    engine = Engine.from_model(model, None, EngineConfig(mesh=mesh, **ENGINE))
    _assert_same(_run(engine, REQUESTS), want)
    # down is row-parallel: its codes split over the contracted ffw axis, and so do grouped
    # scales; per-channel scales (int8) belong to the output axis, which is not split.
    kernel = engine.runner.params["layers"]["mlp"]["down"]["kernel"]
    split = {name: "model" in tuple(kernel[name].get_value().sharding.spec)
             for name in ("values", "scales")}
    assert split == {"values": True, "scales": scheme == "int4"}


@pytest.mark.slow
@pytest.mark.parametrize("quantized", ["int4"], indirect=True)
@pytest.mark.parametrize("mesh", ["stage=2,model=2"])
def test_quantized_stages_match_one_device(quantized, mesh):
    """Each stage holds its own layers' codes and scales (the padded fourth layer's are zeros)
    and runs them through the same quantized matmul. int4 only: stages pad and split every
    quantized array alike, and int4 has the most of them (grouped scales and mins beside its
    codes); int8 on a mesh is the test above."""
    scheme, model, want = quantized
    engine = Engine.from_model(model, None, EngineConfig(mesh=mesh, **ENGINE))
    _assert_same(_run(engine, REQUESTS), want)
    kernel = engine.runner.params["layers"]["mlp"]["down"]["kernel"]
    values = kernel["values"].get_value()
    assert values.shape[0] == 4 and "stage" in tuple(values.sharding.spec)
    np.testing.assert_array_equal(np.asarray(kernel["scales"].get_value())[3], 0)


@pytest.mark.slow
def test_quantized_checkpoint_round_trips_onto_another_mesh(quantized, tmp_path):
    scheme, model, want = quantized
    engine = Engine.from_model(model, None, EngineConfig(mesh="model=2", **ENGINE))
    sharded = nnx.merge(engine.runner.graphdef, engine.runner.params)  # as the mesh holds it
    directory = save_checkpoint(sharded, None, tmp_path / "ckpt")
    assert set(read_manifest(directory).quantized) == set(quantized_arrays(model))
    _, restored, _ = load_checkpoint(directory)
    for key, q in quantized_arrays(model).items():
        back = quantized_arrays(restored)[key]
        assert back.format == q.format
        for name, array in q.arrays().items():
            np.testing.assert_array_equal(np.asarray(back.arrays()[name]), np.asarray(array))
    loaded = load_sharded(str(directory), "data=2,model=2")
    engine = Engine.from_model(loaded.model, None, EngineConfig(mesh="data=2,model=2", **ENGINE))
    _assert_same(_run(engine, REQUESTS), want)


# A mixture: attention and the routed experts quantized (head_dim 32 for int4's groups).
MOE_CONFIG = ModelConfig.preset("tiny-mixtral", head_dim=32)


@pytest.mark.slow
def test_quantized_experts_on_an_expert_parallel_mesh_match_one_device():
    """int4 experts: each device holds the codes, scales and mins of 2 of the 4 experts and runs
    its tiles on them; one psum adds the devices' shares. (int8's per-channel scales split the
    same way: tests/model/test_moe.py.)"""
    model = quantize_model(model_from_params(MOE_CONFIG, random_params(MOE_CONFIG)), "int4")
    engine_config = dict(ENGINE, max_num_batched_tokens=16, prefill_chunk=16)
    requests = REQUESTS[:2]
    want = _run(Engine.from_model(model, None, EngineConfig(**engine_config, **XLA_DOTS)),
                requests)
    engine = Engine.from_model(model, None, EngineConfig(mesh="model=2", **engine_config))
    _assert_same(_run(engine, requests), want)
    gate = engine.runner.params["layers"]["mlp"]["experts"]["gate"]
    for name in ("values", "scales", "mins"):
        array = gate[name].get_value()
        assert array.sharding.spec[1] == "model", name  # [L, E, ...]: the experts split
        assert array.addressable_shards[0].data.shape[1] == 2, name


Q4_K_M_ENGINE = ENGINE | dict(max_model_len=64)


@pytest.mark.slow
def test_mixed_expert_stacks_on_an_expert_parallel_mesh_match_one_device(quantized_moe_gguf):  # noqa: F811
    """A GGUF mixture whose gate and down stacks mix block types across layers, in the file's
    own widths (mixed stacks): on model=2 each part's experts split over the devices, the
    layer's grouped matmul runs in its parts' branch on each device's experts, and the engine
    gives one device's tokens."""
    config, params = load_gguf(quantized_moe_gguf, plans=scheme_plans("auto", platform="gpu"))
    model = model_from_params(config, params)
    assert isinstance(model.layers.mlp.experts.down, MixedKernel)
    engine_config = dict(ENGINE, max_num_batched_tokens=16, prefill_chunk=16, max_model_len=64)
    rng = np.random.default_rng(3)
    requests = [(rng.integers(3, config.vocab_size, size=length).tolist(),
                 SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=5))
                for length in (4, 11)]
    want = _run(Engine.from_model(model, None, EngineConfig(**engine_config, **XLA_DOTS)),
                requests)
    engine = Engine.from_model(model, None, EngineConfig(mesh="model=2", **engine_config))
    _assert_same(_run(engine, requests), want)
    down = engine.runner.params["layers"]["mlp"]["experts"]["down"]
    for stack in _stacks(down):
        for name in ("values", "scales"):
            array = stack[name].get_value()
            assert array.sharding.spec[1] == "model", name  # [L part, E, ...]: experts split
            assert array.addressable_shards[0].data.shape[1] == 2, name


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def q4_k_m_reference(request, q4_k_m_gguf):  # noqa: F811
    """(a Q4_K_M-like file's model loaded with "auto"'s plan on one platform, requests, its
    one-device outputs). On the CPU every kernel is kept in 8-bit containers with the file's
    integer sub-scales and float32 scales per super group; on GPUs in the file's own widths,
    so v and down, whose layers are Q4_K and Q6_K, are mixed stacks."""
    config, params = load_gguf(q4_k_m_gguf, plans=scheme_plans("auto", platform=request.param))
    model = model_from_params(config, params)
    mixed = {key for key, value in params.items() if isinstance(value, MixedArray)}
    assert mixed == ({"layers/attn/v/kernel", "layers/mlp/down/kernel"}
                     if request.param == "gpu" else set())
    rng = np.random.default_rng(1)
    requests = [(rng.integers(3, config.vocab_size, size=length).tolist(),
                 SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5))
                for length in (5, 17, 30)]
    want = _run(Engine.from_model(model, None, EngineConfig(**Q4_K_M_ENGINE, **XLA_DOTS)),
                requests)
    return model, requests, want


def _stacks(kernel) -> list:
    """The states of a quantized kernel's stacks: its own, or a mixed kernel's parts'."""
    return list(kernel["parts"].values()) if "parts" in kernel else [kernel]


@pytest.mark.slow
def test_k_quant_super_groups_on_a_tensor_parallel_mesh_match_one_device(q4_k_m_reference):
    """A Q4_K_M-like file's kernels kept with their integer sub-scales and float32 scales per
    super group: on model=2 the codes and (super) scales split as the float kernel does (down's
    along its contracted ffw axis, o's along its heads; a mixed stack's in each part), and the
    engine gives one device's tokens."""
    model, requests, want = q4_k_m_reference
    engine = Engine.from_model(model, None, EngineConfig(mesh="model=2", **Q4_K_M_ENGINE))
    _assert_same(_run(engine, requests), want)
    layers = engine.runner.params["layers"]
    down = layers["mlp"]["down"]["kernel"]
    assert len(_stacks(down)) == (2 if isinstance(model.layers.mlp.down.kernel, MixedKernel)
                                  else 1)
    for kernel in (down, layers["attn"]["o"]["kernel"]):  # [L, ffw, D] and [L, heads, hd, D]
        for stack in _stacks(kernel):
            for name in ("values", "scales", "super_scales", "super_mins"):
                if name in stack:  # (Q6_K has no mins)
                    spec = tuple(stack[name].get_value().sharding.spec)
                    assert len(spec) > 1 and spec[1] == "model", (name, spec)


@pytest.mark.slow
@pytest.mark.parametrize("q4_k_m_reference", ["gpu"], indirect=True)
def test_mixed_stacks_on_pipeline_stages_match_one_device(q4_k_m_reference):
    """Stages split the layer axis, which a mixed stack's parts cannot follow: the engine holds
    each as one stack in the format that holds all its layers (exactly), split over the stages,
    and gives one device's tokens; the model it was given keeps its mixed stacks."""
    model, requests, want = q4_k_m_reference
    engine = Engine.from_model(model, None, EngineConfig(mesh="stage=2", **Q4_K_M_ENGINE))
    _assert_same(_run(engine, requests), want)
    served = _v_and_down(nnx.merge(engine.runner.graphdef, engine.runner.params))
    for name, given in _v_and_down(model).items():
        held = served[name]
        assert isinstance(given, MixedKernel), name
        assert isinstance(held, QuantizedKernel) and held.fmt == given.mix.uniform, name
        assert tuple(held.values.get_value().sharding.spec)[0] == "stage", name


@pytest.mark.slow
@pytest.mark.parametrize("q4_k_m_reference", ["gpu"], indirect=True)
def test_a_lora_adapter_on_mixed_stacks_gives_one_formats_tokens(q4_k_m_reference, tmp_path):
    """An adapter on v and down, whose kernels are mixed stacks: its slabs take the kernels'
    float axes, and each layer adds its delta to its part's product: the tokens and logprobs of
    the same model with each mixed stack widened to one format and the same adapter (which
    does move them off the base model's)."""
    model, requests, base = q4_k_m_reference
    c = model.config
    rng = np.random.default_rng(2)
    sizes = {"self_attn.v_proj": (c.hidden_size, c.num_kv_heads * c.head_dim),
             "mlp.down_proj": (c.intermediate_size, c.hidden_size)}
    tensors = {}
    for layer in range(c.num_layers):
        for module, (n_in, n_out) in sizes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.1, (4, n_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.1, (n_out, 4)).astype(np.float32)
    adapter = LoRARequest("mixed", 1, str(write_adapter(
        tmp_path / "adapter", modules=("v_proj", "down_proj"), rank=4, tensors=tensors)))
    outputs = []
    for served in (model, uniform_layers(model)):
        engine = Engine.from_model(served, None, EngineConfig(
            **Q4_K_M_ENGINE, **XLA_DOTS, enable_lora=True, max_lora_rank=4))
        ids = [engine.add_request(prompt, params, lora_request=adapter)
               for prompt, params in requests]
        finished = {}
        while engine.has_unfinished():
            finished |= {out.request_id: out.outputs[0] for out in engine.step() if out.finished}
        outputs.append([finished[i] for i in ids])
    _assert_same(*outputs)
    assert not np.allclose(_top_logprobs(outputs[0][0]), _top_logprobs(base[0]), atol=1e-2)


def _v_and_down(model: nnx.Module) -> dict:
    return {"v": model.layers.attn.v.kernel, "down": model.layers.mlp.down.kernel}


@pytest.mark.slow
def test_mixed_stacks_load_and_restore_onto_meshes(q4_k_m_gguf, tmp_path):  # noqa: F811
    """With native kernels' plan the loader keeps v and down as mixed stacks. Placed on stage=2
    each becomes one stack in its uniform format, of the same weights; on model=2 it stays
    mixed, each part split over `model` as the float kernel is; and a checkpoint of the
    one-device model restores onto model=2 (and onto stage=2 as one stack, as placed). Every
    other kernel is the one-device load's, array
    for array (heads padded for model=2)."""
    plans = scheme_plans("auto", platform="cpu", native=True)
    config, params = load_gguf(q4_k_m_gguf, plans=plans)
    model = model_from_params(config, params)
    mix = model.layers.mlp.down.kernel.mix
    directory = save_checkpoint(model, None, tmp_path / "ckpt")
    want = {mesh: quantized_arrays(pad_heads(model, MeshConfig.coerce(mesh).model))
            for mesh in ("stage=2", "model=2")}
    for mesh in want:
        # load_sharded's placement, here without its tokenizer (the file has none)
        placement = MeshPlacement(MeshConfig.coerce(mesh))
        placed = placement.model(*load_gguf(q4_k_m_gguf, place=placement, plans=plans))
        got = quantized_arrays(placed)
        _assert_same_weights(got, want[mesh])
        widened = {key for key, q in got.items() if q.format != want[mesh][key].format}
        assert widened == ({"layers/attn/v/kernel", "layers/mlp/down/kernel"}
                           if mesh == "stage=2" else set())
        down = got["layers/mlp/down/kernel"]
        if mesh == "stage=2":
            assert isinstance(down, QuantizedArray) and down.format == mix.uniform
            assert tuple(down.values.sharding.spec)[0] == "stage"
        else:
            assert isinstance(down, MixedArray) and down.format == mix
            _assert_split_over_model(down)
    restored = quantized_arrays(load_sharded(str(directory), "model=2").model)
    assert {key: q.format for key, q in restored.items()} \
        == {key: q.format for key, q in want["model=2"].items()}
    _assert_same_weights(restored, want["model=2"])
    _assert_split_over_model(restored["layers/mlp/down/kernel"])
    staged = quantized_arrays(load_sharded(str(directory), "stage=2").model)  # one stack each
    assert staged["layers/mlp/down/kernel"].format == mix.uniform
    _assert_same_weights(staged, want["stage=2"])


def _assert_same_weights(got: dict, want: dict) -> None:
    """Each kernel's arrays bit for bit where its format is kept, else (a mixed stack held as one)
    its float weights."""
    assert set(got) == set(want)
    for key, q in want.items():
        if got[key].format != q.format:
            np.testing.assert_array_equal(dequantize(got[key]), dequantize(q), err_msg=key)
            continue
        for name, array in q.arrays().items():
            np.testing.assert_array_equal(np.asarray(got[key].arrays()[name]), np.asarray(array),
                                          err_msg=f"{key}/{name}")


def _assert_split_over_model(down: MixedArray) -> None:
    """Each part's codes and scales of a down stack [L, ffw, D] split along ffw."""
    for part in down.parts:
        for name in ("values", "scales"):
            spec = tuple(getattr(part, name).sharding.spec)
            assert len(spec) > 1 and spec[1] == "model", (name, spec)
