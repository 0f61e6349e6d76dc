"""Tests for meshserve.model.loading: GGUF and HF safetensors checkpoints -> canonical params.

Checkpoints are built here with numpy, safetensors and gguf.GGUFWriter, so the layouts are
checked against independently written reference conversions; the real SmolLM2 GGUF and the
golden HF directories (tests/golden) are checked as well.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import gguf
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from meshserve.model.canonical import check_params, expected_shapes
from meshserve.model.config import ModelConfig
from meshserve.model.families.llama import unpermute_rows
from meshserve.model.gguf_reader import open_gguf
from meshserve.model.loading import gguf_files as loaders
from meshserve.model.loading import load_gguf, load_hf, load_weights

GOLDEN = Path(__file__).parents[1] / "golden"
GGML = gguf.GGMLQuantizationType

LLAMA_HF = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

GPT2_HF = {
    "model_type": "gpt2",
    "vocab_size": 64,
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 16,
    "layer_norm_epsilon": 1e-5,
    "activation_function": "gelu_new",
}


# --- Building checkpoints ---------------------------------------------------------------------


def random_tensor(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def hf_llama_tensors(hf: dict, *, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-layout (`[out, in]`) tensors of a llama-family model described by `hf`."""
    rng = np.random.default_rng(seed)
    D, F, V = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    H, K = hf["num_attention_heads"], hf["num_key_value_heads"]
    h = D // H
    bias = hf["model_type"] == "qwen2"
    tensors = {
        "model.embed_tokens.weight": random_tensor(rng, V, D),
        "model.norm.weight": random_tensor(rng, D),
    }
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": random_tensor(rng, D),
            p + "self_attn.q_proj.weight": random_tensor(rng, H * h, D),
            p + "self_attn.k_proj.weight": random_tensor(rng, K * h, D),
            p + "self_attn.v_proj.weight": random_tensor(rng, K * h, D),
            p + "self_attn.o_proj.weight": random_tensor(rng, D, H * h),
            p + "post_attention_layernorm.weight": random_tensor(rng, D),
            p + "mlp.gate_proj.weight": random_tensor(rng, F, D),
            p + "mlp.up_proj.weight": random_tensor(rng, F, D),
            p + "mlp.down_proj.weight": random_tensor(rng, D, F),
        })
        if bias:
            tensors.update({
                p + "self_attn.q_proj.bias": random_tensor(rng, H * h),
                p + "self_attn.k_proj.bias": random_tensor(rng, K * h),
                p + "self_attn.v_proj.bias": random_tensor(rng, K * h),
            })
    if not hf.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = random_tensor(rng, V, D)
    return tensors


def hf_gpt2_tensors(hf: dict, *, prefix: str = "transformer.", seed: int = 0) -> dict:
    """HF GPT-2 tensors (Conv1D weights are `[in, out]`), with the causal-mask buffers HF saves."""
    rng = np.random.default_rng(seed)
    D, V, P = hf["n_embd"], hf["vocab_size"], hf["n_positions"]
    F = 4 * D
    tensors = {
        prefix + "wte.weight": random_tensor(rng, V, D),
        prefix + "wpe.weight": random_tensor(rng, P, D),
        prefix + "ln_f.weight": random_tensor(rng, D),
        prefix + "ln_f.bias": random_tensor(rng, D),
    }
    for i in range(hf["n_layer"]):
        p = f"{prefix}h.{i}."
        tensors.update({
            p + "ln_1.weight": random_tensor(rng, D),
            p + "ln_1.bias": random_tensor(rng, D),
            p + "attn.c_attn.weight": random_tensor(rng, D, 3 * D),
            p + "attn.c_attn.bias": random_tensor(rng, 3 * D),
            p + "attn.c_proj.weight": random_tensor(rng, D, D),
            p + "attn.c_proj.bias": random_tensor(rng, D),
            p + "ln_2.weight": random_tensor(rng, D),
            p + "ln_2.bias": random_tensor(rng, D),
            p + "mlp.c_fc.weight": random_tensor(rng, D, F),
            p + "mlp.c_fc.bias": random_tensor(rng, F),
            p + "mlp.c_proj.weight": random_tensor(rng, F, D),
            p + "mlp.c_proj.bias": random_tensor(rng, D),
            p + "attn.bias": np.tril(np.ones((P, P), np.float32))[None, None],
            p + "attn.masked_bias": np.array(-1e4, np.float32),
        })
    return tensors


def write_hf(directory: Path, hf: dict, tensors: dict[str, np.ndarray], *, shards: int = 1) -> Path:
    """Writes config.json and the tensors, as one model.safetensors or as indexed shards."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf))
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
        return directory
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({name: tensors[name] for name in part}, str(directory / shard))
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute`: HF rotate_half rows -> interleaved RoPE rows."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, arch: str, metadata: dict, tensors: dict) -> Path:
    """Writes a GGUF file; a tensor is a float array (F32/F16) or `(uint8 bytes, quant type)`."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for name, tensor in tensors.items():
        if isinstance(tensor, tuple):
            writer.add_tensor(name, tensor[0], raw_dtype=tensor[1])
        else:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_llama_metadata(arch: str, *, D: int, F: int, L: int, H: int, K: int, V: int) -> dict:
    return {
        f"{arch}.block_count": L,
        f"{arch}.context_length": 128,
        f"{arch}.embedding_length": D,
        f"{arch}.feed_forward_length": F,
        f"{arch}.attention.head_count": H,
        f"{arch}.attention.head_count_kv": K,
        f"{arch}.rope.freq_base": 50000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.vocab_size": V,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


def gguf_llama_tensors(hf_tensors: dict, *, L: int, H: int, K: int, permute: bool) -> dict:
    """GGUF tensors from HF-layout llama tensors, Q/K permuted the llama.cpp way if `permute`."""
    out = {"token_embd.weight": hf_tensors["model.embed_tokens.weight"],
           "output_norm.weight": hf_tensors["model.norm.weight"]}
    if "lm_head.weight" in hf_tensors:
        out["output.weight"] = hf_tensors["lm_head.weight"]
    renames = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
    }
    for i in range(L):
        for hf_name, gguf_name in renames.items():
            name = f"model.layers.{i}.{hf_name}"
            if name not in hf_tensors:
                continue
            w = hf_tensors[name]
            if permute and gguf_name == "attn_q.weight":
                w = llamacpp_permute(w, H)
            if permute and gguf_name == "attn_k.weight":
                w = llamacpp_permute(w, K)
            out[f"blk.{i}.{gguf_name}"] = w
    return out


# --- Reference conversions (written independently of the loader's) ----------------------------


def reference_llama_params(hf: dict, t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    D, H = hf["hidden_size"], hf["num_attention_heads"]
    K = hf.get("num_key_value_heads") or H
    h = hf.get("head_dim") or D // H
    L = hf["num_hidden_layers"]

    def stack(name: str, fn) -> np.ndarray:
        return np.stack([fn(t[f"model.layers.{i}.{name}"]) for i in range(L)])

    def heads_in(n: int):
        return lambda w: w.reshape(n, h, D).transpose(2, 0, 1)

    params = {
        "embed/embedding": t["model.embed_tokens.weight"],
        "layers/attn_norm/scale": stack("input_layernorm.weight", lambda w: w),
        "layers/attn/q/kernel": stack("self_attn.q_proj.weight", heads_in(H)),
        "layers/attn/k/kernel": stack("self_attn.k_proj.weight", heads_in(K)),
        "layers/attn/v/kernel": stack("self_attn.v_proj.weight", heads_in(K)),
        "layers/attn/o/kernel": stack(
            "self_attn.o_proj.weight", lambda w: w.reshape(D, H, h).transpose(1, 2, 0)
        ),
        "layers/mlp_norm/scale": stack("post_attention_layernorm.weight", lambda w: w),
        "layers/mlp/gate/kernel": stack("mlp.gate_proj.weight", np.transpose),
        "layers/mlp/up/kernel": stack("mlp.up_proj.weight", np.transpose),
        "layers/mlp/down/kernel": stack("mlp.down_proj.weight", np.transpose),
        "final_norm/scale": t["model.norm.weight"],
    }
    if "model.layers.0.self_attn.q_proj.bias" in t:
        params["layers/attn/q/bias"] = stack("self_attn.q_proj.bias", lambda b: b.reshape(H, h))
        params["layers/attn/k/bias"] = stack("self_attn.k_proj.bias", lambda b: b.reshape(K, h))
        params["layers/attn/v/bias"] = stack("self_attn.v_proj.bias", lambda b: b.reshape(K, h))
    if not hf.get("tie_word_embeddings", False):
        params["lm_head/kernel"] = t["lm_head.weight"].transpose()
    return params


def reference_gpt2_params(hf: dict, t: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    D, H, L = hf["n_embd"], hf["n_head"], hf["n_layer"]
    h = D // H

    def stack(name: str, fn=lambda w: w) -> np.ndarray:
        return np.stack([fn(t[f"{prefix}h.{i}.{name}"]) for i in range(L)])

    return {
        "embed/embedding": t[prefix + "wte.weight"],
        "pos_embed/embedding": t[prefix + "wpe.weight"],
        "layers/attn_norm/scale": stack("ln_1.weight"),
        "layers/attn_norm/bias": stack("ln_1.bias"),
        "layers/attn/qkv/kernel": stack("attn.c_attn.weight", lambda w: w.reshape(D, 3, H, h)),
        "layers/attn/qkv/bias": stack("attn.c_attn.bias", lambda b: b.reshape(3, H, h)),
        "layers/attn/o/kernel": stack("attn.c_proj.weight", lambda w: w.reshape(H, h, D)),
        "layers/attn/o/bias": stack("attn.c_proj.bias"),
        "layers/mlp_norm/scale": stack("ln_2.weight"),
        "layers/mlp_norm/bias": stack("ln_2.bias"),
        "layers/mlp/up/kernel": stack("mlp.c_fc.weight"),
        "layers/mlp/up/bias": stack("mlp.c_fc.bias"),
        "layers/mlp/down/kernel": stack("mlp.c_proj.weight"),
        "layers/mlp/down/bias": stack("mlp.c_proj.bias"),
        "final_norm/scale": t[prefix + "ln_f.weight"],
        "final_norm/bias": t[prefix + "ln_f.bias"],
    }


def assert_params_equal(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_array_equal(actual[key], value, err_msg=key)


def assert_layout(config: ModelConfig, params: dict[str, np.ndarray]) -> None:
    shapes = expected_shapes(config)
    assert list(params) == list(shapes)
    assert {key: value.shape for key, value in params.items()} == shapes


# --- The canonical layout ---------------------------------------------------------------------


PRESETS = ["tiny-llama", "tiny-gpt2", "smollm2-135m", "llama-2-70b", "gpt2"]


@pytest.mark.parametrize("preset", PRESETS)
def test_expected_shapes_count_the_configs_parameters(preset):
    config = ModelConfig.preset(preset)
    sizes = [int(np.prod(shape)) for shape in expected_shapes(config).values()]
    assert sum(sizes) == config.num_params


def test_expected_shapes_follow_bias_and_tying():
    config = ModelConfig.preset("tiny-llama")
    plain = expected_shapes(config)
    assert plain["layers/attn/q/kernel"] == (2, 64, 4, 16)
    assert plain["layers/attn/k/kernel"] == (2, 64, 2, 16)
    assert plain["layers/attn/o/kernel"] == (2, 4, 16, 64)
    assert plain["lm_head/kernel"] == (64, 512)
    assert "layers/attn/q/bias" not in plain
    biased_tied = expected_shapes(config.replace(qkv_bias=True, tie_embeddings=True))
    assert biased_tied["layers/attn/k/bias"] == (2, 2, 16)
    assert "lm_head/kernel" not in biased_tied
    gpt2 = expected_shapes(ModelConfig.preset("tiny-gpt2"))
    assert gpt2["layers/attn/qkv/kernel"] == (2, 64, 3, 4, 16)
    assert gpt2["pos_embed/embedding"] == (1024, 64)


def zero_params(config: ModelConfig) -> dict[str, np.ndarray]:
    return {key: np.zeros(shape, np.float32) for key, shape in expected_shapes(config).items()}


def test_check_params_accepts_the_expected_layout():
    config = ModelConfig.preset("tiny-llama")
    check_params(config, zero_params(config))


def test_check_params_names_a_missing_key():
    config = ModelConfig.preset("tiny-llama")
    params = zero_params(config)
    del params["layers/mlp/up/kernel"]
    with pytest.raises(ValueError, match=r"layers/mlp/up/kernel.*\(2, 64, 128\)"):
        check_params(config, params)


def test_check_params_names_an_extra_key():
    config = ModelConfig.preset("tiny-llama", tie_embeddings=True)
    params = zero_params(config) | {"lm_head/kernel": np.zeros((64, 512), np.float32)}
    with pytest.raises(ValueError, match="lm_head/kernel.*tie_embeddings=True"):
        check_params(config, params)


def test_check_params_names_a_wrong_shape():
    config = ModelConfig.preset("tiny-llama")
    params = zero_params(config)
    params["layers/attn/k/kernel"] = np.zeros((2, 64, 4, 16), np.float32)
    message = r"layers/attn/k/kernel.*\(2, 64, 4, 16\).*\(2, 64, 2, 16\)"
    with pytest.raises(ValueError, match=message):
        check_params(config, params)


def test_check_params_rejects_non_finite_values():
    config = ModelConfig.preset("tiny-llama")
    params = zero_params(config)
    params["final_norm/scale"][3] = np.nan
    with pytest.raises(ValueError, match="final_norm/scale.*NaN"):
        check_params(config, params)


def test_unpermute_rows_inverts_llamacpp_permute():
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    for n_heads in (1, 2, 3, 6):
        np.testing.assert_array_equal(unpermute_rows(llamacpp_permute(w, n_heads), n_heads), w)
    assert not np.array_equal(llamacpp_permute(w, 2), w)


# --- HF safetensors ---------------------------------------------------------------------------


def test_load_hf_llama_values_and_layout(tmp_path):
    tensors = hf_llama_tensors(LLAMA_HF)
    config, params = load_hf(write_hf(tmp_path / "m", LLAMA_HF, tensors))
    assert (config.arch, config.num_layers, config.num_kv_heads) == ("llama", 2, 2)
    assert config.head_dim == 8
    assert_layout(config, params)
    assert_params_equal(params, reference_llama_params(LLAMA_HF, tensors))
    w_q = tensors["model.layers.1.self_attn.q_proj.weight"]
    assert params["layers/attn/q/kernel"][1, 5, 3, 2] == w_q[3 * 8 + 2, 5]
    w_o = tensors["model.layers.0.self_attn.o_proj.weight"]
    assert params["layers/attn/o/kernel"][0, 2, 7, 9] == w_o[9, 2 * 8 + 7]


def test_load_hf_sharded_matches_single_file(tmp_path):
    tensors = hf_llama_tensors(LLAMA_HF)
    _, single = load_hf(write_hf(tmp_path / "single", LLAMA_HF, tensors))
    _, sharded = load_hf(write_hf(tmp_path / "sharded", LLAMA_HF, tensors, shards=3))
    assert_params_equal(sharded, single)


def test_load_hf_qwen2_reads_qkv_biases(tmp_path):
    hf = LLAMA_HF | {"model_type": "qwen2", "tie_word_embeddings": True}
    tensors = hf_llama_tensors(hf)
    config, params = load_hf(write_hf(tmp_path / "m", hf, tensors))
    assert config.qkv_bias and config.tie_embeddings
    assert "lm_head/kernel" not in params
    assert_params_equal(params, reference_llama_params(hf, tensors))


def test_load_hf_mistral_uses_the_llama_layout(tmp_path):
    hf = LLAMA_HF | {"model_type": "mistral", "sliding_window": None}
    tensors = hf_llama_tensors(hf)
    _, params = load_hf(write_hf(tmp_path / "m", hf, tensors))
    assert_params_equal(params, reference_llama_params(hf, tensors))


def test_load_hf_ignores_rotary_buffers_and_a_saved_tied_head(tmp_path):
    hf = LLAMA_HF | {"tie_word_embeddings": True}
    tensors = hf_llama_tensors(hf)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    _, params = load_hf(write_hf(tmp_path / "m", hf, tensors))
    assert "lm_head/kernel" not in params


def test_load_hf_reads_bfloat16_tensors(tmp_path):
    tensors = {name: t.astype(ml_dtypes.bfloat16) for name, t in hf_llama_tensors(LLAMA_HF).items()}
    directory = write_hf(tmp_path / "m", LLAMA_HF, tensors)
    with safe_open(directory / "model.safetensors", framework="numpy") as handle:
        assert handle.get_slice("model.norm.weight").get_dtype() == "BF16"
    as_float32 = {name: t.astype(np.float32) for name, t in tensors.items()}
    _, params = load_hf(directory)
    assert_params_equal(params, reference_llama_params(LLAMA_HF, as_float32))
    _, params_bf16 = load_hf(directory, dtype="bfloat16")
    assert {p.dtype for p in params_bf16.values()} == {np.dtype(ml_dtypes.bfloat16)}
    np.testing.assert_array_equal(
        params_bf16["embed/embedding"], tensors["model.embed_tokens.weight"]
    )


def test_load_hf_casts_to_the_requested_dtype(tmp_path):
    tensors = hf_llama_tensors(LLAMA_HF)
    config, params = load_hf(write_hf(tmp_path / "m", LLAMA_HF, tensors), dtype="bfloat16")
    assert config.dtype == "bfloat16"
    assert {p.dtype for p in params.values()} == {np.dtype(ml_dtypes.bfloat16)}
    reference = reference_llama_params(LLAMA_HF, tensors)
    expected = reference["layers/mlp/down/kernel"].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(params["layers/mlp/down/kernel"], expected)


@pytest.mark.parametrize("prefix", ["transformer.", ""])
def test_load_hf_gpt2_with_or_without_prefix(tmp_path, prefix):
    tensors = hf_gpt2_tensors(GPT2_HF, prefix=prefix)
    config, params = load_hf(write_hf(tmp_path / "m", GPT2_HF, tensors))
    assert (config.arch, config.max_position_embeddings) == ("gpt2", 16)
    assert config.intermediate_size == 128
    assert_layout(config, params)
    assert_params_equal(params, reference_gpt2_params(GPT2_HF, tensors, prefix))
    w_attn = tensors[prefix + "h.1.attn.c_attn.weight"]
    assert params["layers/attn/qkv/kernel"][1, 4, 2, 3, 5] == w_attn[4, 2 * 32 + 3 * 8 + 5]


def test_load_hf_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        load_hf(tmp_path / "nope")


def test_load_hf_missing_config(tmp_path):
    directory = write_hf(tmp_path / "m", LLAMA_HF, hf_llama_tensors(LLAMA_HF))
    (directory / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(directory)


def test_load_hf_missing_weights(tmp_path):
    directory = tmp_path / "m"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(LLAMA_HF))
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        load_hf(directory)


def test_load_hf_missing_shard(tmp_path):
    directory = write_hf(tmp_path / "m", LLAMA_HF, hf_llama_tensors(LLAMA_HF), shards=2)
    (directory / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_hf(directory)


def test_load_hf_truncated_safetensors(tmp_path):
    directory = write_hf(tmp_path / "m", LLAMA_HF, hf_llama_tensors(LLAMA_HF))
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"{weights}.*corrupt or truncated"):
        load_hf(directory)


def test_load_hf_unsupported_architecture(tmp_path):
    hf = LLAMA_HF | {"model_type": "bert"}
    directory = write_hf(tmp_path / "m", hf, hf_llama_tensors(LLAMA_HF))
    with pytest.raises(ValueError, match="'bert' is not supported"):
        load_hf(directory)


def test_load_hf_config_that_does_not_match_the_weights(tmp_path):
    hf = LLAMA_HF | {"hidden_size": 128}
    directory = write_hf(tmp_path / "m", hf, hf_llama_tensors(LLAMA_HF))
    message = r"'model.embed_tokens.weight' has shape \(64, 32\).*\(64, 128\)"
    with pytest.raises(ValueError, match=message):
        load_hf(directory)


def test_load_hf_untied_without_lm_head(tmp_path):
    tensors = hf_llama_tensors(LLAMA_HF)
    del tensors["lm_head.weight"]
    with pytest.raises(ValueError, match="tie_word_embeddings.*lm_head.weight"):
        load_hf(write_hf(tmp_path / "m", LLAMA_HF, tensors))


def test_load_hf_unexpected_tensors(tmp_path):
    tensors = hf_llama_tensors(LLAMA_HF)
    tensors["model.layers.0.mlp.up_proj.bias"] = np.zeros(48, np.float32)
    tensors["model.layers.1.mlp.up_proj.bias"] = np.zeros(48, np.float32)
    with pytest.raises(ValueError, match=r"2 tensors.*model.layers.0.mlp.up_proj.bias"):
        load_hf(write_hf(tmp_path / "m", LLAMA_HF, tensors))


def test_load_hf_missing_layer(tmp_path):
    tensors = hf_llama_tensors(LLAMA_HF)
    del tensors["model.layers.1.mlp.gate_proj.weight"]
    with pytest.raises(ValueError, match="lacks tensor 'model.layers.1.mlp.gate_proj.weight'"):
        load_hf(write_hf(tmp_path / "m", LLAMA_HF, tensors))


def test_load_hf_unsupported_dtype(tmp_path):
    directory = write_hf(tmp_path / "m", LLAMA_HF, hf_llama_tensors(LLAMA_HF))
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        load_hf(directory, dtype="int8")


# --- Golden HF directories --------------------------------------------------------------------


def read_all_tensors(directory: Path) -> dict[str, np.ndarray]:
    files = sorted(directory.glob("*.safetensors"))
    tensors = {}
    for file in files:
        with safe_open(file, framework="numpy") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama3-rope", "tiny-qwen2", "tiny-gpt2"])
def test_load_golden_hf_directory(name):
    directory = GOLDEN / name
    hf = json.loads((directory / "config.json").read_text())
    config, params = load_hf(directory)
    assert_layout(config, params)
    tensors = read_all_tensors(directory)
    if config.arch == "gpt2":
        prefix = "transformer." if "transformer.wte.weight" in tensors else ""
        reference = reference_gpt2_params(hf, tensors, prefix)
    else:
        reference = reference_llama_params(hf, tensors)
    for key, value in reference.items():
        np.testing.assert_array_equal(params[key], value.astype(np.float32), err_msg=key)


def test_golden_tiny_llama_is_sharded():
    directory = GOLDEN / "tiny-llama"
    assert (directory / "model.safetensors.index.json").is_file()


# --- GGUF written here ------------------------------------------------------------------------

GGUF_LLAMA = dict(D=32, F=64, L=2, H=4, K=2, V=48)


def tiny_gguf_llama(path: Path, *, arch="llama", quantize_up=True, untied=False):
    """A tiny GGUF from known HF-layout tensors: Q/K permuted llama.cpp's way, ffn_up in Q8_0."""
    d = GGUF_LLAMA
    hf = LLAMA_HF | {
        "model_type": "qwen2" if arch == "qwen2" else "llama",
        "vocab_size": d["V"],
        "hidden_size": d["D"],
        "intermediate_size": d["F"],
        "num_hidden_layers": d["L"],
        "num_attention_heads": d["H"],
        "num_key_value_heads": d["K"],
        "tie_word_embeddings": not untied,
    }
    hf_tensors = hf_llama_tensors(hf, seed=1)
    tensors = gguf_llama_tensors(hf_tensors, L=d["L"], H=d["H"], K=d["K"], permute=arch == "llama")
    if quantize_up:
        for i in range(d["L"]):
            name = f"blk.{i}.ffn_up.weight"
            tensors[name] = (gguf.quants.quantize(tensors[name], GGML.Q8_0), GGML.Q8_0)
    write_gguf(path, arch, gguf_llama_metadata(arch, **d), tensors)
    return hf, hf_tensors


def test_load_gguf_recovers_hf_layout_from_permuted_llama(tmp_path):
    hf, hf_tensors = tiny_gguf_llama(tmp_path / "tiny.gguf")
    config, params = load_gguf(tmp_path / "tiny.gguf")
    assert (config.arch, config.num_layers, config.tie_embeddings) == ("llama", 2, True)
    assert (config.num_heads, config.num_kv_heads, config.rope_theta) == (4, 2, 50000.0)
    assert config.norm_eps == pytest.approx(1e-6)
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    assert_layout(config, params)
    reference = reference_llama_params(hf, hf_tensors)
    up = reference.pop("layers/mlp/up/kernel")
    for key, value in reference.items():
        np.testing.assert_array_equal(params[key], value, err_msg=key)
    ups = [hf_tensors[f"model.layers.{i}.mlp.up_proj.weight"] for i in range(2)]
    dequantized_up = np.stack([
        gguf.quants.dequantize(gguf.quants.quantize(up, GGML.Q8_0), GGML.Q8_0).T for up in ups
    ])
    np.testing.assert_array_equal(params["layers/mlp/up/kernel"], dequantized_up)
    np.testing.assert_allclose(params["layers/mlp/up/kernel"], up, atol=0.05)


def test_load_gguf_qwen2_is_not_unpermuted_and_reads_biases(tmp_path):
    hf, hf_tensors = tiny_gguf_llama(tmp_path / "qwen.gguf", arch="qwen2", quantize_up=False)
    config, params = load_gguf(tmp_path / "qwen.gguf")
    assert config.qkv_bias
    assert_params_equal(params, reference_llama_params(hf, hf_tensors))


def test_load_gguf_untied_reads_output_weight(tmp_path):
    hf, hf_tensors = tiny_gguf_llama(tmp_path / "untied.gguf", quantize_up=False, untied=True)
    config, params = load_gguf(tmp_path / "untied.gguf")
    assert not config.tie_embeddings
    np.testing.assert_array_equal(params["lm_head/kernel"], hf_tensors["lm_head.weight"].T)


def test_load_gguf_casts_to_bfloat16(tmp_path):
    hf, hf_tensors = tiny_gguf_llama(tmp_path / "tiny.gguf", quantize_up=False)
    config, params = load_gguf(tmp_path / "tiny.gguf", dtype="bfloat16")
    assert config.dtype == "bfloat16"
    assert {p.dtype for p in params.values()} == {np.dtype(ml_dtypes.bfloat16)}
    reference = reference_llama_params(hf, hf_tensors)["layers/attn/k/kernel"]
    expected = reference.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(params["layers/attn/k/kernel"], expected)


@pytest.mark.parametrize("qtype", loaders.GGUF_TYPES, ids=lambda t: t.name)
def test_load_gguf_dequantizes_every_supported_type(tmp_path, qtype):
    d = dict(D=256, F=16, L=1, H=4, K=2, V=8)
    hf = LLAMA_HF | {
        "vocab_size": 8, "hidden_size": 256, "intermediate_size": 16, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
    }
    tensors = gguf_llama_tensors(hf_llama_tensors(hf), L=1, H=4, K=2, permute=True)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    # Every byte below 0x7C keeps every f16/bf16/f32 scale finite, so any byte pattern is valid.
    raw_shape = (16, 256 // block_size * type_size)
    raw = np.random.default_rng(2).integers(0, 0x7C, raw_shape, dtype=np.uint8)
    tensors["blk.0.ffn_up.weight"] = (raw, qtype)
    write_gguf(tmp_path / "q.gguf", "llama", gguf_llama_metadata("llama", **d), tensors)
    _, params = load_gguf(tmp_path / "q.gguf")
    expected = gguf.quants.dequantize(raw, qtype).reshape(16, 256).T
    np.testing.assert_array_equal(params["layers/mlp/up/kernel"][0], expected)


def gguf_gpt2_tensors(hf_tensors: dict, prefix: str, layers: int) -> dict:
    """GGUF tensors as llama.cpp's converter writes GPT-2: Conv1D weights transposed to [out, in],
    and the tied head duplicated as `output.weight`."""
    tensors = {
        "token_embd.weight": hf_tensors[prefix + "wte.weight"],
        "position_embd.weight": hf_tensors[prefix + "wpe.weight"],
        "output_norm.weight": hf_tensors[prefix + "ln_f.weight"],
        "output_norm.bias": hf_tensors[prefix + "ln_f.bias"],
        "output.weight": hf_tensors[prefix + "wte.weight"],
    }
    renames = {
        "ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
        "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down",
    }
    for i in range(layers):
        for hf_name, gguf_name in renames.items():
            weight = hf_tensors[f"{prefix}h.{i}.{hf_name}.weight"]
            if hf_name not in ("ln_1", "ln_2"):
                weight = np.ascontiguousarray(weight.T)
            tensors[f"blk.{i}.{gguf_name}.weight"] = weight
            tensors[f"blk.{i}.{gguf_name}.bias"] = hf_tensors[f"{prefix}h.{i}.{hf_name}.bias"]
    return tensors


def test_load_gguf_gpt2(tmp_path):
    hf_tensors = hf_gpt2_tensors(GPT2_HF)
    metadata = {
        "gpt2.block_count": 2, "gpt2.context_length": 16, "gpt2.embedding_length": 32,
        "gpt2.feed_forward_length": 128, "gpt2.attention.head_count": 4,
        "gpt2.attention.layer_norm_epsilon": 1e-5, "gpt2.vocab_size": 64,
    }
    tensors = gguf_gpt2_tensors(hf_tensors, "transformer.", layers=2)
    write_gguf(tmp_path / "gpt2.gguf", "gpt2", metadata, tensors)
    config, params = load_gguf(tmp_path / "gpt2.gguf")
    assert config.arch == "gpt2"
    assert_params_equal(params, reference_gpt2_params(GPT2_HF, hf_tensors, "transformer."))


def test_load_gguf_unsupported_quant_type(tmp_path):
    hf = LLAMA_HF | {"tie_word_embeddings": True}
    tensors = gguf_llama_tensors(hf_llama_tensors(hf), L=2, H=4, K=2, permute=True)
    block_size, type_size = gguf.GGML_QUANT_SIZES[GGML.IQ4_NL]
    raw = np.zeros((48, 32 // block_size * type_size), np.uint8)
    tensors["blk.1.ffn_gate.weight"] = (raw, GGML.IQ4_NL)
    metadata = gguf_llama_metadata("llama", D=32, F=48, L=2, H=4, K=2, V=64)
    write_gguf(tmp_path / "iq.gguf", "llama", metadata, tensors)
    with pytest.raises(ValueError, match="'blk.1.ffn_gate.weight' has GGUF type IQ4_NL"):
        load_gguf(tmp_path / "iq.gguf")


def test_load_gguf_unsupported_architecture(tmp_path):
    tensors = {"token_embd.weight": np.zeros((4, 4), np.float32)}
    write_gguf(tmp_path / "bert.gguf", "bert", {"bert.block_count": 1}, tensors)
    with pytest.raises(ValueError, match="'bert' is not supported"):
        load_gguf(tmp_path / "bert.gguf")


def test_load_gguf_rejects_rope_frequency_factors(tmp_path):
    hf = LLAMA_HF | {"tie_word_embeddings": True}
    tensors = gguf_llama_tensors(hf_llama_tensors(hf), L=2, H=4, K=2, permute=True)
    tensors["rope_freqs.weight"] = np.ones(4, np.float32)
    metadata = gguf_llama_metadata("llama", D=32, F=48, L=2, H=4, K=2, V=64)
    write_gguf(tmp_path / "l3.gguf", "llama", metadata, tensors)
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        load_gguf(tmp_path / "l3.gguf")


def test_load_gguf_metadata_that_does_not_match_the_weights(tmp_path):
    tiny_gguf_llama(tmp_path / "tiny.gguf")
    metadata = gguf_llama_metadata("llama", **(GGUF_LLAMA | {"F": 96}))
    reader = open_gguf(tmp_path / "tiny.gguf")
    tensors = {
        t.name: np.array(t.data) if t.ggml_type == GGML.F32 else (np.array(t.data), t.ggml_type)
        for t in reader.tensors.values()
    }
    write_gguf(tmp_path / "bad.gguf", "llama", metadata, tensors)
    message = r"'blk.0.ffn_gate.weight' has shape \(64, 32\).*\(96, 32\)"
    with pytest.raises(ValueError, match=message):
        load_gguf(tmp_path / "bad.gguf")


def test_load_gguf_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "absent.gguf")):
        load_gguf(tmp_path / "absent.gguf")


def test_load_gguf_truncated_in_tensor_data(tmp_path):
    tiny_gguf_llama(tmp_path / "tiny.gguf")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes((tmp_path / "tiny.gguf").read_bytes()[:-500])
    with pytest.raises(ValueError, match=f"{truncated} .*corrupt or truncated"):
        load_gguf(truncated)


def test_load_gguf_not_a_gguf_file(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"this is not a model file at all")
    with pytest.raises(ValueError, match=f"{path} .*corrupt or truncated"):
        load_gguf(path)


# --- Dispatch ---------------------------------------------------------------------------------


def test_load_weights_dispatches_by_kind(tmp_path):
    tiny_gguf_llama(tmp_path / "tiny.gguf")
    directory = write_hf(tmp_path / "hf", LLAMA_HF, hf_llama_tensors(LLAMA_HF))
    gguf_config, _ = load_weights(SimpleNamespace(kind="gguf", path=tmp_path / "tiny.gguf"))
    hf_config, _ = load_weights(SimpleNamespace(kind="hf", path=str(directory)), dtype="bfloat16")
    assert (gguf_config.vocab_size, hf_config.vocab_size, hf_config.dtype) == (48, 64, "bfloat16")
    assert load_weights(tmp_path / "tiny.gguf")[0] == gguf_config
    assert load_weights(str(directory))[0].vocab_size == 64


def test_load_weights_accepts_hub_model_files(tmp_path):
    from meshserve.model.loading.hub import resolve_model

    directory = write_hf(tmp_path / "hf", LLAMA_HF, hf_llama_tensors(LLAMA_HF))
    config, _ = load_weights(resolve_model(str(directory)))
    assert config.num_layers == 2


def test_load_weights_rejects_other_kinds(tmp_path):
    with pytest.raises(ValueError, match="'orbax'"):
        load_weights(SimpleNamespace(kind="orbax", path=tmp_path))


def test_load_weights_rejects_a_file_of_unknown_kind(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0")
    with pytest.raises(ValueError, match="neither a .gguf file nor an HF safetensors directory"):
        load_weights(path)


# --- The real SmolLM2 GGUF --------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    from meshserve.model.loading.hub import resolve_model

    return resolve_model("smollm2-135m-instruct").path


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    start = time.perf_counter()
    config, params = load_gguf(smollm2_path)
    return config, params, time.perf_counter() - start


@pytest.mark.slow
def test_smollm2_config(smollm2):
    config, _, _ = smollm2
    assert config.arch == "llama"
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.tie_embeddings, config.qkv_bias) == (49152, True, False)
    assert config.rope_theta == 100000.0
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))


@pytest.mark.slow
def test_smollm2_params(smollm2):
    config, params, seconds = smollm2
    assert_layout(config, params)
    assert {p.dtype for p in params.values()} == {np.dtype(np.float32)}
    assert all(np.isfinite(p).all() for p in params.values())
    assert seconds < 60, f"loading the SmolLM2 GGUF took {seconds:.1f} s"


@pytest.mark.slow
def test_smollm2_q_and_k_are_unpermuted_from_the_raw_rows(smollm2, smollm2_path):
    config, params, _ = smollm2
    raw = open_gguf(smollm2_path).tensors
    projections = [("attn_q", "q", config.num_heads), ("attn_k", "k", config.num_kv_heads)]
    for name, key, heads in projections:
        tensor = raw[f"blk.3.{name}.weight"]
        permuted = gguf.quants.dequantize(tensor.data, tensor.ggml_type)
        hf_layout = params[f"layers/attn/{key}/kernel"][3].reshape(576, heads * 64).T
        np.testing.assert_array_equal(llamacpp_permute(hf_layout, heads), permuted, err_msg=name)


@pytest.mark.slow
def test_smollm2_truncated_copy(tmp_path, smollm2_path):
    truncated = tmp_path / "smollm2-truncated.gguf"
    with open(smollm2_path, "rb") as source:
        truncated.write_bytes(source.read(1 << 20))
    with pytest.raises(ValueError, match=f"{truncated} .*corrupt or truncated"):
        load_gguf(truncated)
