"""An embedding table kept in quantized blocks: token rows gathered from its codes, and the tied
LM head read from them.

A GGUF file stores `token_embd` as one row of D weights per token, in blocks along D (Q8_0 in
most files, Q6_K or Q4_K in some). The table keeps that layout, `[V, D]`. In `QuantFormat` terms
it is a kernel with one contracted axis (D: the axis the LM head sums over and groups run along),
no output axis, and the vocabulary in front as a stack axis, so its scales are `[V, D / group]`
and the formats, the loaders' block layouts and the checkpoints treat it as any other kernel.
Only a file's own blocks become a quantized table (`meshserve.model.quantized_weights`); a float
table stays float under every scheme.

- `table_rows`: the N rows of `ids`, their codes, scales and mins gathered, then dequantized.
- `table_logits`: logits `[N, V] = x [N, D] . table^T`. Dequantizing the table and multiplying
  would have XLA write the whole table in float to a buffer first (for Gemma 3's 262,144 x 640
  table, 671 MB a step, and as much memory held), so the vocabulary is cut into chunks of
  `CHUNK_BYTES` of float weights, each dequantized into a buffer that stays in cache and
  multiplied by every row, one chunk after another (`jax.lax.map`).
  `scripts/profile_step.py --lm-head` times it against the float table. With `native_kernels`
  a native kernel reads the codes instead, each once (`meshserve.model.native_dot`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshserve.model import native_dot
from meshserve.model.quant_formats import QuantizedArray, dequantize

# Float bytes of one chunk of the table that `table_logits` dequantizes at a time for several
# rows: small enough to stay in a core's cache, large enough that each chunk's product is a
# matrix product rather than a loop of small ones.
CHUNK_BYTES = 4 << 20


def table_rows(table: QuantizedArray, ids: jax.Array, dtype) -> jax.Array:
    """Rows `ids` [...] of the quantized table [V, D], dequantized: [..., D] in `dtype`."""
    rows = table.map(lambda a: jnp.take(a, ids, axis=0))
    return dequantize(rows, xp=jnp).astype(dtype)


def table_logits(x: jax.Array, table: QuantizedArray) -> jax.Array:
    """`x [..., D] . table [V, D]^T` -> [..., V], reading the table from its codes."""
    if native_dot.active() and native_dot.serves_table(x, table):  # `native_kernels`
        with jax.named_scope("quantized table logits (native)"):
            return native_dot.table_dot(x, table)
    lead, d = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, d)
    vocab = table.values.shape[0]
    with jax.named_scope("quantized table logits"):
        chunk = max(1, min(vocab, CHUNK_BYTES // (d * jnp.dtype(x.dtype).itemsize)))
        whole = vocab // chunk * chunk
        arrays = {name: a[:whole].reshape(whole // chunk, chunk, *a.shape[1:])
                  for name, a in table.arrays().items()}
        parts = jax.lax.map(  # [V / c, N, c]
            lambda part: _product(rows, QuantizedArray.from_arrays(part, table.format)), arrays)
        logits = jnp.moveaxis(parts, 0, 1).reshape(rows.shape[0], whole)
        if whole < vocab:
            logits = jnp.concatenate([logits, _product(rows, _slice(table, whole, vocab))], -1)
    return logits.reshape(*lead, vocab)


def _product(rows: jax.Array, table: QuantizedArray) -> jax.Array:
    """rows [N, D] . (dequantized table [C, D])^T -> [N, C]."""
    return jnp.einsum("nd,vd->nv", rows, dequantize(table, xp=jnp).astype(rows.dtype))


def _slice(table: QuantizedArray, start: int, stop: int) -> QuantizedArray:
    return table.map(lambda a: a[start:stop])
