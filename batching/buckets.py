"""Bucket sizes: the one definition of the padded shapes that steps are compiled for.

The scheduler groups work by these buckets and the model runner pads to them, so both sides agree
by construction. Plain Python.
"""

from __future__ import annotations

from typing import Sequence


def bucket_sizes(max_size: int, *, min_size: int = 1) -> tuple[int, ...]:
    """Powers of two from `min_size` up to `max_size`, with `max_size` itself as the last one."""
    assert 1 <= min_size <= max_size, (min_size, max_size)
    sizes, size = [], min_size
    while size < max_size:
        sizes.append(size)
        size *= 2
    return tuple(sizes) + (max_size,)


MIN_TOKEN_BUCKET = 8  # the narrowest prefill row; a prompt's last piece pads to at most this


def token_bucket_sizes(max_tokens: int) -> tuple[int, ...]:
    """The padded widths of prefill rows: powers of two from MIN_TOKEN_BUCKET to `max_tokens`."""
    return bucket_sizes(max_tokens, min_size=min(MIN_TOKEN_BUCKET, max_tokens))


def floor_bucket(value: int, buckets: Sequence[int]) -> int:
    """The largest bucket that `value` fills completely; `value` itself below the smallest."""
    fitting = [size for size in buckets if size <= value]
    return fitting[-1] if fitting else value


def pick_bucket(value: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `value`."""
    for size in buckets:
        if value <= size:
            return size
    raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")
