"""Times the two ways to compute a ragged step's LoRA deltas for one projection of one layer:

    one-hot   every slot's x A in one matmul, masked to each token's own slot, then one matmul
              with B flattened over (slot, rank): what `meshserve.model.lora.LoraSlab` does
    gather    each token's own A and B gathered ([T, in, r], [T, r, out]), then two batched
              matrix-vector products (BGMV)

for SmolLM2-135M's projection widths, S slots of rank 16 and steps of T tokens (the adapter of
each token drawn at random, the base model among them). Both give the same deltas (checked).

    python scripts/lora_delta_bench.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

RANK = 16
WIDTHS = ((576, 576), (576, 1536))  # q or o; gate or up
SLOTS = (4, 16)
TOKENS = (4, 16, 64, 256)


def one_hot(x, a, b, slots):
    """x [T, I], a [I, S, r], b [S, r, O], slots [T] (0: none) -> [T, O]."""
    num_slots, rank = b.shape[0], b.shape[1]
    selection = jax.nn.one_hot(slots - 1, num_slots, dtype=x.dtype)  # [T, S]
    h = (x @ a.reshape(-1, num_slots * rank)) * jnp.repeat(selection, rank, axis=1)
    return h @ b.reshape(num_slots * rank, -1)


def gather(x, a, b, slots):
    index = jnp.clip(slots - 1, 0, b.shape[0] - 1)
    a_t = jnp.take(jnp.moveaxis(a, 1, 0), index, axis=0)  # [T, I, r]
    b_t = jnp.take(b, index, axis=0)  # [T, r, O]
    y = jnp.einsum("tr,tro->to", jnp.einsum("ti,tir->tr", x, a_t), b_t)
    return y * (slots > 0)[:, None]


def microseconds(fn, *args, repeats: int = 200) -> float:
    fn(*args).block_until_ready()
    started = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - started) / repeats * 1e6


def main() -> None:
    rng = np.random.default_rng(0)
    print("in    out   slots tokens  one-hot us  gather us")
    for width_in, width_out in WIDTHS:
        for num_slots in SLOTS:
            a = jnp.asarray(rng.standard_normal((width_in, num_slots, RANK)), jnp.float32)
            b = jnp.asarray(rng.standard_normal((num_slots, RANK, width_out)), jnp.float32)
            for num_tokens in TOKENS:
                x = jnp.asarray(rng.standard_normal((num_tokens, width_in)), jnp.float32)
                slots = jnp.asarray(rng.integers(0, num_slots + 1, num_tokens), jnp.int32)
                fast, slow = jax.jit(one_hot), jax.jit(gather)
                np.testing.assert_allclose(fast(x, a, b, slots), slow(x, a, b, slots),
                                           rtol=1e-3, atol=1e-2)
                print(f"{width_in:<5} {width_out:<5} {num_slots:<5} {num_tokens:<6} "
                      f"{microseconds(fast, x, a, b, slots):>10.1f} "
                      f"{microseconds(slow, x, a, b, slots):>10.1f}")


if __name__ == "__main__":
    main()
