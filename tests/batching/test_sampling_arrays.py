"""SamplingArrays: the one table of sampling columns, and the host operations derived from it."""

import dataclasses

import numpy as np

from meshserve.batching.sampling import (COLUMNS, SamplingArrays, SamplingParams,
                                         concat_sampling, greedy_sampling, pad_sampling,
                                         params_columns, scatter_rows)


def _arrays(rows: int, history_width: int, banned_width: int, first: int) -> SamplingArrays:
    """Rows whose every value differs from its column's neutral value."""
    widths = {"history": history_width, "banned": banned_width, "vocab_words": 2}
    columns = {}
    for name, c in COLUMNS.items():
        shape = (rows,) if c.width is None else (rows, widths[c.width])
        values = first + 100 + np.arange(np.prod(shape)).reshape(shape)
        columns[name] = np.ones(shape, bool) if c.dtype is np.bool_ else values.astype(c.dtype)
    return SamplingArrays(**columns)


def test_the_table_is_the_dataclass():
    assert list(COLUMNS) == [f.name for f in dataclasses.fields(SamplingArrays)]
    from_params = {name for name, c in COLUMNS.items() if c.from_params}
    assert from_params <= {f.name for f in dataclasses.fields(SamplingParams)}
    assert {c.width for c in COLUMNS.values()} == {None, "history", "banned", "vocab_words"}


def test_greedy_rows_hold_every_neutral_value_in_its_dtype():
    arrays = greedy_sampling(3, history_width=2)
    for name, c in COLUMNS.items():
        value = getattr(arrays, name)
        assert value.dtype == c.dtype and np.all(value == c.neutral), name
        assert value.shape == ((3,) if c.width is None else (3, 2 if c.width == "history" else 1))


def test_params_columns_copy_the_request_fields():
    params = [SamplingParams(temperature=0.5, top_k=3, min_tokens=2), SamplingParams()]
    columns = params_columns(params)
    assert columns["temperature"].tolist() == [0.5, 1.0] and columns["top_k"].tolist() == [3, 0]
    assert columns["min_tokens"].dtype == np.int32 and columns["min_tokens"].tolist() == [2, 0]


def test_pad_places_rows_and_fills_the_rest_neutral():
    arrays = _arrays(2, history_width=2, banned_width=1, first=0)
    padded = pad_sampling(arrays, rows=4, widths={"history": 3, "banned": 2},
                          index=np.array([3, 1]))
    for name, c in COLUMNS.items():
        value, source = getattr(padded, name), getattr(arrays, name)
        assert value.dtype == c.dtype and value.shape[0] == 4, name
        np.testing.assert_array_equal(value[[3, 1], :source.shape[1]] if source.ndim == 2
                                      else value[[3, 1]], source)
        assert np.all(value[[0, 2]] == c.neutral), name
        if c.width is not None:
            assert np.all(value[:, source.shape[1]:] == c.neutral), name


def test_concat_pads_widths_to_the_widest():
    a = _arrays(1, history_width=1, banned_width=3, first=0)
    b = _arrays(2, history_width=4, banned_width=1, first=1)
    merged = concat_sampling([a, b])
    assert merged.num_rows == 3 and merged.history.shape == (3, 4)
    assert merged.banned_ids.shape == (3, 3)
    np.testing.assert_array_equal(merged.history[0, 1:], -1)
    np.testing.assert_array_equal(merged.banned_ids[1:, 1:], -1)
    np.testing.assert_array_equal(merged.temperature, np.concatenate([a.temperature,
                                                                      b.temperature]))


def test_scatter_puts_each_picked_row_at_its_slot():
    a = _arrays(2, history_width=2, banned_width=1, first=0)
    b = _arrays(1, history_width=3, banned_width=2, first=5)
    out = scatter_rows([(a, 1), (b, 0)], slots=[4, 0], num_slots=6)
    np.testing.assert_array_equal(out.steps, [b.steps[0], 0, 0, 0, a.steps[1], 0])
    assert out.history.shape == (6, 3) and out.banned_ids.shape == (6, 2)
    np.testing.assert_array_equal(out.history[4], list(a.history[1]) + [-1])
    empty = scatter_rows([], slots=[], num_slots=2)
    assert empty.num_rows == 2 and empty.history.shape == (2, 1)
    assert np.all(empty.top_p == 1) and np.all(empty.banned_ids == -1)
