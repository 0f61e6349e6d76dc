"""The dense families (Qwen3, Gemma 2, Gemma 3, Phi-3): configs, LongRoPE, and GGUF files.

The golden folders (scripts/make_golden_families.py) hold tiny random models that HF
transformers built and ran. Here: each config.json becomes the switches its family needs (in
transformers 4's spelling and in 5's); Phi-3's short LongRoPE factors match HF's logits like its
long ones (tests/model/test_golden.py); and a GGUF written from the same weights the way
llama.cpp's converter writes them (Gemma's norms as 1 + w, Phi-3's fused weights and LongRoPE
factors as tensors) loads to HF's logits. Greedy tokens, batched, prefix-cached and on a mesh,
are in tests/serving/test_families.py.
"""

from __future__ import annotations

import dataclasses
import json

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from meshserve.model.loading.checkpoint import config_from_json, config_to_json
from meshserve.model.families import config_from_gguf, config_from_hf
from meshserve.model.loading import load_gguf, load_hf
from meshserve.model.transformer import model_from_params
from tests.model.paged import PagedStepper

FAMILIES = ["tiny-qwen3", "tiny-gemma2", "tiny-gemma3", "tiny-phi3"]
GGUF_ARCH = {"tiny-qwen3": "qwen3", "tiny-gemma2": "gemma2", "tiny-gemma3": "gemma3",
             "tiny-phi3": "phi3"}


def _hf_config(golden_dir, family: str) -> dict:
    return json.loads((golden_dir / family / "config.json").read_text())


def _dense_logits(config, params, input_ids) -> np.ndarray:
    model = model_from_params(config.for_context(input_ids.shape[1]), params)
    return PagedStepper(model, page_size=4, num_pages=4).dense(input_ids)


# --- Configs ------------------------------------------------------------------------------------


def test_each_family_config_turns_on_its_switches(golden_dir):
    qwen3, gemma2, gemma3, phi3 = (config_from_hf(_hf_config(golden_dir, f))
                                   for f in FAMILIES)
    assert qwen3.qk_norm and not qwen3.sandwich_norms and qwen3.tie_embeddings
    assert (qwen3.sliding_window, qwen3.norm_kind, qwen3.mlp_activation) == (0, "rms", "silu")
    for gemma in (gemma2, gemma3):
        assert (gemma.norm_kind, gemma.mlp_activation) == ("rms_one_plus", "gelu_tanh")
        assert gemma.sandwich_norms and gemma.scale_embeddings and gemma.tie_embeddings
        assert gemma.sliding_window == 8
    # Gemma 2: no layer_types in config.json (as on the hub): HF's default, every 2nd full.
    assert gemma2.layer_types == ("sliding", "full", "sliding")
    assert (gemma2.query_scale, gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (
        24 ** -0.5, 4.0, 5.0)
    assert gemma3.qk_norm and gemma3.layer_types == ("sliding", "sliding", "full")
    assert (gemma3.rope_theta, gemma3.local_rope_theta) == (1e6, 1e4)
    assert (gemma3.rope_scaling.rope_type, gemma3.rope_scaling.factor) == ("linear", 2.0)
    assert gemma3.query_scale == 256 ** -0.5 and not gemma3.attn_logit_softcap
    assert phi3.rotary_dim == 12 and phi3.sliding_window == 8 and not phi3.layer_types
    rope = phi3.rope_scaling
    assert rope.rope_type == "longrope" and rope.original_max_position_embeddings == 16
    assert rope.attention_factor == pytest.approx((1 + np.log(8) / np.log(16)) ** 0.5)
    assert phi3.attention_window == 8 and gemma3.attention_window == 0


@pytest.mark.parametrize("family, want", [("tiny-gemma2", (256, 50.0, 30.0, 4096)),
                                          ("tiny-gemma3", (256, 0.0, 0.0, 4096))])
def test_gemma_keys_left_out_take_hf_defaults(family, want, golden_dir):
    left_out = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                "sliding_window")
    hf = {k: v for k, v in _hf_config(golden_dir, family).items() if k not in left_out}
    config = config_from_hf(hf)
    assert (config.query_pre_attn_scalar, config.attn_logit_softcap,
            config.final_logit_softcap, config.sliding_window) == want


def test_gemma3_config_reads_the_same_in_transformers_4_spelling(golden_dir):
    """The golden config.json is transformers 5's (rope_parameters per layer type,
    layer_types); hub checkpoints carry transformers 4's keys for the same model."""
    v5 = _hf_config(golden_dir, "tiny-gemma3")
    v4 = {key: value for key, value in v5.items() if key not in ("rope_parameters",
                                                                   "layer_types")}
    v4 |= {"rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
           "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "sliding_window_pattern": 3}
    assert config_from_hf(v4) == config_from_hf(v5)


def test_phi3_config_reads_the_same_in_transformers_5_spelling(golden_dir):
    v4 = _hf_config(golden_dir, "tiny-phi3")
    rope = dict(v4["rope_scaling"], rope_type="longrope", rope_theta=v4["rope_theta"],
                partial_rotary_factor=0.75, original_max_position_embeddings=16)
    v5 = {key: value for key, value in v4.items()
          if key not in ("rope_scaling", "rope_theta", "partial_rotary_factor")}
    assert config_from_hf(v5 | {"rope_parameters": rope}) == config_from_hf(v4)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_configs_round_trip_through_a_checkpoint_config(family, golden_dir):
    config = config_from_hf(_hf_config(golden_dir, family)).for_context(64)
    assert config_from_json(config_to_json(config)) == config


@pytest.mark.parametrize("family", ["tiny-qwen3", "tiny-qwen2-moe", "tiny-qwen3-moe"])
def test_qwen_sliding_window_follows_use_sliding_window(family, golden_dir):
    """As HF: off unless use_sliding_window, then on from layer max_window_layers (a hub
    config.json has no layer_types)."""
    hf = {key: value for key, value in _hf_config(golden_dir, family).items()
          if key != "layer_types"} | {"sliding_window": 8, "max_window_layers": 1}
    assert config_from_hf(hf).sliding_window == 0  # use_sliding_window is false
    windowed = config_from_hf(hf | {"use_sliding_window": True})
    assert windowed.layer_types == ("full",) + ("sliding",) * (hf["num_hidden_layers"] - 1)


@pytest.mark.parametrize("hf, message", [
    ({"model_type": "gemma3"}, "gemma3.*image-text model.*gemma3_text"),
    ({"model_type": "gemma"}, "model_type 'gemma' is not supported.*gemma2"),
])
def test_unsupported_families_are_refused_by_name(hf, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf(hf)


def test_an_encoder_gemma_is_refused(golden_dir):
    hf = _hf_config(golden_dir, "tiny-gemma3") | {"use_bidirectional_attention": True}
    with pytest.raises(ValueError, match="bidirectional.*causal decoders only"):
        config_from_hf(hf)


@pytest.mark.parametrize("arch", ["gemma", "phi2", "command-r"])
def test_gguf_architectures_outside_the_families_are_refused_by_name(arch):
    with pytest.raises(ValueError, match=f"GGUF architecture '{arch}' is not supported"):
        config_from_gguf({"general.architecture": arch})


def test_gemma_gguf_query_scale_follows_llama_cpp_without_a_scale_key():
    fields = {"general.architecture": "gemma2", "gemma2.embedding_length": 4608,
              "gemma2.attention.head_count": 32, "gemma2.attention.head_count_kv": 16,
              "gemma2.attention.key_length": 128, "gemma2.feed_forward_length": 36864,
              "gemma2.block_count": 46, "gemma2.vocab_size": 256000}
    assert config_from_gguf(fields).query_pre_attn_scalar == 144  # 27B: D / H
    smaller = fields | {"gemma2.block_count": 42, "gemma2.embedding_length": 3584}
    assert config_from_gguf(smaller).query_pre_attn_scalar == 128  # head_dim


# --- LongRoPE -----------------------------------------------------------------------------------


def test_phi3_short_factors_match_hf(golden_dir):
    """HF rotates the first 16 tokens alone with the short factors (16 is not past the original
    context): so does meshserve for a served context of 16."""
    config, params = load_hf(golden_dir / "tiny-phi3")
    reference = np.load(golden_dir / "tiny-phi3" / "logits.npz")
    short_ids = reference["input_ids"][:, :16]
    got = _dense_logits(config, params, short_ids)
    np.testing.assert_allclose(got, reference["logits_short"], atol=1e-4, rtol=1e-4)
    assert np.abs(reference["logits_short"] - reference["logits"][:, :16]).max() > 1e-2


def test_longrope_takes_the_long_factors_when_the_served_context_exceeds_the_original(
        golden_dir):
    config = config_from_hf(_hf_config(golden_dir, "tiny-phi3"))
    assert not config.for_context(16).rope_scaling.long_context
    assert config.for_context(17).rope_scaling.long_context
    qwen3 = config_from_hf(_hf_config(golden_dir, "tiny-qwen3"))
    assert qwen3.for_context(100) == qwen3


# --- GGUF, as llama.cpp's converter writes it ---------------------------------------------------


def _gguf_tensors(family: str, hf: dict, t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """llama.cpp's layout of the HF tensors: GGUF names, Gemma norms + 1, Phi-3's fusions kept
    and its LongRoPE factors as tensors. Written here independently of the loader."""
    gemma = family.startswith("tiny-gemma")
    norm = (lambda w: w + 1.0) if gemma else (lambda w: w)
    out = {"token_embd.weight": t["model.embed_tokens.weight"],
           "output_norm.weight": norm(t["model.norm.weight"])}
    if "lm_head.weight" in t:
        out["output.weight"] = t["lm_head.weight"]
    for i in range(hf["num_hidden_layers"]):
        layer = {name.removeprefix(f"model.layers.{i}."): w for name, w in t.items()
                 if name.startswith(f"model.layers.{i}.")}
        block = {"attn_norm": norm(layer.pop("input_layernorm.weight")),
                 "attn_output": layer.pop("self_attn.o_proj.weight"),
                 "ffn_down": layer.pop("mlp.down_proj.weight")}
        if family == "tiny-phi3":
            block |= {"attn_qkv": layer.pop("self_attn.qkv_proj.weight"),
                      "ffn_up": layer.pop("mlp.gate_up_proj.weight")}
        else:
            block |= {f"attn_{x}": layer.pop(f"self_attn.{x}_proj.weight") for x in "qkv"}
            block |= {f"ffn_{x}": layer.pop(f"mlp.{x}_proj.weight") for x in ("gate", "up")}
        if "self_attn.q_norm.weight" in layer:
            block |= {f"attn_{x}_norm": norm(layer.pop(f"self_attn.{x}_norm.weight"))
                      for x in "qk"}
        if gemma:
            block |= {"post_attention_norm": norm(layer.pop("post_attention_layernorm.weight")),
                      "ffn_norm": norm(layer.pop("pre_feedforward_layernorm.weight")),
                      "post_ffw_norm": norm(layer.pop("post_feedforward_layernorm.weight"))}
        else:
            block["ffn_norm"] = layer.pop("post_attention_layernorm.weight")
        assert not layer, layer
        out |= {f"blk.{i}.{name}.weight": w for name, w in block.items()}
    if family == "tiny-phi3":
        rope = hf["rope_scaling"]
        out["rope_factors_long.weight"] = np.asarray(rope["long_factor"], np.float32)
        out["rope_factors_short.weight"] = np.asarray(rope["short_factor"], np.float32)
    return out


def _write_gguf(path, family: str, hf: dict, tensors: dict) -> None:
    writer = gguf.GGUFWriter(str(path), GGUF_ARCH[family])
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    if family != "tiny-phi3":
        writer.add_key_length(hf["head_dim"])
        writer.add_value_length(hf["head_dim"])
    if family == "tiny-gemma2":
        writer.add_rope_freq_base(hf["rope_theta"])
        writer.add_attn_logit_softcapping(hf["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(hf["final_logit_softcapping"])
    if family == "tiny-gemma3":
        full = hf["rope_parameters"]["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in hf["layer_types"]])
    if family.startswith("tiny-gemma"):
        writer.add_sliding_window(hf["sliding_window"])
        writer.add_attention_scale(hf["query_pre_attn_scalar"] ** -0.5)
    if family == "tiny-qwen3":
        writer.add_rope_freq_base(hf["rope_theta"])
    if family == "tiny-phi3":
        writer.add_rope_freq_base(hf["rope_theta"])
        writer.add_rope_dimension_count(12)
        writer.add_rope_scaling_orig_ctx_len(hf["original_max_position_embeddings"])
        writer.add_rope_scaling_attn_factors((1 + np.log(8) / np.log(16)) ** 0.5)
        writer.add_sliding_window(hf["sliding_window"])
    for name, tensor in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(tensor))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _assert_close(got, want, name: str) -> None:
    if dataclasses.is_dataclass(want):
        for field in dataclasses.fields(want):
            _assert_close(getattr(got, field.name), getattr(want, field.name),
                          f"{name}.{field.name}")
    elif isinstance(want, float) or (isinstance(want, tuple) and want
                                     and isinstance(want[0], float)):
        assert got == pytest.approx(want, rel=1e-6), name
    else:
        assert got == want, name


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_of_the_same_weights_loads_to_hf_logits(family, golden_dir, tmp_path):
    hf = _hf_config(golden_dir, family)
    weights = {name: w.astype(np.float32)
               for name, w in load_file(str(golden_dir / family / "model.safetensors")).items()}
    path = tmp_path / f"{family}.gguf"
    _write_gguf(path, family, hf, _gguf_tensors(family, hf, weights))
    config, params = load_gguf(path)
    hf_config, hf_params = load_hf(golden_dir / family)
    switches = ("norm_kind", "mlp_activation", "qk_norm", "sandwich_norms", "scale_embeddings",
                "query_scale", "attn_logit_softcap", "final_logit_softcap", "sliding_window",
                "layer_types", "local_rope_theta", "rotary_dim", "rope_scaling",
                "tie_embeddings", "qkv_bias")
    for switch in switches:  # GGUF keeps floats in float32
        _assert_close(getattr(config, switch), getattr(hf_config, switch), switch)
    for key, value in hf_params.items():
        np.testing.assert_allclose(params[key], value, atol=1e-6, err_msg=key)
    reference = np.load(golden_dir / family / "logits.npz")
    got = _dense_logits(config, params, reference["input_ids"])
    np.testing.assert_allclose(got, reference["logits"], atol=1e-4, rtol=1e-4)
