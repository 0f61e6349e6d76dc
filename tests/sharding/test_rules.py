"""The rules table: logical axes -> partition specs for every weight, the KV cache and the rows."""

import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from meshserve.batching.plan import sub_batch_from_rows
from meshserve.model.config import ModelConfig
from meshserve.model.executor.runner import ModelRunner, RunnerConfig
from meshserve.model.transformer import abstract_model, model_from_params
from meshserve.sharding.layout import device_layout, prepare
from meshserve.sharding.mesh import MeshConfig
from meshserve.sharding.rules import (DEFAULT_RULES, KV_CACHE_AXES, LOGITS_AXES, RESIDUAL_AXES,
                                      ShardingRules)
from tests.conftest import random_params

# The layer axis goes to `stage` (a no-op on these meshes, whose stage axis has size 1).
LLAMA_SPECS = {
    "embed/embedding": P("model"),  # (vocab, embed): vocabulary-parallel
    "layers/attn/q/kernel": P("stage", None, "model"),  # (layers, embed, heads, head_dim): column
    "layers/attn/k/kernel": P("stage", None, "model"),  # (layers, embed, kv_heads, head_dim)
    "layers/attn/v/kernel": P("stage", None, "model"),
    "layers/attn/o/kernel": P("stage", "model"),  # (layers, heads, head_dim, embed): row
    "layers/mlp/gate/kernel": P("stage", None, "model"),  # (layers, embed, ffw): column
    "layers/mlp/up/kernel": P("stage", None, "model"),
    "layers/mlp/down/kernel": P("stage", "model"),  # (layers, ffw, embed): row
    "layers/attn_norm/scale": P("stage"),
    "layers/mlp_norm/scale": P("stage"),
    "final_norm/scale": P(),
    "lm_head/kernel": P(None, "model"),  # (embed, vocab): vocabulary-parallel
}
QKV_BIAS_SPECS = {  # (layers, heads, head_dim), as Qwen2 has them
    "layers/attn/q/bias": P("stage", "model"),
    "layers/attn/k/bias": P("stage", "model"),
    "layers/attn/v/bias": P("stage", "model"),
}
GPT2_SPECS = {
    "embed/embedding": P("model"),
    "pos_embed/embedding": P(),  # (positions, embed)
    "layers/attn/qkv/kernel": P("stage", None, None, "model"),  # (layers, embed, qkv, heads, h)
    "layers/attn/qkv/bias": P("stage", None, "model"),  # (layers, qkv, heads, head_dim)
    "layers/attn/o/kernel": P("stage", "model"),
    "layers/attn/o/bias": P("stage"),  # (layers, embed): added after the all-reduce
    "layers/mlp/up/kernel": P("stage", None, "model"),
    "layers/mlp/up/bias": P("stage", "model"),  # (layers, ffw)
    "layers/mlp/down/kernel": P("stage", "model"),
    "layers/mlp/down/bias": P("stage"),
    "layers/attn_norm/scale": P("stage"), "layers/attn_norm/bias": P("stage"),
    "layers/mlp_norm/scale": P("stage"), "layers/mlp_norm/bias": P("stage"),
    "final_norm/scale": P(), "final_norm/bias": P(),
}


@pytest.mark.parametrize("preset,overrides,want", [
    ("tiny-llama", {}, LLAMA_SPECS),
    ("tiny-llama", {"qkv_bias": True}, {**LLAMA_SPECS, **QKV_BIAS_SPECS}),
    ("tiny-llama", {"tie_embeddings": True},
     {k: v for k, v in LLAMA_SPECS.items() if k != "lm_head/kernel"}),
    ("tiny-gpt2", {}, GPT2_SPECS),
])
@pytest.mark.parametrize("mesh", ["model=2", "model=4", "data=2,model=2"])
def test_weight_specs(preset, overrides, want, mesh):
    config = ModelConfig.preset(preset, **overrides)
    prepared = prepare(model_from_params(config, random_params(config)), mesh)
    assert _param_specs(prepared.layout) == want
    assert prepared.replicated == {}


def test_layout_alone_replicates_kv_heads_that_do_not_divide():
    # device_layout does not pad: tiny-llama's 2 kv heads over model=4 stay whole.
    model = abstract_model(ModelConfig.preset("tiny-llama"))
    specs = _param_specs(device_layout(model, MeshConfig(model=4).make_mesh()))
    assert specs["layers/attn/k/kernel"] == specs["layers/attn/v/kernel"] == P("stage")
    assert specs["layers/attn/q/kernel"] == P("stage", None, "model")  # 4 heads divide


def test_weight_specs_of_smollm2_when_everything_divides():
    model = abstract_model(ModelConfig.preset("smollm2-135m"))  # 9 heads, 3 kv heads, tied
    layout = device_layout(model, MeshConfig(model=3).make_mesh())
    assert _param_specs(layout) == {k: v for k, v in LLAMA_SPECS.items() if k != "lm_head/kernel"}
    assert layout.cache.spec == P("stage", "model", "data")


def test_placed_weights_carry_their_specs():
    config = ModelConfig.preset("tiny-llama")
    prepared = prepare(model_from_params(config, random_params(config)), "data=2,model=2")
    runner = ModelRunner(prepared.model, _runner_config(), prepared.layout)
    for path, var in nnx.to_flat_state(runner.params):
        key = "/".join(map(str, path))
        assert var[...].sharding.spec == LLAMA_SPECS[key], key
        assert var[...].sharding.mesh == prepared.layout.mesh
    # A column-parallel kernel: each model shard holds half the heads, both data replicas hold it.
    q = runner.params["layers"]["attn"]["q"]["kernel"][...]
    assert {s.data.shape for s in q.addressable_shards} == {(2, 64, 2, 16)}
    assert len({str(s.index) for s in q.addressable_shards}) == 2


def test_duplicate_mesh_axis_raises():
    with pytest.raises(ValueError, match="put two dimensions on one mesh axis"):
        DEFAULT_RULES.spec(("heads", "kv_heads"))
    with pytest.raises(ValueError, match="put two dimensions on one mesh axis"):
        DEFAULT_RULES.spec(("ffw", "vocab"))
    # Two dimensions that are both replicated are fine.
    assert DEFAULT_RULES.spec(("embed", "head_dim")) == P()
    # A table that also splits embed over model cannot place the q kernel (embed, heads).
    rules = ShardingRules({**DEFAULT_RULES.table, "embed": "model"})
    model = abstract_model(ModelConfig.preset("tiny-llama"))
    with pytest.raises(ValueError, match="put two dimensions on one mesh axis: .*'model', 'model'"):
        device_layout(model, MeshConfig(model=2).make_mesh(), rules)


def test_table_must_name_mesh_axes():
    with pytest.raises(ValueError, match="mesh axes are"):
        ShardingRules({"heads": "tensor"})


def test_unknown_logical_axes_are_replicated():
    assert DEFAULT_RULES.spec(("something", "heads")) == P(None, "model")
    assert DEFAULT_RULES.mesh_axis("something") is None
    assert DEFAULT_RULES.mesh_axis(None) is None


def test_indivisible_dims_are_replicated_and_reported():
    mesh = MeshConfig(model=4).make_mesh()
    axes = ("vocab", "embed")
    assert DEFAULT_RULES.spec(axes, (49154, 64), mesh) == P()
    assert DEFAULT_RULES.replicated_dims(axes, (49154, 64), mesh) == ["vocab"]
    assert DEFAULT_RULES.spec(axes, (49152, 64), mesh) == P("model")
    assert DEFAULT_RULES.replicated_dims(axes, (49152, 64), mesh) == []
    # A replicated logical axis is never reported, whatever its size.
    assert DEFAULT_RULES.replicated_dims(("embed",), (63,), mesh) == []
    # Without a shape, divisibility is not checked.
    assert DEFAULT_RULES.spec(axes) == P("model")


def test_unpadded_smollm2_heads_do_not_divide_two():
    # The layout alone replicates what does not divide; prepare pads the heads instead.
    model = abstract_model(ModelConfig.preset("smollm2-135m"))
    mesh = MeshConfig(model=2).make_mesh()
    specs = _param_specs(device_layout(model, mesh))
    assert specs["layers/attn/q/kernel"] == P("stage")
    assert specs["layers/attn/k/kernel"] == P("stage")
    assert specs["layers/attn/o/kernel"] == P("stage")
    assert specs["layers/mlp/gate/kernel"] == P("stage", None, "model")  # 1536 divides
    assert specs["embed/embedding"] == P("model")  # 49152 divides
    assert DEFAULT_RULES.replicated_dims(("layers", "embed", "heads", "head_dim"),
                                         (30, 576, 9, 64), mesh) == ["heads"]


def test_prepare_reports_replicated_weights():
    config = ModelConfig.preset("tiny-llama", vocab_size=510)  # 510 = 2 * 255: not over 4
    with pytest.warns(UserWarning, match=r"embed/embedding \(vocab\), lm_head/kernel \(vocab\)"):
        prepared = prepare(model_from_params(config, random_params(config)), "model=4")
    assert prepared.replicated == {"embed/embedding": ["vocab"], "lm_head/kernel": ["vocab"]}
    specs = _param_specs(prepared.layout)
    assert specs["embed/embedding"] == P() and specs["lm_head/kernel"] == P()
    assert specs["layers/attn/q/kernel"] == P("stage", None, "model")  # padded 4 -> 8 heads


def test_prepare_pads_smollm2_heads_so_nothing_is_replicated():
    config = ModelConfig.preset("smollm2-135m", num_layers=1, vocab_size=256)
    prepared = prepare(model_from_params(config, random_params(config, scale=0.04)), "model=2")
    assert prepared.replicated == {}
    assert (prepared.model.config.num_heads, prepared.model.config.num_kv_heads) == (12, 4)
    assert _param_specs(prepared.layout) == {k: v for k, v in LLAMA_SPECS.items()
                                             if k != "lm_head/kernel"}


def test_only_drops_mesh_axes():
    assert DEFAULT_RULES.spec(KV_CACHE_AXES) == P("stage", "model", "data")
    assert DEFAULT_RULES.spec(KV_CACHE_AXES, only=("data",)) == P(None, None, "data")
    assert DEFAULT_RULES.spec(KV_CACHE_AXES, only=("model", "stage")) == P("stage", "model")
    assert DEFAULT_RULES.spec(LOGITS_AXES) == P("data", "model")
    assert DEFAULT_RULES.spec(LOGITS_AXES, only=("model",)) == P(None, "model")
    assert DEFAULT_RULES.spec(LOGITS_AXES, only=()) == P()
    assert DEFAULT_RULES.spec(RESIDUAL_AXES) == P()


def test_replica_axes_follow_the_batch_rule():
    assert DEFAULT_RULES.replica_axes() == ("data",)
    assert ShardingRules({**DEFAULT_RULES.table, "batch": None}).replica_axes() == ()


def test_a_different_table_changes_the_layout_without_a_model_edit():
    model = abstract_model(ModelConfig.preset("tiny-llama"))
    mesh = MeshConfig(model=2).make_mesh()
    no_ffw = _param_specs(device_layout(model, mesh, ShardingRules(
        {**DEFAULT_RULES.table, "ffw": None})))
    mlp = {"layers/mlp/gate/kernel", "layers/mlp/up/kernel", "layers/mlp/down/kernel"}
    assert {k: no_ffw[k] for k in mlp} == dict.fromkeys(mlp, P("stage"))
    assert {k: v for k, v in no_ffw.items() if k not in mlp} == {
        k: v for k, v in LLAMA_SPECS.items() if k not in mlp}

    replicated = device_layout(model, mesh, ShardingRules({}))
    assert set(_param_specs(replicated).values()) == {P()}
    assert replicated.cache.spec == P()
    assert replicated.replica_axes == () and replicated.num_replicas == 1


def test_a_different_table_places_real_weights_and_keeps_the_logits():
    config = ModelConfig.preset("tiny-llama")
    model = model_from_params(config, random_params(config))
    rules = ShardingRules({**DEFAULT_RULES.table, "ffw": None, "vocab": None})
    prepared = prepare(model, "model=2", rules=rules)
    runner = ModelRunner(prepared.model, _runner_config(), prepared.layout)
    down = runner.params["layers"]["mlp"]["down"]["kernel"][...]
    q = runner.params["layers"]["attn"]["q"]["kernel"][...]
    assert down.sharding.is_fully_replicated
    assert not q.sharding.is_fully_replicated
    reference = ModelRunner(model, _runner_config())
    plan = _decode_plan(config)
    (got,), (want,) = runner.run_step([plan]), reference.run_step([plan])
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.top_ids, want.top_ids)
    np.testing.assert_allclose(got.top_logprobs, want.top_logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mesh,replicas", [
    ("model=2", 1), ("data=2", 2), ("data=2,model=2", 2), ("data=2,model=4", 2),
])
def test_kv_cache_and_row_shardings(mesh, replicas):
    # [layers, kv_heads, pages, page_slot, head_dim]: split by head over model, by page over data
    # (an axis of size 1 keeps its name: the same specs serve every mesh shape).
    cache, cache_manual, rows = P("stage", "model", "data"), P(None, None, "data"), P("data")
    config = ModelConfig.preset("tiny-llama")
    prepared = prepare(model_from_params(config, random_params(config)), mesh)
    layout = prepared.layout
    assert layout.cache.spec == cache
    assert layout.cache_manual == cache_manual
    assert layout.rows.spec == rows
    assert layout.rows_manual == P("data")
    assert layout.replica_axes == ("data",)
    assert layout.num_replicas == replicas
    runner = ModelRunner(prepared.model, _runner_config(), layout)
    for pages in (runner.cache.k, runner.cache.v):
        assert pages.sharding.spec == cache
        c, m = prepared.model.config, layout.mesh.shape
        pool = runner.config.num_pages * replicas
        assert pages.shape == (c.num_layers, c.num_kv_heads, pool, runner.config.page_size,
                               c.head_dim)
        assert {s.data.shape for s in pages.addressable_shards} == {
            (c.num_layers, c.num_kv_heads // m["model"], pool // m["data"], runner.config.page_size,
             c.head_dim)}


def _param_specs(layout) -> dict[str, P]:
    flat = nnx.to_flat_state(layout.params)
    return {"/".join(map(str, path)): sharding.spec for path, sharding in flat}


def _runner_config() -> RunnerConfig:
    return RunnerConfig(num_pages=16, page_size=8, max_num_seqs=4, max_num_batched_tokens=16,
                        max_pages_per_seq=4, max_logprobs=4)


def _decode_plan(config):
    rng = np.random.default_rng(3)
    rows = [(list(rng.integers(2, config.vocab_size, 5)), 0, [1 + i]) for i in range(3)]
    return sub_batch_from_rows(rows, page_size=8)
