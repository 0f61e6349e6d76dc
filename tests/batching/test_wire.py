"""The plan stream's wire format: bit-exact packing, bucketed payloads, and strict headers."""

import numpy as np
import pytest

from meshserve.batching import wire


def _mixed_leaves():
    return [
        np.array([[1, -2, 2**31 - 1], [-(2**31), 0, 7]], np.int32),
        np.array([0, 2**31, 2**32 - 1, 12345], np.uint32),
        np.array([-0.0, np.inf, -np.inf, 1.5e-45, 3.25], np.float32),
        np.array([0x7FC00001, 0xFFC12345, 0x7F800001], np.uint32).view(np.float32),  # NaN payloads
        np.array([True, False, True]),
        np.array(42, np.int32),  # 0-d
        np.array(-1.0, np.float32),  # 0-d
        np.zeros((0,), np.float32),
        np.zeros((3, 0), np.int32),
        np.array([[False], [True]]),
    ]


def _bits(a: np.ndarray) -> bytes:
    return a.astype(np.int32).tobytes() if a.dtype == np.bool_ else a.tobytes()


def test_pack_unpack_round_trip_is_bit_exact_for_mixed_leaves():
    leaves = _mixed_leaves()
    payload = wire.pack(leaves)
    out = wire.unpack(payload, [np.empty_like(leaf) for leaf in leaves])
    assert len(out) == len(leaves)
    for got, want in zip(out, leaves):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert _bits(got) == _bits(want)
    assert np.signbit(out[2][0])  # -0.0 stays negative zero


def test_unpacked_leaves_do_not_alias_the_payload():
    payload = wire.pack([np.arange(4, dtype=np.int32)])
    (out,) = wire.unpack(payload, [np.zeros(4, np.int32)])
    payload[:] = 0
    assert out.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("words, bucket", [(0, 1024), (1, 1024), (1024, 1024), (1025, 2048),
                                           (4096, 4096), (4097, 8192)])
def test_payload_bucket_is_a_power_of_two_at_least_the_minimum(words, bucket):
    assert wire.payload_bucket(words) == bucket


@pytest.mark.parametrize("words", [0, 1, 5, 1023, 1024, 1025, 3000, 70_000])
def test_pack_pads_to_the_bucket_with_zeros(words):
    leaf = np.full(words, -1, np.int32)
    payload = wire.pack([leaf])
    size = payload.size
    assert payload.dtype == np.int32 and payload.ndim == 1
    assert size >= max(words, wire.MIN_PAYLOAD_WORDS) and size & (size - 1) == 0
    assert size == wire.payload_bucket(words)
    assert (payload[:words] == -1).all() and (payload[words:] == 0).all()


def test_pack_of_no_leaves_is_one_minimum_zero_payload():
    payload = wire.pack([])
    assert payload.size == wire.MIN_PAYLOAD_WORDS and not payload.any()


def test_pack_lays_leaves_out_in_order():
    payload = wire.pack([np.array([1, 2], np.int32), np.array([True]), np.array(3, np.int32)])
    assert payload[:5].tolist() == [1, 2, 1, 3, 0]


def test_unpack_refuses_a_payload_too_short_for_the_templates():
    payload = wire.pack([np.zeros(10, np.int32)])
    with pytest.raises(ValueError, match="cannot hold"):
        wire.unpack(payload[:9], [np.zeros(10, np.int32)])


@pytest.mark.parametrize("dtype", [np.int64, np.uint32, np.float32])
def test_unpack_refuses_a_payload_that_is_not_int32(dtype):
    with pytest.raises(ValueError):
        wire.unpack(np.zeros(wire.MIN_PAYLOAD_WORDS, dtype), [np.zeros(1, np.int32)])


def test_unpack_refuses_a_payload_that_is_not_one_dimensional():
    with pytest.raises(ValueError):
        wire.unpack(np.zeros((2, 1024), np.int32), [np.zeros(1, np.int32)])


@pytest.mark.parametrize("dtype", [np.int64, np.float64, np.int16, np.float16, np.complex64])
def test_pack_refuses_arrays_that_are_not_four_byte_numbers(dtype):
    with pytest.raises(TypeError, match="cannot send"):
        wire.pack([np.zeros(3, np.int32), np.zeros(2, dtype)])


def test_header_encode_decode_round_trip():
    words = (5, -7, 2**31 - 1, -(2**31))
    header = wire.Header(command=wire.RUN, sequence=41, payload_words=2048, words=words)
    encoded = header.encode()
    assert encoded.dtype == np.int32 and encoded.shape == (wire.HEADER_WORDS,)
    assert encoded[0] == wire.MAGIC
    assert (encoded[4 + len(words):] == 0).all()
    assert wire.Header.decode(encoded, len(words)) == header
    assert wire.Header.decode(encoded, len(words)).name == "RUN"


def test_header_decode_keeps_only_the_asked_number_of_words():
    encoded = wire.Header(command=wire.BEGIN_CALL, sequence=0, payload_words=0,
                          words=(1, 2, 3)).encode()
    assert wire.Header.decode(encoded, 2).words == (1, 2)
    assert wire.Header.decode(encoded, 5).words == (1, 2, 3, 0, 0)


@pytest.mark.parametrize("command", sorted(wire.COMMANDS))
def test_header_round_trips_every_command(command):
    header = wire.Header(command=command, sequence=3, payload_words=0)
    decoded = wire.Header.decode(header.encode(), 0)
    assert decoded == header and decoded.name == wire.COMMANDS[command]


def test_header_holds_the_most_words_it_can():
    words = tuple(range(wire.HEADER_WORDS - 4))
    header = wire.Header(command=wire.RUN, sequence=0, payload_words=0, words=words)
    assert wire.Header.decode(header.encode(), len(words)).words == words


def test_header_encode_refuses_too_many_words():
    header = wire.Header(command=wire.RUN, sequence=0, payload_words=0,
                         words=tuple(range(wire.HEADER_WORDS - 4 + 1)))
    with pytest.raises(ValueError, match="at most 60 words"):
        header.encode()


def test_header_decode_refuses_a_wrong_magic():
    encoded = wire.Header(command=wire.NOOP, sequence=0, payload_words=0).encode()
    encoded[0] = wire.MAGIC + 1
    with pytest.raises(ValueError, match="not a meshserve plan header"):
        wire.Header.decode(encoded, 0)


@pytest.mark.parametrize("words", [np.zeros(wire.HEADER_WORDS - 1, np.int32),
                                   np.zeros(wire.HEADER_WORDS + 1, np.int32),
                                   np.zeros((1, wire.HEADER_WORDS), np.int32),
                                   np.zeros(wire.HEADER_WORDS, np.int64)])
def test_header_decode_refuses_a_wrong_shape_or_dtype(words):
    words.reshape(-1)[0] = wire.MAGIC
    with pytest.raises(ValueError, match="not a meshserve plan header"):
        wire.Header.decode(words, 0)


def test_header_decode_refuses_an_unknown_command():
    encoded = wire.Header(command=wire.NOOP, sequence=0, payload_words=0).encode()
    encoded[1] = 99
    with pytest.raises(ValueError, match="unknown plan command 99"):
        wire.Header.decode(encoded, 0)


@pytest.mark.parametrize("length", [0, 1, 3, 4, 5, 4095, 5000])
def test_bytes_round_trip_through_a_payload(length):
    data = bytes((i * 7 + 1) % 256 for i in range(length))
    payload = wire.bytes_to_payload(data)
    assert payload.dtype == np.int32 and payload.size == wire.payload_bucket(1 + -(-length // 4))
    assert payload[0] == length
    assert wire.payload_to_bytes(payload) == data


def test_bytes_round_trip_keeps_trailing_zero_bytes():
    data = b"ab\0\0\0"
    assert wire.payload_to_bytes(wire.bytes_to_payload(data)) == data


def test_digest_words_is_eight_deterministic_int32_words():
    first = wire.digest_words("hello world")
    assert first == wire.digest_words("hello world")
    assert len(first) == 8
    assert all(isinstance(w, int) and -(2**31) <= w < 2**31 for w in first)


def test_digest_words_are_sha256_known_answers():
    """SHA-256("abc") is ba7816bf 8f01cfea 414140de 5dae2223 b00361a3 96177a9c b410ff61 f20015ad
    (FIPS 180-2, appendix B.1), and SHA-256 of no bytes is e3b0c442 98fc1c14 9afbf4c8 996fb924
    27ae41e4 649b934c a495991b 7852b855; each 4 bytes read as one little-endian int32 word."""
    assert wire.digest_words("abc") == (-1089046342, -355532401, -566214335, 589475421,
                                        -1553923152, -1669720170, 1644105908, -1391132430)
    assert wire.digest_words("") == (1120186595, 337443992, -923468902, 616132505, -465457625,
                                     1284741988, 463050148, 1438143096)
    assert wire.digest_words("abc", count=2) == (-1089046342, -355532401)


def test_digest_words_differ_for_different_text():
    assert wire.digest_words("hello world") != wire.digest_words("hello world!")
    assert wire.digest_words("") != wire.digest_words(" ")


def test_digest_words_fit_a_begin_call_header():
    words = wire.digest_words("prompts: ü, ✓")
    header = wire.Header(command=wire.BEGIN_CALL, sequence=1, payload_words=0, words=words)
    assert wire.Header.decode(header.encode(), 8).words == words
