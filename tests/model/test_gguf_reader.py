"""meshserve's GGUF reader (`meshserve.model.gguf_reader`) reads what `gguf.GGUFWriter` writes,
value for value and byte for byte as `gguf.GGUFReader` does, and refuses broken files clearly.
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from meshserve.model.gguf_reader import as_python, open_gguf

GGML = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType

SCALARS = {
    "test.u8": (200, VT.UINT8), "test.i8": (-100, VT.INT8),
    "test.u16": (60000, VT.UINT16), "test.i16": (-30000, VT.INT16),
    "test.u32": (4_000_000_000, VT.UINT32), "test.i32": (-2_000_000_000, VT.INT32),
    "test.u64": (2**63 + 5, VT.UINT64), "test.i64": (-(2**62), VT.INT64),
    "test.f32": (0.5, VT.FLOAT32), "test.f64": (1e-300, VT.FLOAT64),
    "test.true": (True, VT.BOOL), "test.false": (False, VT.BOOL),
    "test.string": ("naïve ▁text — 東京", VT.STRING),
}
NUMBER_ARRAYS = {
    "test.u8s": ([0, 1, 255], VT.UINT8), "test.i8s": ([-128, 0, 127], VT.INT8),
    "test.u16s": ([1, 65535], VT.UINT16), "test.i16s": ([-32768, 7], VT.INT16),
    "test.u32s": ([1, 2**32 - 1], VT.UINT32), "test.i32s": ([-5, 5, 9], VT.INT32),
    "test.u64s": ([2**64 - 1, 0], VT.UINT64), "test.i64s": ([-(2**63), 1], VT.INT64),
    "test.f32s": ([0.25, -1.5, 3.0], VT.FLOAT32), "test.f64s": ([0.1, 1e200], VT.FLOAT64),
    "test.bools": ([True, False, True], VT.BOOL),
}
STRINGS = ["<s>", "▁the", "", "日本", "<0x0A>"]
NESTED_STRINGS = [["a", "bc"], ["▁d"], ["", "é", "f"]]
NESTED_NUMBERS = [[1, 2, 3], [4]]


def quantized_bytes(qtype: GGML, rows: int, width: int, seed: int) -> np.ndarray:
    """Random bytes of a `[rows, width]` tensor in `qtype` (the reader checks bytes, not
    values)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (rows, width // block_size * type_size), dtype=np.uint8)


def tensors() -> dict[str, np.ndarray | tuple[np.ndarray, GGML]]:
    rng = np.random.default_rng(0)
    return {
        "f32.weight": rng.standard_normal((3, 5)).astype(np.float32),
        "f16.weight": rng.standard_normal((2, 3, 4)).astype(np.float16),
        "f64.weight": rng.standard_normal(7),
        "i8.weight": np.arange(-4, 5, dtype=np.int8),
        "i32.weight": np.arange(6, dtype=np.int32).reshape(2, 3),
        "bf16.weight": (quantized_bytes(GGML.BF16, 4, 8, 1), GGML.BF16),
        "q8_0.weight": (gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32),
                                             GGML.Q8_0), GGML.Q8_0),
        "q4_0.weight": (quantized_bytes(GGML.Q4_0, 3, 64, 2), GGML.Q4_0),
        "q4_k.weight": (quantized_bytes(GGML.Q4_K, 2, 512, 3), GGML.Q4_K),
        "q6_k.weight": (quantized_bytes(GGML.Q6_K, 3, 256, 4), GGML.Q6_K),
    }


def write_everything(path: Path, *, alignment: int | None = None,
                     endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> Path:
    """A GGUF of every metadata value type and several tensor types."""
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (value, vtype) in SCALARS.items():
        writer.add_key_value(key, value, vtype)
    for key, (values, vtype) in NUMBER_ARRAYS.items():
        writer.add_key_value(key, values, VT.ARRAY, sub_type=vtype)
    writer.add_array("test.strings", STRINGS)
    writer.add_key_value("test.nested_strings", NESTED_STRINGS, VT.ARRAY, sub_type=VT.ARRAY)
    writer.add_key_value("test.nested_numbers", NESTED_NUMBERS, VT.ARRAY, sub_type=VT.ARRAY)
    for name, tensor in tensors().items():
        if isinstance(tensor, tuple):
            writer.add_tensor(name, tensor[0], raw_dtype=tensor[1])
        else:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def flattened(value):
    """A value as `gguf.ReaderField.contents()` gives it: nested arrays flattened."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        return [item for inner in value for item in flattened(inner)]
    return value


@pytest.mark.parametrize("alignment", [None, 64, 256])
def test_metadata_and_tensors_match_gguf_reader(tmp_path, alignment):
    path = write_everything(tmp_path / "everything.gguf", alignment=alignment)
    ours, theirs = open_gguf(path), gguf.GGUFReader(path)
    fields = {name: field for name, field in theirs.fields.items()
              if not name.startswith("GGUF.")}  # the reader's own header pseudo-fields
    assert list(ours.metadata) == list(fields)
    for name, field in fields.items():
        value = as_python(ours.metadata[name])
        assert flattened(value) == field.contents(), name
        assert type(flattened(value)) is type(field.contents()), name
    assert (ours.version, ours.alignment) == (3, alignment or 32)
    assert list(ours.tensors) == [tensor.name for tensor in theirs.tensors]
    for tensor in theirs.tensors:
        mine = ours.tensors[tensor.name]
        assert mine.ggml_type == tensor.tensor_type, tensor.name
        assert mine.shape == tuple(reversed(tensor.shape.tolist())), tensor.name
        assert mine.offset == tensor.data_offset and mine.offset % ours.alignment == 0
        assert (mine.data.dtype, mine.data.shape) == (tensor.data.dtype, tensor.data.shape)
        assert mine.data.tobytes() == np.asarray(tensor.data).tobytes(), tensor.name


def test_metadata_values_are_what_was_written(tmp_path):
    metadata = open_gguf(write_everything(tmp_path / "everything.gguf")).metadata
    for key, (value, _) in SCALARS.items():
        assert metadata[key] == value and type(metadata[key]) is type(value), key
    for key, (values, _) in NUMBER_ARRAYS.items():
        assert isinstance(metadata[key], np.ndarray) and metadata[key].tolist() == values, key
    assert metadata["test.bools"].dtype == np.bool_
    assert metadata["test.strings"] == STRINGS
    assert metadata["test.nested_strings"] == NESTED_STRINGS
    assert [inner.tolist() for inner in metadata["test.nested_numbers"]] == NESTED_NUMBERS
    assert metadata["general.architecture"] == "llama"


def test_tensor_data_are_read_only_views_of_the_file(tmp_path):
    written = tensors()
    reader = open_gguf(write_everything(tmp_path / "everything.gguf"))
    for name, tensor in reader.tensors.items():
        assert not tensor.data.flags.owndata and not tensor.data.flags.writeable, name
        expected = written[name][0] if isinstance(written[name], tuple) else written[name]
        np.testing.assert_array_equal(tensor.data, expected, err_msg=name)
    q8 = reader.tensors["q8_0.weight"]
    assert q8.shape == (4, 64) and q8.data.shape == (4, 2 * 34)
    np.testing.assert_array_equal(gguf.quants.dequantize(q8.data, q8.ggml_type),
                                  gguf.quants.dequantize(written["q8_0.weight"][0], GGML.Q8_0))


def test_the_last_file_is_kept_until_it_changes(tmp_path):
    path = write_everything(tmp_path / "everything.gguf")
    assert open_gguf(path) is open_gguf(str(path))
    first = open_gguf(path)
    write_everything(path, alignment=64)
    assert open_gguf(path) is not first and open_gguf(path).alignment == 64


def test_version_2_is_read(tmp_path):
    data = bytearray(write_everything(tmp_path / "v3.gguf").read_bytes())
    data[4:8] = struct.pack("<I", 2)
    (tmp_path / "v2.gguf").write_bytes(bytes(data))
    reader = open_gguf(tmp_path / "v2.gguf")
    assert reader.version == 2 and reader.metadata["test.strings"] == STRINGS


@pytest.mark.parametrize("version", [1, 4])
def test_unknown_versions_are_refused(tmp_path, version):
    data = bytearray(write_everything(tmp_path / "v3.gguf").read_bytes())
    data[4:8] = struct.pack("<I", version)
    (tmp_path / "other.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"GGUF version {version}; meshserve reads versions 2, 3"):
        open_gguf(tmp_path / "other.gguf")


def test_big_endian_files_are_refused(tmp_path):
    path = write_everything(tmp_path / "big.gguf", endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(ValueError, match="big-endian GGUF file"):
        open_gguf(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        open_gguf(tmp_path / "absent.gguf")


def test_truncated_files_are_corrupt_or_truncated(tmp_path):
    data = write_everything(tmp_path / "everything.gguf").read_bytes()
    reader = open_gguf(tmp_path / "everything.gguf")
    data_end = max(t.offset + t.data.nbytes for t in reader.tensors.values())
    header_end = min(t.offset for t in reader.tensors.values())
    cuts = [*range(0, header_end, 7), header_end + 1, data_end - 1]
    for cut in cuts:
        path = tmp_path / f"cut-{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=f"{path} is not a readable GGUF file; it is "
                                             "corrupt or truncated"):
            open_gguf(path)


def raw_gguf(kv: bytes = b"", tensor_infos: bytes = b"", *, num_kv: int = 0,
             num_tensors: int = 0, data: bytes = b"") -> bytes:
    """A GGUF file spelled out: header, the given key/value and tensor-info bytes, then the
    data section at the default alignment."""
    head = b"GGUF" + struct.pack("<IQQ", 3, num_tensors, num_kv) + kv + tensor_infos
    return head + bytes(-len(head) % 32) + data


def gguf_string(text: str) -> bytes:
    encoded = text.encode()
    return struct.pack("<Q", len(encoded)) + encoded


def tensor_info(name: str, dims: tuple[int, ...], ggml_type: int, offset: int = 0) -> bytes:
    return (gguf_string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
            + struct.pack("<IQ", ggml_type, offset))


CORRUPT = {
    "not-gguf": (b"PK\x03\x04" + bytes(60), "not the GGUF magic"),
    "empty": (b"", "the file is empty"),
    "value-type": (raw_gguf(gguf_string("a") + struct.pack("<I", 99), num_kv=1),
                   "unknown metadata value type 99"),
    "array-type": (raw_gguf(gguf_string("a") + struct.pack("<IIQ", 9, 77, 1), num_kv=1),
                   "unknown array item type 77"),
    "duplicate-key": (raw_gguf((gguf_string("a") + struct.pack("<IB", 0, 1)) * 2, num_kv=2),
                      "metadata key 'a' appears twice"),
    "alignment": (raw_gguf(gguf_string("general.alignment") + struct.pack("<II", 4, 48),
                           num_kv=1), "general.alignment is 48, not a power of two"),
    "ggml-type": (raw_gguf(tensor_infos=tensor_info("w", (4,), 1234), num_tensors=1,
                           data=bytes(32)), "tensor 'w' has unknown ggml type 1234"),
    "dims": (raw_gguf(tensor_infos=tensor_info("w", (1,) * 5, 0), num_tensors=1,
                      data=bytes(32)), "tensor 'w' has 5 dims"),
    "blocks": (raw_gguf(tensor_infos=tensor_info("w", (48,), int(GGML.Q8_0)), num_tensors=1,
                        data=bytes(64)), "not made of whole Q8_0 blocks of 32"),
    "offset": (raw_gguf(tensor_infos=tensor_info("w", (4,), 0, offset=8), num_tensors=1,
                        data=bytes(64)), "not a multiple of the alignment 32"),
    "past-the-end": (raw_gguf(tensor_infos=tensor_info("w", (64,), 0), num_tensors=1,
                              data=bytes(32)), "tensor 'w' ends past the end of the file"),
    "duplicate-tensor": (raw_gguf(tensor_infos=tensor_info("w", (4,), 0) * 2, num_tensors=2,
                                  data=bytes(32)), "tensor 'w' appears twice"),
    "string-array": (raw_gguf(gguf_string("a") + struct.pack("<IIQ", 9, 8, 3) + gguf_string("x"),
                              num_kv=1), "inside string 1 of an array of 3"),
}


@pytest.mark.parametrize("name", CORRUPT)
def test_corrupt_files_say_what_is_wrong(tmp_path, name):
    data, reason = CORRUPT[name]
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=f"{path} is not a readable GGUF file; it is corrupt or "
                                         f"truncated \\(.*{reason}"):
        open_gguf(path)


def test_a_hand_written_file_with_no_alignment_key_uses_32(tmp_path):
    values = np.arange(4, dtype=np.float32)
    kv = gguf_string("general.name") + struct.pack("<I", 8) + gguf_string("hand")
    path = tmp_path / "hand.gguf"
    path.write_bytes(raw_gguf(kv, tensor_info("w", (2, 2), 0), num_kv=1, num_tensors=1,
                              data=values.tobytes()))
    reader = open_gguf(path)
    assert reader.metadata == {"general.name": "hand"} and reader.alignment == 32
    tensor = reader.tensors["w"]
    assert (tensor.shape, tensor.ggml_type, tensor.offset % 32) == ((2, 2), GGML.F32, 0)
    np.testing.assert_array_equal(tensor.data, values.reshape(2, 2))
