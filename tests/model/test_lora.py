"""LoRA on the model side: PEFT directories read into the canonical layout (and everything the
slabs cannot serve refused by name), the slabs' delta on float and quantized kernels, and what a
slot holds once written.

The adapters here are written by hand in PEFT's format, so that each refusal has a file of its
own; tests/serving/test_lora.py writes them with peft itself and checks HF's tokens.
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from meshserve.model.config import ModelConfig
from meshserve.model.executor.lora_slabs import LoraSlabs, slot_values
from meshserve.model.loading.lora_files import load_lora
from meshserve.model.lora import LoraShape, token_selection, with_lora
from meshserve.model.quantized_weights import quantize_model
from meshserve.model.transformer import model_from_params
from tests.conftest import random_params

CONFIG = ModelConfig.preset("tiny-llama")  # D 64, 4 heads of 16 (2 kv heads), F 128, 2 layers
SIZES = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
         "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}  # (in, out)


def _peft_tensors(modules, rank: int, *, seed: int = 0, layers=(0, 1)) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in layers:
        for module in modules:
            parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            n_in, n_out = SIZES[module]
            tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((rank, n_in), np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((n_out, rank), np.float32)
    return tensors


def write_adapter(directory, *, modules=("q_proj", "v_proj"), rank: int = 4, alpha=8,
                  tensors=None, **fields):
    directory.mkdir(parents=True, exist_ok=True)
    config = dict(peft_type="LORA", r=rank, lora_alpha=alpha, target_modules=list(modules),
                  bias="none", use_rslora=False, use_dora=False, modules_to_save=None) | fields
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(_peft_tensors(modules, rank) if tensors is None else tensors,
              str(directory / "adapter_model.safetensors"))
    return directory


@pytest.mark.parametrize("rslora", [False, True])
def test_peft_tensors_become_canonical_a_and_scaled_b(tmp_path, rslora):
    modules = ("q_proj", "o_proj", "down_proj")
    write_adapter(tmp_path, modules=modules, rank=4, alpha=8, use_rslora=rslora)
    adapter = load_lora(tmp_path, CONFIG, max_rank=8)
    scaling = 8 / math.sqrt(4) if rslora else 8 / 4
    assert adapter.scaling == scaling and adapter.rank == 4
    assert set(adapter.weights) == {"layers/attn/q", "layers/attn/o", "layers/mlp/down"}
    tensors = _peft_tensors(modules, 4)
    prefix = "base_model.model.model.layers.1.self_attn"
    a, b = adapter.weights["layers/attn/o"]
    assert a.shape == (2, 4, 16, 4) and b.shape == (2, 4, 64)  # o's input is (heads, head_dim)
    lora_a = tensors[f"{prefix}.o_proj.lora_A.weight"]
    lora_b = tensors[f"{prefix}.o_proj.lora_B.weight"]
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    want = x @ lora_a.T @ lora_b.T * scaling  # PEFT's delta: scaling * B(A(x))
    got = x @ a[1].reshape(64, 4) @ b[1]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    a, b = adapter.weights["layers/attn/q"]
    assert a.shape == (2, 64, 4) and b.shape == (2, 4, 4, 16)  # q's output is (heads, head_dim)


def test_on_padded_heads_an_adapter_keeps_the_heads_of_its_model(tmp_path):
    """A mesh of model=4 pads tiny-llama's 2 kv heads to 4 (4 query heads to 8): the adapter's
    tensors still have 2 and 4, which pad to the served counts; without padding they do not fit."""
    write_adapter(tmp_path, modules=("q_proj", "k_proj", "o_proj"))
    padded = CONFIG.replace(num_heads=8, num_kv_heads=4)
    adapter = load_lora(tmp_path, padded, max_rank=4, head_multiple=4)
    assert adapter.weights["layers/attn/q"][1].shape == (2, 4, 4, 16)
    assert adapter.weights["layers/attn/k"][1].shape == (2, 4, 2, 16)
    assert adapter.weights["layers/attn/o"][0].shape == (2, 4, 16, 4)
    with pytest.raises(ValueError, match="has shape"):
        load_lora(tmp_path, padded, max_rank=4)
    with pytest.raises(ValueError, match="has shape"):  # 2 kv heads do not pad to 6 by 3
        load_lora(tmp_path, CONFIG.replace(num_heads=12, num_kv_heads=6), max_rank=4,
                  head_multiple=3)


def test_layers_left_out_hold_zeros(tmp_path):
    write_adapter(tmp_path, tensors=_peft_tensors(("q_proj", "v_proj"), 4, layers=(1,)),
                  layers_to_transform=[1])
    a, b = load_lora(tmp_path, CONFIG, max_rank=4).weights["layers/attn/v"]
    assert not a[0].any() and not b[0].any() and a[1].any() and b[1].any()


def _refusal_cases(tmp_path):
    """(adapter directory, what the error names) for everything the slabs cannot serve."""
    cases = []
    for field, value in (("use_dora", True), ("modules_to_save", ["lm_head"]),
                         ("bias", "lora_only"), ("rank_pattern", {"q_proj": 8}),
                         ("fan_in_fan_out", True), ("lora_bias", True)):
        cases.append((write_adapter(tmp_path / field, **{field: value}), field))
    cases.append((write_adapter(tmp_path / "rank", rank=16), "max_lora_rank"))
    q_only = _peft_tensors(("q_proj",), 4)
    cases.append((write_adapter(tmp_path / "lm_head", modules=("q_proj", "lm_head"),
                                tensors=q_only), "lm_head"))
    cases.append((write_adapter(tmp_path / "fused", modules=("qkv_proj",), tensors=q_only),
                  "qkv_proj"))
    embed = q_only | {"base_model.model.model.embed_tokens.lora_embedding_A": np.zeros(
        (4, 512), np.float32)}
    cases.append((write_adapter(tmp_path / "embed", modules=("q_proj",), tensors=embed),
                  "embed_tokens"))
    cases.append((write_adapter(tmp_path / "prompt", peft_type="PROMPT_TUNING"), "peft_type"))
    cases.append((write_adapter(tmp_path / "r", rank=4, r="four"), "r must be"))
    cases.append((write_adapter(tmp_path / "alpha", alpha="big"), "lora_alpha"))
    wrong = _peft_tensors(("q_proj",), 4)
    wrong["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"] = np.zeros(
        (576, 4), np.float32)
    cases.append((write_adapter(tmp_path / "shape", modules=("q_proj",), tensors=wrong),
                  "has shape"))
    partial = _peft_tensors(("q_proj",), 4, layers=(0,))
    cases.append((write_adapter(tmp_path / "partial", modules=("q_proj",), tensors=partial),
                  "layer 1"))
    (tmp_path / "no_config").mkdir()
    cases.append((tmp_path / "no_config", "adapter_config.json"))
    broken = write_adapter(tmp_path / "broken")
    (broken / "adapter_config.json").write_text("{not json")
    cases.append((broken, "not valid JSON"))
    no_weights = write_adapter(tmp_path / "no_weights")
    (no_weights / "adapter_model.safetensors").unlink()
    cases.append((no_weights, "adapter_model.safetensors"))
    cases.append((tmp_path / "missing", "not a directory"))
    return cases


def test_what_the_slabs_cannot_serve_is_refused_by_name(tmp_path):
    for directory, named in _refusal_cases(tmp_path):
        with pytest.raises(ValueError, match=named):
            load_lora(directory, CONFIG, max_rank=8)


def test_a_projection_the_model_lacks_is_refused(tmp_path):
    """A mixture has no dense gate/up/down: an adapter of them is for another model."""
    write_adapter(tmp_path, modules=("q_proj", "up_proj"))
    with pytest.raises(ValueError, match="up_proj, which this model"):
        load_lora(tmp_path, ModelConfig.preset("tiny-mixtral"), max_rank=8)


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_a_slab_adds_each_tokens_own_adapter(quantization):
    """Per layer, the projection's output moves by x A B of the token's slot (none for slot 0),
    whether the kernel is float or quantized (the slab stays float)."""
    model = model_from_params(CONFIG, random_params(CONFIG))
    model = with_lora(quantize_model(model, quantization), LoraShape(num_slots=2, max_rank=4))
    rng = np.random.default_rng(0)
    x = {"q": rng.standard_normal((3, 64)), "o": rng.standard_normal((3, 4, 16))}
    slots = jnp.asarray([2, 0, 1], jnp.int32)
    for name in ("q", "o"):
        dense = getattr(model.layers.attn, name)
        slab = dense.lora
        slab.a.set_value(jnp.asarray(rng.standard_normal(slab.a.shape), jnp.float32))
        slab.b.set_value(jnp.asarray(rng.standard_normal(slab.b.shape), jnp.float32))
        graphdef, state = nnx.split(dense)
        layer = nnx.merge(graphdef, jax.tree.map(lambda v: v[1], state))  # layer 1 alone
        xs = jnp.asarray(x[name], jnp.float32)
        delta = layer(xs, token_selection(slots, 2)) - layer(xs)
        a, b = np.asarray(slab.a[...][1]), np.asarray(slab.b[...][1])  # [in, S, r], [S, r, out]
        flat_x = np.asarray(xs).reshape(3, -1)
        for token, slot in enumerate([2, 0, 1]):
            want = 0.0 if slot == 0 else flat_x[token] @ a.reshape(-1, 2, 4)[:, slot - 1] \
                @ b[slot - 1].reshape(4, -1)
            np.testing.assert_allclose(np.asarray(delta[token]).reshape(-1), want, rtol=1e-4,
                                       atol=1e-4)
    assert model_from_params(CONFIG, random_params(CONFIG)).layers.attn.q.lora is None


def test_a_slot_write_replaces_the_row_and_pads(tmp_path):
    """A rank-2 adapter of q only, into slot 2 of slabs of rank 4 whose q has 6 heads (as head
    padding makes them): its rows are padded with zeros, every other projection of the slot is
    zeroed (whatever it held before), and slot 1 is untouched."""
    config = CONFIG.replace(num_heads=6, num_kv_heads=3)  # as if padded from 4 and 2
    model = with_lora(model_from_params(config, random_params(config)),
                      LoraShape(num_slots=2, max_rank=4))
    _, params = nnx.split(model)
    slabs = LoraSlabs(params, None)
    for var in slabs.slabs.values():
        var.set_value(jnp.ones(var.shape, var.dtype))
    write_adapter(tmp_path, modules=("q_proj",), rank=2)
    adapter = load_lora(tmp_path, CONFIG, max_rank=4)
    slabs.write(2, adapter.weights)
    a, b = adapter.weights["layers/attn/q"]  # [2, 64, 2], [2, 2, 4, 16]
    q_a = np.asarray(slabs.slabs["layers/attn/q/lora/a"].get_value())  # [L, 64, S, 4]
    q_b = np.asarray(slabs.slabs["layers/attn/q/lora/b"].get_value())  # [L, S, 4, 6, 16]
    np.testing.assert_array_equal(q_a[:, :, 1, :2], a)
    assert not q_a[:, :, 1, 2:].any()
    np.testing.assert_array_equal(q_b[:, 1, :2, :4], b)
    assert not q_b[:, 1, 2:].any() and not q_b[:, 1, :, 4:].any()
    assert np.all(q_a[:, :, 0] == 1) and np.all(q_b[:, 0] == 1)
    v_b = np.asarray(slabs.slabs["layers/attn/v/lora/b"].get_value())
    assert not v_b[:, 1].any() and np.all(v_b[:, 0] == 1)
    assert len(slot_values(slabs.slabs, {})) == len(slabs.slabs)
