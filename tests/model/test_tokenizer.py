"""Tokenizer tests: the SmolLM2 GGUF tokenizer against golden ids and chat renderings.

The golden file holds the ids of the true SmolLM2 tokenizer (the hub `tokenizer.json`, which
splits digits individually before byte-level BPE). The other tests build tiny tokenizers from
`tokenizer.json` / GGUF files written on the spot, to cover loading paths and error messages.
"""

from __future__ import annotations

import ast
import json
import random
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from meshserve.model import tokenizer as tokenizer_module
from meshserve.model.loading.hub import resolve_model
from meshserve.model.gguf_vocab import gguf_pre_tokenizer
from meshserve.model.tokenizer import IncrementalDecoder, Tokenizer

GOLDEN_PATH = Path(__file__).parents[1] / "golden" / "smollm2_tokenizer.json"
STREAMING_TEXTS = [
    "北京是中国的首都。你好，世界！",
    "emoji: 😀🎉👍🏽 family 👨‍👩‍👧 flag 🇺🇸",
    "日本語のテキスト and 한국어 mixed with English 123.",
    "<|im_start|>assistant\n答案是 42 😀<|im_end|>",
]


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return Tokenizer.from_gguf(resolve_model("smollm2-135m-instruct").path)


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN_PATH.read_text(encoding="utf-8"))


def golden_texts(golden: dict) -> list[str]:
    return [entry["text"] for entry in golden["encode"]]


def stream(decoder: IncrementalDecoder, ids: list[int]) -> list[str]:
    return [decoder.add(token_id) for token_id in ids] + [decoder.flush()]


def test_encode_matches_golden_ids(smollm2, golden):
    add_special = golden["add_special_tokens"]
    encoded = [
        (e["text"], smollm2.encode(e["text"], add_special_tokens=add_special), e["ids"])
        for e in golden["encode"]
    ]
    assert [case for case in encoded if case[1] != case[2]] == []


def test_default_encode_adds_no_bos_for_smollm2(smollm2, golden):
    assert not golden["special_tokens"]["gguf_add_bos_token"]
    for entry in golden["encode"]:
        assert smollm2.encode(entry["text"]) == entry["ids"]


def test_whitespace_run_before_digit_merges_like_the_hub_tokenizer(smollm2):
    # The hub tokenizer isolates digits first, so a whitespace run before a digit stays whole.
    assert smollm2.encode("  2024") == [256, 34, 32, 34, 36]
    assert [smollm2.id_to_token(i) for i in smollm2.encode("\n\n1")] == ["ĊĊ", "1"]


def test_chat_template_matches_golden(smollm2, golden):
    assert smollm2.chat_template == golden["chat_template"]
    for case in golden["chat"]:
        rendered = smollm2.apply_chat_template(
            case["messages"], add_generation_prompt=case["add_generation_prompt"]
        )
        assert rendered == case["rendered"]


def test_rendered_chat_encodes_to_golden_ids(smollm2, golden):
    for case in golden["chat"]:
        if "ids" in case:
            assert smollm2.encode(case["rendered"]) == case["ids"]


def test_special_token_ids_match_golden(smollm2, golden):
    special = golden["special_tokens"]
    assert smollm2.bos_token_id == special["bos_id"]
    assert smollm2.eos_token_ids[0] == special["eos_id"]
    assert smollm2.pad_token_id == special["pad_id"]
    for name in ("bos", "eos", "unk", "pad"):
        assert smollm2.token_to_id(special[name]) == special[f"{name}_id"]


def test_eos_ids_include_end_of_turn_token(smollm2):
    assert smollm2.token_to_id("<|im_end|>") in smollm2.eos_token_ids


def test_control_tokens_encode_whole_and_are_skipped_on_decode(smollm2, golden):
    for token, token_id in golden["special_tokens"]["control_tokens"].items():
        assert smollm2.encode(token) == [token_id]
        assert smollm2.decode([token_id]) == ""
        assert smollm2.decode([token_id], skip_special_tokens=False) == token


def test_vocab_size_matches_golden(smollm2, golden):
    assert smollm2.vocab_size == golden["vocab_size"]


def test_decode_round_trips_golden_texts(smollm2, golden):
    for text in golden_texts(golden):
        assert smollm2.decode(smollm2.encode(text), skip_special_tokens=False) == text


def test_decode_skips_special_tokens_by_default(smollm2):
    ids = smollm2.encode("<|im_start|>user\nhi<|im_end|>")
    assert smollm2.decode(ids) == "user\nhi"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_deltas_join_to_decode(smollm2, golden, skip_special_tokens):
    for text in golden_texts(golden) + STREAMING_TEXTS:
        ids = smollm2.encode(text)
        deltas = stream(IncrementalDecoder(smollm2, skip_special_tokens=skip_special_tokens), ids)
        assert "".join(deltas) == smollm2.decode(ids, skip_special_tokens=skip_special_tokens)


def test_incremental_deltas_join_to_decode_for_arbitrary_ids(smollm2):
    # Random ids, biased to single-byte tokens, produce broken and interleaved UTF-8 sequences.
    rng = random.Random(1234)
    for _ in range(300):
        ids = [
            rng.randrange(smollm2.vocab_size) if rng.random() < 0.5 else rng.randrange(300) for _ in range(30)
        ]
        for skip in (True, False):
            deltas = stream(IncrementalDecoder(smollm2, skip_special_tokens=skip), ids)
            assert "".join(deltas) == smollm2.decode(ids, skip_special_tokens=skip), ids


def test_incremental_decoder_never_emits_partial_characters(smollm2):
    for text in STREAMING_TEXTS:
        ids = smollm2.encode(text)
        assert len(ids) > len(text.split()), "expected multi-byte characters split across tokens"
        deltas = stream(IncrementalDecoder(smollm2), ids)
        assert all("\ufffd" not in delta for delta in deltas), deltas


def test_incremental_decoder_holds_back_until_character_completes(smollm2):
    ids = smollm2.encode("😀")
    decoder = IncrementalDecoder(smollm2)
    assert [decoder.add(token_id) for token_id in ids] == [""] * (len(ids) - 1) + ["😀"]
    assert decoder.flush() == ""


def test_flush_returns_unfinished_bytes(smollm2):
    ids = smollm2.encode("😀")[:-1]
    decoder = IncrementalDecoder(smollm2)
    assert "".join(decoder.add(token_id) for token_id in ids) == ""
    assert decoder.flush() == smollm2.decode(ids)


@pytest.mark.parametrize(
    "messages, message_part",
    [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        (["hi"], "messages[0] must be a dict"),
        ([{"role": "user"}], "messages[0]['content'] must be a string"),
        (
            [{"role": "user", "content": "a"}, {"role": 1, "content": "b"}],
            "messages[1]['role'] must be a string",
        ),
        ([{"role": "user", "content": ["a"]}], "messages[0]['content'] must be a string"),
    ],
)
def test_invalid_messages_are_rejected(smollm2, messages, message_part):
    with pytest.raises(ValueError, match=message_part.replace("[", r"\[").replace("]", r"\]")):
        smollm2.apply_chat_template(messages)


def test_encode_rejects_non_strings(smollm2):
    with pytest.raises(TypeError, match="expects a str"):
        smollm2.encode(b"bytes")


def write_tiny_tokenizer_json(directory: Path) -> Path:
    """A word-level-ish byte-level BPE over a handful of tokens, saved as tokenizer.json."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: index for index, token in enumerate(["<s>", "</s>", "<|im_end|>", *sorted(alphabet)])}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "</s>", "<|im_end|>"])
    path = directory / "tokenizer.json"
    backend.save(str(path))
    return path


def test_from_file_reads_sibling_tokenizer_config(tmp_path):
    path = write_tiny_tokenizer_json(tmp_path)
    config = {
        "bos_token": {"content": "<s>", "__type": "AddedToken"},
        "eos_token": "</s>",
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tok = Tokenizer.from_file(path)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (0, (1, 2), None)
    assert tok.apply_chat_template([{"role": "user", "content": "hey"}]) == "<s>hey<|im_end|>"
    assert tok.decode(tok.encode("héllo 你")) == "héllo 你"


def test_from_file_prefers_explicit_config_and_named_templates(tmp_path):
    path = write_tiny_tokenizer_json(tmp_path)
    config = {
        "eos_token": "</s>",
        "chat_template": [{"name": "default", "template": "{{ messages[0]['role'] }}"}],
    }
    tok = Tokenizer.from_file(path, tokenizer_config=config)
    assert tok.eos_token_ids == (1,)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "user"


def test_missing_chat_template_is_a_clear_error(tmp_path):
    tok = Tokenizer.from_file(write_tiny_tokenizer_json(tmp_path))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_raise_exception_becomes_value_error(tmp_path):
    template = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    tok = Tokenizer.from_file(
        write_tiny_tokenizer_json(tmp_path), tokenizer_config={"chat_template": template}
    )
    with pytest.raises(ValueError, match="system first"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_tojson_does_not_escape_html(tmp_path):
    template = "{{ messages | tojson }}"
    tok = Tokenizer.from_file(
        write_tiny_tokenizer_json(tmp_path), tokenizer_config={"chat_template": template}
    )
    messages = [{"role": "user", "content": "<b>é</b>"}]
    assert tok.apply_chat_template(messages) == json.dumps(messages, ensure_ascii=False)


def test_unknown_config_token_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        Tokenizer.from_file(write_tiny_tokenizer_json(tmp_path), tokenizer_config={"eos_token": "<eot>"})


def write_tiny_gguf(
    path: Path, *, model: str = "gpt2", pre: str | None = "llama-bpe", add_bos: bool = True
) -> Path:
    """A GGUF file with only tokenizer metadata: 'a', 'b', 'ab', a space token and two control tokens."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(["<bos>", "<eos>", "a", "b", "ab", "Ġ", "Ġab", "<think>"])
    writer.add_token_types([3, 3, 1, 1, 1, 1, 1, 4])
    writer.add_token_merges(["a b", "Ġ ab"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_add_bos_token_prepends_bos(tmp_path):
    tok = Tokenizer.from_gguf(write_tiny_gguf(tmp_path / "tiny.gguf"))
    assert tok.encode("ab ab") == [0, 4, 6]
    assert tok.encode("ab ab", add_special_tokens=False) == [4, 6]
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (0, (1,), 8)


def test_gguf_user_defined_tokens_stay_whole_and_survive_decode(tmp_path):
    tok = Tokenizer.from_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", add_bos=False))
    assert tok.encode("a<think>b") == [2, 7, 3]
    assert tok.decode([2, 7, 3, 1]) == "a<think>b"


def test_gguf_unknown_pre_tokenizer_names_supported_ones(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", pre="mystery-bpe")
    with pytest.raises(ValueError, match="'mystery-bpe'.*smollm"):
        Tokenizer.from_gguf(path)


def test_gguf_unsupported_tokenizer_model_is_a_clear_error(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", model="bert")
    with pytest.raises(ValueError, match="tokenizer.ggml.model 'bert'.*'gpt2'"):
        Tokenizer.from_gguf(path)


def test_gguf_without_pre_uses_gpt2_byte_level(tmp_path):
    tok = Tokenizer.from_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", pre=None, add_bos=False))
    assert tok.encode(" ab") == [6]


@pytest.mark.parametrize(
    "pre_type, text, pieces",
    [
        ("smollm", "x 2024", ["x", "Ġ", "2", "0", "2", "4"]),
        ("gpt2", "x 2024", ["x", "Ġ2024"]),
        ("llama-bpe", "x 12345", ["x", "Ġ", "123", "45"]),
        ("qwen2", "x 123", ["x", "Ġ", "1", "2", "3"]),
    ],
)
def test_pre_tokenizer_splits_per_gguf_pre_type(pre_type, text, pieces):
    assert [piece for piece, _ in gguf_pre_tokenizer(pre_type).pre_tokenize_str(text)] == pieces


def test_tokenizer_module_imports_no_jax_or_serving():
    tree = ast.parse(Path(tokenizer_module.__file__).read_text(encoding="utf-8"))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    forbidden = ("jax", "meshserve.serving", "meshserve.batching")
    assert not [name for name in imported if name.split(".")[0] == "jax" or name.startswith(forbidden)]
