"""GGUF vocabularies encode and decode as llama.cpp does (`meshserve.model.gguf_vocab`).

The reference is llama.cpp itself: `scripts/make_gguf_vocab_golden.py` wrote, with
llama-cpp-python, the ids and texts under tests/golden/gguf-vocab/ for two tiny SentencePiece
files written there (with and without `add_space_prefix`) and for the real Gemma 3 270M GGUF.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import pytest

from meshserve.model.gguf_vocab import read_vocab
from meshserve.model.tokenizer import IncrementalDecoder, Tokenizer

FIXTURES = Path(__file__).parents[1] / "golden" / "gguf-vocab"
TINY = ("tiny-spm", "tiny-spm-no-prefix")


def _check_against_llama_cpp(tokenizer: Tokenizer, fixture: dict) -> None:
    for case in fixture["cases"]:
        where = f"{case['text']!r} (add_bos={case['add_bos']})"
        assert tokenizer.encode(case["text"], add_special_tokens=case["add_bos"]) == case["ids"], where
        assert tokenizer.decode(case["ids"]) == case["decoded_skip_special"], where
        assert (tokenizer.decode(case["ids"], skip_special_tokens=False)
                == case["decoded_with_special"]), where


@pytest.mark.parametrize("name", TINY)
def test_a_sentencepiece_vocabulary_encodes_and_decodes_as_llama_cpp(name):
    fixture = json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))
    path = FIXTURES / f"{name}.gguf"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == fixture["file_sha256"]
    _check_against_llama_cpp(Tokenizer.from_gguf(path), fixture)


def test_the_byte_fallback_spells_characters_no_token_holds():
    tokenizer = Tokenizer.from_gguf(FIXTURES / "tiny-spm.gguf")
    ids = tokenizer.encode("ß", add_special_tokens=False)
    assert [tokenizer.id_to_token(i) for i in ids] == ["\u2581", "<0xC3>", "<0x9F>"]
    assert tokenizer.decode(ids) == "ß"


def test_streamed_text_is_the_whole_decode_with_the_space_prefix():
    tokenizer = Tokenizer.from_gguf(FIXTURES / "tiny-spm.gguf")
    ids = tokenizer.encode("The capital of France is café 🤖", add_special_tokens=False)
    decoder = IncrementalDecoder(tokenizer)
    streamed = "".join(decoder.add(i) for i in ids) + decoder.flush()
    assert streamed == tokenizer.decode(ids) == "The capital of France is café 🤖"


def test_the_special_ids_come_from_the_file():
    tokenizer = Tokenizer.from_gguf(FIXTURES / "tiny-spm.gguf")
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_ids == (2,)
    assert tokenizer.encode("a")[0] == 1  # add_bos_token


def _vocab_only(path: Path, model: str, **fields) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(["<unk>", "a", "b"])
    for key, value in fields.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("model, named", [("bert", "WordPiece"), ("t5", "Unigram"),
                                          ("klingon", "'klingon'")])
def test_an_unread_vocabulary_kind_is_refused_by_name(tmp_path, model, named):
    path = _vocab_only(tmp_path / "v.gguf", model)
    with pytest.raises(ValueError, match="tokenizer.ggml.model") as refused:
        read_vocab(path)
    assert named in str(refused.value) and "'llama' (SentencePiece)" in str(refused.value)


def test_a_sentencepiece_file_without_scores_says_which_key_is_missing(tmp_path):
    path = _vocab_only(tmp_path / "v.gguf", "llama")
    with pytest.raises(ValueError, match="no tokenizer.ggml.scores"):
        read_vocab(path)


@pytest.mark.slow
def test_gemma_3s_vocabulary_encodes_and_decodes_as_llama_cpp():
    from meshserve.model.loading.hub import resolve_model

    path = resolve_model("gemma-3-270m").path
    fixture = json.loads((FIXTURES / "gemma-3-270m.json").read_text(encoding="utf-8"))
    tokenizer = Tokenizer.from_gguf(path)
    assert tokenizer.vocab_size == 262144
    _check_against_llama_cpp(tokenizer, fixture)
