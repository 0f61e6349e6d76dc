"""Per-device memory under tensor parallelism: weight bytes fall as 1 / model.

Measured two ways: from the placed arrays (`addressable_shards` on one device) and from XLA's
own accounting of the compiled step (`memory_analysis().argument_size_in_bytes`, per device; on
CPU it is exactly the sum of the argument shards). The norm scales are replicated, so the weight
bytes are `replicated + split / model` rather than exactly `1 / model` of the total: the
tolerance on the plain ratio is the replicated share (under 0.3% for tiny-llama).
"""

import jax
from flax import nnx

from tests.sharding.compiled import tensor_parallel_step

# tiny-llama with 4 kv heads: every split dimension (vocab 512, ffw 128, heads 4, kv heads 4)
# divides 1, 2 and 4, so no head is padded and the split bytes fall exactly as 1 / model.
EVEN = (("num_kv_heads", 4),)
SIZES = (1, 2, 4)


def test_weight_bytes_per_device_fall_as_one_over_model():
    total = {m: _split_and_replicated(tensor_parallel_step("tiny-llama", f"model={m}",
                                                           overrides=EVEN)) for m in SIZES}
    split_1, replicated_1 = total[1]
    assert replicated_1 > 0 and split_1 > 100 * replicated_1
    for m in SIZES:
        split, replicated = total[m]
        assert replicated == replicated_1  # norm scales: the same full copy everywhere
        assert split * m == split_1  # everything else: exactly 1 / model
        ratio = (split + replicated) / (split_1 + replicated_1)
        assert abs(ratio - 1 / m) <= replicated_1 / (split_1 + replicated_1)


def test_every_device_holds_its_own_quarter_of_the_split_weights():
    """Each split weight is cut into 4 different pieces, one per device, which together are the
    whole array once: a replicated layout (every device a full copy) or a duplicated piece
    fails, as does any device holding more or less than a quarter."""
    step = tensor_parallel_step("tiny-llama", "model=4", overrides=EVEN)
    devices = list(step.runner.layout.mesh.devices.flat)
    split_total = replicated_total = 0
    for _, var in nnx.to_flat_state(step.runner.params):
        array = var[...]
        if "model" not in _mesh_axes(array):
            replicated_total += array.nbytes
            continue
        split_total += array.nbytes
        pieces = {s.device: s.index for s in array.addressable_shards}
        assert sorted(pieces, key=devices.index) == devices
        assert len({_slices(index) for index in pieces.values()}) == 4  # four different pieces
        assert sum(_bytes_on(array, d) for d in devices) == array.nbytes  # the whole, once
    assert split_total > 100 * replicated_total
    for device in devices:
        assert _split_and_replicated(step, device) == (split_total // 4, replicated_total)


def test_compiled_argument_bytes_fall_as_one_over_model():
    # argument_size_in_bytes covers weights, KV pages and the step arrays. Everything split over
    # model (the weights but the norms, and the pages, split by kv head) falls as 1 / model;
    # the rest (norms, per-row step arrays) is the same on every mesh.
    analysis, kept, cache = {}, {}, {}
    for m in SIZES:
        step = tensor_parallel_step("tiny-llama", f"model={m}", overrides=EVEN)
        stats = step.compiled.memory_analysis()
        analysis[m] = stats.argument_size_in_bytes
        device = step.runner.layout.mesh.devices.flat[0]
        assert analysis[m] == _arg_bytes(step.args, device)
        kept[m] = _arg_bytes(step.args, device, split=False)
        # The donated KV pages are the aliased bytes: updated in place, split like the inputs.
        cache[m] = _arg_bytes(step.args[1], device)
        assert stats.alias_size_in_bytes == cache[m]
    assert len(set(kept.values())) == 1
    for m in SIZES:
        assert (analysis[m] - kept[m]) * m == analysis[1] - kept[1]
        assert cache[m] * m == cache[1]
    assert analysis[1] / analysis[4] > 3.9


def test_padded_heads_cost_exactly_their_weights():
    # The tiny-llama preset has 2 kv heads: over model=4 they pad to 4 (and the 4 heads to 8),
    # doubling q, k, v and o. Per device that is 1/4 of the padded model (0.296 of the
    # single-device weights rather than 0.25).
    one = tensor_parallel_step("tiny-llama", "model=1")
    four = tensor_parallel_step("tiny-llama", "model=4")
    c = one.runner.model_config
    assert (four.runner.model_config.num_heads, four.runner.model_config.num_kv_heads) == (8, 4)
    # q and o: L * D * H * h each; k and v: L * D * K * h each; float32.
    attention_bytes = 4 * c.num_layers * c.hidden_size * c.head_dim * (
        2 * c.num_heads + 2 * c.num_kv_heads)
    split_1, replicated = _split_and_replicated(one)
    split_4, replicated_4 = _split_and_replicated(four)
    assert replicated_4 == replicated
    assert split_4 * 4 == split_1 + attention_bytes  # the padding: as many heads again


def _split_and_replicated(step, device=None) -> tuple[int, int]:
    """Weight bytes on one device: (of the weights split over model, of the others)."""
    device = device or step.runner.layout.mesh.devices.flat[0]
    split = replicated = 0
    for _, var in nnx.to_flat_state(step.runner.params):
        array = var[...]
        nbytes = _bytes_on(array, device)
        if "model" in _mesh_axes(array):
            split += nbytes
        else:
            replicated += nbytes
    return split, replicated


def _arg_bytes(tree, device, *, split: bool | None = None) -> int:
    """Bytes of `tree`'s arrays on `device`; with `split`, only those split over model (True) or
    not (False)."""
    return sum(_bytes_on(x, device) for x in jax.tree.leaves(tree)
               if split is None or ("model" in _mesh_axes(x)) == split)


def _bytes_on(array: jax.Array, device) -> int:
    return sum(s.data.nbytes for s in array.addressable_shards if s.device == device)


def _slices(index: tuple[slice, ...]) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)


def _mesh_axes(array: jax.Array) -> set[str]:
    axes = set()
    for entry in array.sharding.spec:
        axes.update(entry if isinstance(entry, tuple) else (entry,))
    return axes - {None}
