"""The plan stream's wire format: what process 0 sends every other process each step.

A message is one small fixed-shape header, then (for most commands) one payload. Both are int32
arrays, so one compiled broadcast per payload size carries any message:

    header   int32[HEADER_WORDS]  MAGIC, command, sequence number, payload words, then
                                  command-specific words (for RUN: one bucket key per call)
    payload  int32[bucket]        the step's host arrays, flattened and viewed as int32 words,
                                  zero-padded to a power of two (so few payload shapes exist)

Every process knows the array shapes of a payload before it arrives (the runner rebuilds them from
the header's bucket keys), so the payload carries values only: no shapes, no dtypes, no pickles.

This module imports numpy only.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

import numpy as np

MAGIC = 0x6D736831  # "msh1": a header from another program or version is refused
HEADER_WORDS = 64
MIN_PAYLOAD_WORDS = 1024
_FIXED = 4  # magic, command, sequence, payload words
SEQUENCE_MODULUS = 1 << 31  # sequence numbers wrap here (one int32 word)

NOOP = 0  # nothing to run; keeps followers' waits short
RUN = 1  # run the compiled calls the header's keys name, with the payload's arrays
END_CALL = 2  # a batch call (`LLM.generate`) ended; the payload holds its outputs
BEGIN_CALL = 3  # a batch call starts; the header holds its inputs' digest
STOP = 4  # the leader is done: followers leave their loop
COMMANDS = {NOOP: "NOOP", RUN: "RUN", END_CALL: "END_CALL", BEGIN_CALL: "BEGIN_CALL", STOP: "STOP"}

_WORD = np.dtype(np.int32)


@dataclasses.dataclass(frozen=True)
class Header:
    command: int
    sequence: int  # messages sent before this one, modulo 2**31; a follower checks it counts along
    payload_words: int  # 0 when no payload follows; else the payload's padded length
    words: tuple[int, ...] = ()  # command-specific

    def encode(self) -> np.ndarray:
        if len(self.words) > HEADER_WORDS - _FIXED:
            raise ValueError(f"a header holds at most {HEADER_WORDS - _FIXED} words, "
                             f"got {len(self.words)}")
        out = np.zeros(HEADER_WORDS, np.int32)
        out[:_FIXED] = (MAGIC, self.command, self.sequence % SEQUENCE_MODULUS, self.payload_words)
        out[_FIXED:_FIXED + len(self.words)] = self.words
        return out

    @classmethod
    def decode(cls, words: np.ndarray, num_words: int) -> "Header":
        """The header in `words`, keeping `num_words` command-specific words."""
        words = np.asarray(words)
        if words.shape != (HEADER_WORDS,) or words.dtype != _WORD or int(words[0]) != MAGIC:
            raise ValueError("not a meshserve plan header: every process must run the same "
                             "meshserve version")
        command = int(words[1])
        if command not in COMMANDS:
            raise ValueError(f"unknown plan command {command}")
        return cls(command=command, sequence=int(words[2]), payload_words=int(words[3]),
                   words=tuple(int(w) for w in words[_FIXED:_FIXED + num_words]))

    @property
    def name(self) -> str:
        return COMMANDS[self.command]


def payload_bucket(num_words: int) -> int:
    """The padded payload length: the next power of two, at least MIN_PAYLOAD_WORDS."""
    return max(MIN_PAYLOAD_WORDS, 1 << max(num_words - 1, 0).bit_length())


def pack(leaves: Sequence[np.ndarray]) -> np.ndarray:
    """`leaves` as one int32 payload, each leaf's bytes in order, padded to `payload_bucket`.

    Leaves must be 4-byte numeric (int32, uint32, float32) or bool (one word per element).
    """
    words = [_as_words(leaf) for leaf in leaves]
    total = sum(w.size for w in words)
    out = np.zeros(payload_bucket(total), np.int32)
    at = 0
    for w in words:
        out[at:at + w.size] = w
        at += w.size
    return out


def unpack(payload: np.ndarray, templates: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The leaves `pack` wrote, shaped and typed like `templates`."""
    payload = np.asarray(payload)
    for t in templates:
        if t.dtype != np.bool_ and (t.dtype.itemsize != 4 or t.dtype.kind not in "iuf"):
            raise TypeError(f"cannot receive a {t.dtype} array: only 4-byte numbers and bools")
    need = sum(int(t.size) for t in templates)
    if payload.dtype != _WORD or payload.ndim != 1 or payload.size < need:
        raise ValueError(f"a payload of {payload.size} words cannot hold {need}")
    out, at = [], 0
    for t in templates:
        chunk = payload[at:at + t.size]
        at += t.size
        if t.dtype == np.bool_:
            out.append((chunk != 0).reshape(t.shape))
        else:
            out.append(chunk.view(t.dtype).reshape(t.shape).copy())
    return out


def bytes_to_payload(data: bytes) -> np.ndarray:
    """`data` as a payload: its length in word 0, then its bytes, padded."""
    body = np.frombuffer(data + b"\0" * (-len(data) % 4), np.int32)
    return pack([np.array([len(data)], np.int32), body])


def payload_to_bytes(payload: np.ndarray) -> bytes:
    payload = np.asarray(payload, np.int32)
    length = int(payload[0])
    if not 0 <= length <= 4 * (payload.size - 1):
        raise ValueError(f"a byte payload of {payload.size} words cannot hold {length} bytes")
    return payload[1:].tobytes()[:length]


def digest_words(text: str, count: int = 8) -> tuple[int, ...]:
    """A SHA-256 digest of `text` as `count` int32 words, for a header."""
    raw = hashlib.sha256(text.encode("utf-8")).digest()[:4 * count]
    return tuple(int(w) for w in np.frombuffer(raw, np.int32))


def _as_words(leaf: np.ndarray) -> np.ndarray:
    leaf = np.ascontiguousarray(leaf)
    if leaf.dtype == np.bool_:
        return leaf.reshape(-1).astype(np.int32)
    if leaf.dtype.itemsize != 4 or leaf.dtype.kind not in "iuf":
        raise TypeError(f"cannot send a {leaf.dtype} array: only 4-byte numbers and bools")
    return leaf.reshape(-1).view(np.int32)
