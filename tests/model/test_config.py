"""ModelConfig: presets, HF and GGUF construction, validation, and agreement with the model."""

import json

import pytest

from meshserve.model.config import PRESETS, ModelConfig, RopeScaling, weight_bytes
from meshserve.model.loaders import expected_shapes
from meshserve.model.transformer import abstract_model, param_paths


def test_required_presets_exist():
    for name in ("tiny-llama", "smollm2-135m", "llama-2-7b", "llama-2-13b", "llama-2-70b",
                 "gpt2", "gpt2-medium", "gpt3-175b"):
        assert ModelConfig.preset(name).name == name


@pytest.mark.parametrize("name, billions", [("llama-2-7b", 6.74), ("llama-2-13b", 13.02),
                                            ("llama-2-70b", 68.98), ("gpt2", 0.1244),
                                            ("gpt3-175b", 174.6), ("smollm2-135m", 0.1345)])
def test_parameter_counts_match_published_sizes(name, billions):
    assert ModelConfig.preset(name).num_params / 1e9 == pytest.approx(billions, rel=2e-3)


def test_the_llama_2_7b_stress_preset_has_its_widths_and_4_layers():
    full, short = ModelConfig.preset("llama-2-7b"), ModelConfig.preset("llama-2-7b-4l")
    assert short == full.replace(name="llama-2-7b-4l", num_layers=4)
    assert weight_bytes(short) / 1e9 == pytest.approx(4.287, abs=0.001)  # f32, fits 24 GiB


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_model_structure_matches_loader_layout(name):
    config = ModelConfig.preset(name)
    assert param_paths(abstract_model(config)) == expected_shapes(config)


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ValueError, match="known presets.*tiny-llama"):
        ModelConfig.preset("llama-9")


@pytest.mark.parametrize("field, value, message", [
    ("num_kv_heads", 3, "multiple of num_kv_heads"),
    ("dtype", "int8", "dtype"),
    ("arch", "bert", "arch"),
    ("hidden_size", 0, "hidden_size must be a positive"),
])
def test_invalid_fields_are_rejected(field, value, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.preset("tiny-llama", **{field: value})


def test_rope_scaling_type_is_validated():
    with pytest.raises(ValueError, match="rope_scaling type"):
        RopeScaling(rope_type="yarn")


def test_from_hf_reads_the_golden_configs(golden_dir):
    llama = ModelConfig.from_hf(json.loads((golden_dir / "tiny-llama" / "config.json").read_text()))
    assert (llama.arch, llama.num_layers, llama.num_kv_heads, llama.rope_theta) == ("llama", 3, 2,
                                                                                    50000.0)
    scaled = ModelConfig.from_hf(
        json.loads((golden_dir / "tiny-llama3-rope" / "config.json").read_text()))
    assert scaled.rope_scaling.rope_type == "llama3" and scaled.tie_embeddings
    qwen = ModelConfig.from_hf(json.loads((golden_dir / "tiny-qwen2" / "config.json").read_text()))
    assert qwen.qkv_bias
    gpt2 = ModelConfig.from_hf(json.loads((golden_dir / "tiny-gpt2" / "config.json").read_text()))
    assert gpt2.arch == "gpt2" and gpt2.max_position_embeddings == 64


def test_from_hf_rejects_unknown_model_types():
    with pytest.raises(ValueError, match="model_type 'bert' is not supported"):
        ModelConfig.from_hf({"model_type": "bert"})


def test_from_gguf_fields_reports_missing_keys():
    with pytest.raises(ValueError, match="missing required key 'llama.embedding_length'"):
        ModelConfig.from_gguf_fields({"general.architecture": "llama"})
