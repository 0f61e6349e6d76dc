"""MeshConfig: parsing, validation against the devices and the model, and the mesh it builds."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from meshserve.model.config import ModelConfig
from meshserve.model.transformer import abstract_model, stage_sliding_flags
from meshserve.sharding.layout import prepare
from meshserve.sharding.mesh import AXES, MeshConfig
from meshserve.sharding.pipeline_stages import padded_config as stage_padded_config


@pytest.mark.parametrize("text,want", [
    ("data=2,model=4", MeshConfig(data=2, stage=1, model=4)),
    ("model=4,data=2", MeshConfig(data=2, stage=1, model=4)),
    ("model=3", MeshConfig(model=3)),
    ("data=8", MeshConfig(data=8)),
    ("data=1,stage=1,model=1", MeshConfig()),
    ("", MeshConfig()),
    ("  ", MeshConfig()),
    (" data = 2 , model = 4 ", MeshConfig(data=2, model=4)),
])
def test_parse(text, want):
    assert MeshConfig.parse(text) == want


def test_axes_left_out_are_one():
    config = MeshConfig.parse("model=2")
    assert (config.data, config.stage, config.model) == (1, 1, 2)
    assert config.shape == (1, 1, 2)
    assert config.num_devices == 2
    assert MeshConfig.parse("data=2,model=4").num_devices == 8


@pytest.mark.parametrize("text,message", [
    ("tensor=2", "expected comma-separated AXIS=SIZE"),
    ("Model=2", "expected comma-separated AXIS=SIZE"),
    ("model", "expected comma-separated AXIS=SIZE"),
    ("=2", "expected comma-separated AXIS=SIZE"),
    ("model=2,model=4", "axis model is given twice"),
    ("data=2,model=4,data=1", "axis data is given twice"),
    ("model=two", "size of model must be an integer, got 'two'"),
    ("model=2.5", "size of model must be an integer, got '2.5'"),
    ("model=", "size of model must be an integer, got ''"),
    ("model=0", "mesh axis model must be an int >= 1, got 0"),
    ("data=-1", "mesh axis data must be an int >= 1, got -1"),
])
def test_parse_errors_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=_literal(message)):
        MeshConfig.parse(text)


@pytest.mark.parametrize("kwargs,message", [
    ({"model": 0}, "mesh axis model must be an int >= 1, got 0"),
    ({"data": 2.0}, "mesh axis data must be an int >= 1, got 2.0"),
    ({"stage": True}, "mesh axis stage must be an int >= 1, got True"),
    ({"model": "2"}, "mesh axis model must be an int >= 1, got '2'"),
])
def test_constructor_rejects_non_positive_ints(kwargs, message):
    with pytest.raises(ValueError, match=_literal(message)):
        MeshConfig(**kwargs)


def test_coerce():
    config = MeshConfig(data=2, model=2)
    assert MeshConfig.coerce(config) is config
    assert MeshConfig.coerce("data=2,model=2") == config
    assert MeshConfig.coerce(None) == MeshConfig()
    with pytest.raises(TypeError, match="mesh must be a MeshConfig or a string"):
        MeshConfig.coerce(4)
    with pytest.raises(TypeError, match="got dict"):
        MeshConfig.coerce({"model": 4})


@pytest.mark.parametrize("config", [
    MeshConfig(), MeshConfig(model=4), MeshConfig(data=2, model=4), MeshConfig(data=3, stage=2),
])
def test_str_round_trips(config):
    text = str(config)
    assert text == f"data={config.data},stage={config.stage},model={config.model}"
    assert MeshConfig.parse(text) == config


def test_str_is_canonical():
    assert str(MeshConfig.parse("model=4, data=2")) == "data=2,stage=1,model=4"


@pytest.mark.parametrize("text", ["model=1", "model=2", "data=2,model=4", "data=8", "data=2"])
def test_make_mesh_shape_names_and_auto_axes(text):
    config = MeshConfig.parse(text)
    mesh = config.make_mesh()
    assert mesh.axis_names == AXES == ("data", "stage", "model")
    assert dict(mesh.shape) == {"data": config.data, "stage": config.stage, "model": config.model}
    assert mesh.devices.shape == config.shape
    assert tuple(mesh.axis_types) == (AxisType.Auto,) * 3
    assert list(mesh.devices.flat) == jax.devices()[:config.num_devices]


def test_make_mesh_on_a_chosen_device_subset():
    devices = jax.devices()[4:8]
    mesh = MeshConfig(data=2, model=2).make_mesh(devices)
    assert list(mesh.devices.flat) == devices
    assert mesh.devices[1, 0, 0] == devices[2]  # data is the outer axis, model the inner one
    assert mesh.devices[0, 0, 1] == devices[1]
    assert tuple(mesh.axis_types) == (AxisType.Auto,) * 3


def test_make_mesh_needs_exactly_the_devices_given():
    with pytest.raises(ValueError, match=_literal("mesh data=1,stage=1,model=2 needs 2 devices, "
                                                  "got 3")):
        MeshConfig(model=2).make_mesh(jax.devices()[:3])
    with pytest.raises(ValueError, match="needs 4 devices, got 1"):
        MeshConfig(model=4).make_mesh(jax.devices()[:1])


def test_too_many_devices_for_the_visible_ones():
    assert len(jax.devices()) == 8
    with pytest.raises(ValueError, match=_literal("mesh data=2,stage=1,model=8 needs 16 devices, "
                                                  "but only 8 are visible (cpu)")):
        MeshConfig.parse("data=2,model=8").make_mesh()


def test_stages_need_as_many_layers():
    config = ModelConfig.preset("tiny-llama")  # 2 layers
    with pytest.raises(ValueError, match="has 2 layers, fewer than its 3 pipeline stages"):
        MeshConfig(stage=3).check_model(config)
    MeshConfig(stage=2, model=2).check_model(config)


@pytest.mark.parametrize("model_size", [3, 8])
def test_gpt2_heads_must_divide(model_size):
    config = ModelConfig.preset("tiny-gpt2")  # 4 heads, no grouped-query attention to pad
    with pytest.raises(ValueError, match=f"has 4 heads, which do not divide over "
                                         f"model={model_size}"):
        MeshConfig(model=model_size).check_model(config)


@pytest.mark.parametrize("model_size", [1, 2, 4])
def test_gpt2_heads_that_divide_pass(model_size):
    MeshConfig(model=model_size).check_model(ModelConfig.preset("tiny-gpt2"))


@pytest.mark.parametrize("model_size", [2, 3, 4, 8])
def test_llama_heads_that_do_not_divide_pass_the_check(model_size):
    # SmolLM2 has 9 heads and 3 kv heads: the heads are padded instead (see test_padding).
    MeshConfig(model=model_size).check_model(ModelConfig.preset("smollm2-135m"))


def test_prepare_checks_the_mesh_before_building_anything():
    model = abstract_model(ModelConfig.preset("tiny-gpt2"))
    with pytest.raises(ValueError, match="do not divide over model=3"):
        prepare(model, "model=3")
    with pytest.raises(ValueError, match="fewer than its 4 pipeline stages"):
        prepare(model, "stage=4")
    with pytest.raises(ValueError, match="needs 16 devices"):
        prepare(model, "data=4,model=4")


def _literal(message: str) -> str:
    return re.escape(message)


def test_padded_stages_keep_each_layers_sliding_flag():
    """Four layers (sliding, sliding, full, sliding) over 3 stages hold 2, 1, 1 real layers, an
    identity layer after each of the last two; each stage's slice of the padded flags is its own
    layers', identity layers full."""
    types = ("sliding", "sliding", "full", "sliding")
    config = ModelConfig.preset("tiny-llama").replace(num_layers=4, sliding_window=8,
                                                      layer_types=types)
    padded = stage_padded_config(config, 3)
    assert padded.layer_types == ("sliding", "sliding", "full", "full", "sliding", "full")
    flags = [np.asarray(stage_sliding_flags(padded, jnp.int32(s), 3)).tolist() for s in range(3)]
    assert flags == [[True, True], [False, False], [True, False]]
    assert stage_padded_config(config.replace(layer_types=()), 3).layer_types == ()
