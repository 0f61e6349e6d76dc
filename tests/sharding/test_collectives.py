"""The collectives XLA inserts into the compiled step: Megatron tensor parallelism, read off the
partitioned HLO.

The layers run in one `lax.scan`, which becomes one while loop whose state carries the KV cache;
its body is one layer, so the per-layer collectives appear there once. Found on the decode step
(T = 1) of tiny-llama and tiny-gpt2 over model = 2 and 4:

- loop body: exactly two all-reduces, both of the residual stream [N, D]: after the attention-out
  projection (row-parallel o) and after the MLP-down projection (row-parallel down); nothing else;
- outside the loop: one all-reduce [N, D] for the vocabulary-parallel embedding lookup (a masked
  local gather, then a sum), and the sampler's reductions over the vocabulary-sharded logits,
  all of them per row: all-reduces of [B] or [B, 1] (max, sum, the picked logprob), all-gathers
  of [B, model] (one candidate per shard) and of [B, V] (the top-k logprobs row);
- every collective groups the devices of one model replica; across data replicas there is only
  the scalar all-greedy vote of the sampler.
"""

import numpy as np
import pytest
from flax import nnx

from tests.sharding.compiled import (ROWS, replica_groups, source_target_pairs,
                                     tensor_parallel_step)

TENSOR_PARALLEL_CASES = [
    ("tiny-llama", "model=2"), ("tiny-llama", "model=4"), ("tiny-llama", "data=2,model=2"),
    ("tiny-gpt2", "model=2"),
]


@pytest.mark.parametrize("preset,mesh,tokens", [
    ("tiny-llama", "model=2", 1),
    ("tiny-llama", "model=4", 1),  # 2 kv heads padded to 4
    ("tiny-llama", "data=2,model=2", 1),
    ("tiny-gpt2", "model=2", 1),
    ("tiny-llama", "model=2", 16),  # a prefill bucket: N = 4 rows * 16 tokens
])
def test_one_all_reduce_after_attention_and_one_after_mlp_per_layer(preset, mesh, tokens):
    step = tensor_parallel_step(preset, mesh, tokens)
    hlo, config = step.hlo, step.runner.model_config
    residual = (ROWS * tokens, config.hidden_size)  # [N, D] per replica
    loop = hlo.loop_carrying(_cache_shard_shape(step))
    assert hlo.trip_count(loop) == config.num_layers
    body = hlo.body(loop)

    inside = hlo.collectives(body)
    assert [op.opcode for op in inside] == ["all-reduce", "all-reduce"]
    assert [op.shapes for op in inside] == [(("f32", residual),)] * 2
    # Each sums the partial products of a row-parallel projection, named by its einsum.
    assert ["nqh,qhd->nd" in op.text for op in inside].count(True) == 1  # attention out (o)
    assert ["nf,fd->nd" in op.text for op in inside].count(True) == 1  # MLP down

    outside = hlo.collectives(set(hlo.computations) - body)
    assert [op.shapes for op in outside if op.opcode == "all-reduce"
            and op.shapes == (("f32", residual),)] == [(("f32", residual),)]  # the embedding


@pytest.mark.parametrize("preset,mesh", TENSOR_PARALLEL_CASES)
def test_vocabulary_collectives_are_per_row(preset, mesh):
    step = tensor_parallel_step(preset, mesh)
    hlo, config = step.hlo, step.runner.model_config
    model_size = step.runner.layout.mesh.shape["model"]
    body = hlo.body(hlo.loop_carrying(_cache_shard_shape(step)))
    outside = set(hlo.computations) - body
    residual = (ROWS, config.hidden_size)
    vocab_reductions = [op for op in hlo.ops("all-reduce", outside)
                        if op.shapes != (("f32", residual),) and _arrays(op) != [()]]
    # The logits are split over the vocabulary, so the log-softmax needs its max and sum.
    assert len(vocab_reductions) >= 2
    for op in vocab_reductions:
        assert all(dims in ((ROWS,), (ROWS, 1)) for dims in _arrays(op)), op.text[:200]
    gathers = hlo.ops("all-gather", outside)
    assert gathers, "the top-k logprobs need the whole logits row"
    for op in gathers:
        assert all(dims in ((ROWS, model_size), (ROWS, config.vocab_size))
                   for dims in _arrays(op)), op.text[:200]


@pytest.mark.parametrize("preset,mesh", TENSOR_PARALLEL_CASES)
def test_no_weight_is_ever_gathered(preset, mesh):
    # The rule: every array that a collective moves is activation-sized. Each all-gather result
    # leads with the row count B (4) and holds at most one logits row per row (B * V elements);
    # every other collective moves [N, D] residuals, per-row values or scalars. A gathered weight
    # (whole or in part) would lead with L, V, D or the position count, and every weight split
    # matrix split over model has more than B * V elements; both facts are checked first, so the
    # rule bites. (Split biases are smaller, but lead with L.)
    step = tensor_parallel_step(preset, mesh)
    hlo, config = step.hlo, step.runner.model_config
    bound = ROWS * config.vocab_size
    weights = _weight_shapes(step)
    assert ROWS not in {full[0] for full, _ in weights.values()}
    split = {key: full for key, (full, shard) in weights.items()
             if full != shard and key.endswith(("kernel", "embedding"))}
    assert split and min(int(np.prod(full)) for full in split.values()) > bound
    shapes = {s for pair in weights.values() for s in pair}

    for op in hlo.collectives():
        for dims in _arrays(op):
            assert dims not in shapes, op.text[:200]
            assert int(np.prod(dims)) <= max(bound, ROWS * config.hidden_size), op.text[:200]
    for op in hlo.ops("all-gather"):
        for dims in _arrays(op):
            assert dims[0] == ROWS and int(np.prod(dims)) <= bound, op.text[:200]


@pytest.mark.parametrize("mesh", ["model=2", "model=4", "data=2,model=2"])
def test_collectives_stay_within_a_model_replica(mesh):
    step = tensor_parallel_step("tiny-llama", mesh)
    layout = step.runner.layout
    data, model = layout.mesh.shape["data"], layout.mesh.shape["model"]
    model_groups = [list(range(r * model, (r + 1) * model)) for r in range(data)]
    replica_of = {d: r for r, group in enumerate(model_groups) for d in group}
    for op in step.hlo.collectives():
        if op.opcode == "collective-permute":  # the vocabulary-sharded sort of the sampler
            assert all(replica_of[a] == replica_of[b] for a, b in source_target_pairs(op))
        elif _arrays(op) != [()]:  # a scalar is the sampler's all-greedy vote, one per replica
            assert replica_groups(op, data * model) == model_groups, op.text[:200]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
def test_data_parallel_step_moves_no_weights(preset):
    # Each replica holds all the weights and its own rows and pages: the only collective left is
    # the scalar that makes every replica take the same sampler branch.
    step = tensor_parallel_step(preset, "data=2")
    collectives = step.hlo.collectives()
    assert [(op.opcode, _arrays(op)) for op in collectives] in ([], [("all-reduce", [()])])
    for op in collectives:
        assert replica_groups(op, 2) == [[0, 1]]
    loop = step.hlo.loop_carrying(_cache_shard_shape(step))
    assert step.hlo.collectives(step.hlo.body(loop)) == []


def test_a_replicated_mlp_leaves_one_all_reduce_per_layer():
    # The rules table with ffw -> None: the same model, the MLP computed whole on every device.
    step = tensor_parallel_step("tiny-llama", "model=2", rules="ffw-replicated")
    hlo, config = step.hlo, step.runner.model_config
    body = hlo.body(hlo.loop_carrying(_cache_shard_shape(step)))
    inside = hlo.collectives(body)
    assert [(op.opcode, op.shapes) for op in inside] == [
        ("all-reduce", (("f32", (ROWS, config.hidden_size)),))]
    assert "nqh,qhd->nd" in inside[0].text  # the one left follows the attention-out projection


def _cache_shard_shape(step) -> tuple[int, ...]:
    return step.runner.cache.k.addressable_shards[0].data.shape


def _arrays(op) -> list[tuple[int, ...]]:
    return [dims for _, dims in op.shapes]


def _weight_shapes(step) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Weight -> (full shape, per-device shard shape)."""
    out = {}
    for path, var in nnx.to_flat_state(step.runner.params):
        array = var[...]
        out["/".join(map(str, path))] = (array.shape, array.addressable_shards[0].data.shape)
    return out
