"""A GGUF file's vocabulary as a `tokenizers` backend that encodes and decodes as llama.cpp does.

`read_vocab(path)` reads the file's `tokenizer.*` metadata and builds a `GGUFVocab`: the backend,
its special ids, its chat template, and `space_prefix` (what `Tokenizer.decode` strips, below).
`tokenizer.ggml.model` says which kind of vocabulary the file holds:

  gpt2   byte-level BPE (SmolLM, Llama 3, Qwen2): tokens and merges, and a pre-tokenizer chosen
         by `tokenizer.ggml.pre`; unknown pre-tokenizers are refused rather than guessed.
  llama  SentencePiece (Gemma, Llama 2, Mistral, Mixtral, Phi-3): tokens and scores. llama.cpp
         tokenizes a piece of text by starting from its characters and merging, again and again,
         the adjacent pair whose joined text is a token with the highest score (the leftmost on a
         tie); a character that ends up in no token is spelled as its UTF-8 bytes (`<0xNN>`).
         That is a BPE whose merges are every split of every token into two tokens, ranked by
         the joined token's score, with byte fallback, which `tokenizers` runs as it is.
         Spaces become U+2581 first, and `add_space_prefix` (llama.cpp's default: true) puts one
         in front of the text.

Other kinds llama.cpp reads (bert, t5, rwkv, plamo2) are refused by name.

Token types (`tokenizer.ggml.token_type`): control tokens are special (written in the text, as a
chat template writes them, they encode to their id; `decode` drops them unless asked not to);
user-defined tokens are matched whole before anything else, as llama.cpp matches them, and
decode as their text; byte tokens are the fallback; normal, unknown and unused tokens are
ordinary vocabulary. A token whose text llama.cpp's loader takes for an end-of-turn,
end-of-generation or fill-in-the-middle marker (`CONTROL_TEXTS`) is a control token whatever its
type, as there. BOS and EOS are added as `add_bos_token` and `add_eos_token` say
(SentencePiece defaults: BOS yes, EOS no).

Decoding follows `llama_detokenize`: with `add_space_prefix`, one leading space of the first
token's text is dropped, unless the first token is a control token (BOS, say), whose empty or
literal text takes the place of that space.

This module imports neither jax nor flax.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from meshserve.model.gguf_reader import as_python, open_gguf

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6
SPACE = "\u2581"  # SentencePiece's visible space
VOCAB_KINDS = ("gpt2", "llama")
REFUSED_KINDS = {
    "bert": "WordPiece (BERT-style encoders)",
    "t5": "Unigram with a precompiled normalizer (T5)",
    "rwkv": "RWKV's trie vocabulary",
    "plamo2": "PLaMo 2's vocabulary",
    "no_vocab": "no vocabulary at all",
    "none": "no vocabulary at all",
}

# Texts llama.cpp's vocabulary loader recognises as end-of-generation, end-of-turn and
# fill-in-the-middle markers and makes control tokens whatever type the file gives them (Gemma's
# `</s>` is user-defined in the file, so llama.cpp's decode drops it; this decode does too).
CONTROL_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
    "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>", "<|fim_suffix|>", "<fim-suffix>",
    "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>", "\u2581<SUF>", "<|code_suffix|>",
    "<|suffix|>", "<|fim_middle|>", "<fim-middle>", "<fim_middle>",
    "<\uff5cfim\u2581end\uff5c>", "<MID>", "\u2581<MID>", "<|code_middle|>", "<|middle|>",
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", "<|fim_repo|>", "<|repo_name|>",
    "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
})

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class GGUFVocab:
    """What a GGUF file's metadata says of its tokenizer. `space_prefix`: decode drops one
    leading space of the first token's text unless that token is a control token."""

    backend: BackendTokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int | None, ...]  # EOS, then EOT: the tokenizer adds the template's own
    pad_token_id: int | None
    chat_template: str | None
    space_prefix: bool


def byte_level_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """GPT-2 style: the GPT-2 split regex, then bytes mapped to printable characters."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


def digits_then_byte_level() -> pre_tokenizers.PreTokenizer:
    """SmolLM: every digit on its own, then GPT-2 style byte-level splitting."""
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level_pre_tokenizer()]
    )


def split_then_byte_level(pattern: str) -> pre_tokenizers.PreTokenizer:
    """Llama-3 / Qwen2 style: a model-specific split regex, then bytes without the GPT-2 regex."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )


PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": byte_level_pre_tokenizer,
    "gpt2": byte_level_pre_tokenizer,
    "smollm": digits_then_byte_level,
    "llama-bpe": partial(split_then_byte_level, LLAMA3_SPLIT),
    "llama3": partial(split_then_byte_level, LLAMA3_SPLIT),
    "llama-v3": partial(split_then_byte_level, LLAMA3_SPLIT),
    "qwen2": partial(split_then_byte_level, QWEN2_SPLIT),
}


def gguf_pre_tokenizer(pre_type: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer for a GGUF `tokenizer.ggml.pre` value (missing means "default")."""
    builder = PRE_TOKENIZERS.get(pre_type or "default")
    if builder is None:
        raise ValueError(
            f"GGUF tokenizer.ggml.pre {pre_type!r} is not supported; supported values are "
            f"{', '.join(sorted(PRE_TOKENIZERS))}. Use a model whose GGUF declares one of these, "
            "or load its tokenizer.json with Tokenizer.from_file."
        )
    return builder()


def read_tokenizer_fields(path: str | Path) -> dict[str, Any]:
    """The `tokenizer.*` metadata of a GGUF file as Python values (arrays as lists)."""
    metadata = open_gguf(path).metadata
    return {key: as_python(value) for key, value in metadata.items()
            if key.startswith("tokenizer.")}


def required_field(fields: Mapping[str, Any], key: str, path: str | Path, kind: str) -> Any:
    """A metadata value that a tokenizer of `kind` cannot be built without."""
    if key not in fields:
        raise ValueError(f"GGUF file {path} has no {key} metadata, which a {kind} vocabulary "
                         f"needs; the file is incomplete")
    return fields[key]


def split_merge(merge: str) -> tuple[str, str]:
    """A GGUF merge rule "left right" as the pair the BPE model expects."""
    left, separator, right = merge.partition(" ")
    if not separator or not left or not right:
        raise ValueError(f"GGUF merge rule {merge!r} is not of the form 'left right'.")
    return left, right


def byte_level_bpe(tokens: Sequence[str], merges: Sequence[str]) -> BackendTokenizer:
    """A byte-level BPE tokenizer from a GGUF vocabulary and merge list, without special tokens."""
    vocab = {token: index for index, token in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[split_merge(merge) for merge in merges], fuse_unk=False)
    backend = BackendTokenizer(bpe)
    backend.decoder = decoders.ByteLevel()
    return backend


def sentencepiece_bpe(tokens: Sequence[str], scores: Sequence[float],
                      unknown: str | None) -> BackendTokenizer:
    """llama.cpp's SentencePiece tokenizer (see the module docstring) as a BPE: every split of a
    token into two tokens is a merge, ranked by the joined token's score, highest first (ties:
    the lower ids first, as the token listed first wins in llama.cpp's own lookup)."""
    # Filled from the last id back, so that a repeated text keeps its first id, as llama.cpp's
    # lookup does.
    vocab = dict(zip(reversed(tokens), range(len(tokens) - 1, -1, -1)))
    ranked = sorted(token_splits(vocab, scores))
    merges = [(tokens[left], tokens[right]) for _, left, right in ranked]
    bpe = models.BPE(vocab=vocab, merges=merges, unk_token=unknown, byte_fallback=True,
                     fuse_unk=True)
    backend = BackendTokenizer(bpe)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def token_splits(vocab: Mapping[str, int], scores: Sequence[float]
                 ) -> list[tuple[float, int, int]]:
    """Every split of a token into two tokens, as (-the token's score, left id, right id).

    This runs once per character of the vocabulary (1.2M times for Gemma's 262k tokens), so it
    is one comprehension that keeps ids only: the tuples sort without a key function."""
    find = vocab.get
    return [(-scores[index], left, right)
            for token, index in vocab.items()
            for cut in range(1, len(token))
            if (left := find(token[:cut])) is not None and (right := find(token[cut:])) is not None]


def add_gguf_added_tokens(
    backend: BackendTokenizer, tokens: Sequence[str], token_types: Sequence[int]
) -> None:
    """Make control tokens special and user-defined tokens atomic, so neither is split. A token
    whose text is in `CONTROL_TEXTS` is a control token whatever its type, as in llama.cpp.

    User-defined tokens (like `<think>`, or Gemma's runs of newlines) are matched whole but are
    not special: decode keeps them, as HF transformers and llama.cpp do.
    """
    typed = [(token, TOKEN_TYPE_CONTROL if token in CONTROL_TEXTS else kind)
             for token, kind in zip(tokens, token_types)]
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                for token, kind in typed if kind == TOKEN_TYPE_CONTROL])
    backend.add_tokens([AddedToken(token, special=False, normalized=False)
                        for token, kind in typed if kind == TOKEN_TYPE_USER_DEFINED])


def framing_post_processor(tokens: Sequence[str], bos_id: int | None,
                           eos_id: int | None) -> processors.PostProcessor | None:
    """A post-processor that puts BOS in front of and EOS after every encoded sequence (either
    may be None), or None when neither is added."""
    ends = [(tokens[i], i) for i in (bos_id, eos_id) if i is not None]
    if not ends:
        return None
    head = f"{tokens[bos_id]}:0 " if bos_id is not None else ""
    tail = f" {tokens[eos_id]}:0" if eos_id is not None else ""
    return processors.TemplateProcessing(single=f"{head}$A:0{tail}",
                                         pair=f"{head}$A:0{tail} {head}$B:1{tail}".strip(),
                                         special_tokens=list(dict.fromkeys(ends)))


def read_vocab(path: str | Path) -> GGUFVocab:
    """The tokenizer a GGUF file's metadata describes (see the module docstring)."""
    fields = read_tokenizer_fields(path)
    kind = fields.get("tokenizer.ggml.model")
    if kind not in VOCAB_KINDS:
        what = f" ({REFUSED_KINDS[kind]})" if kind in REFUSED_KINDS else ""
        raise ValueError(
            f"GGUF file {path} has tokenizer.ggml.model {kind!r}{what}, which meshserve does not "
            f"read; supported values are 'gpt2' (byte-level BPE) and 'llama' (SentencePiece). "
            f"Load the model's tokenizer.json with Tokenizer.from_file instead.")
    tokens = required_field(fields, "tokenizer.ggml.tokens", path, kind)
    types = fields.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"GGUF file {path} has {len(tokens)} tokens but {len(types)} token "
                         f"types; the file is inconsistent")
    sentencepiece = kind == "llama"
    if sentencepiece:
        scores = required_field(fields, "tokenizer.ggml.scores", path, "SentencePiece")
        unknown_id = fields.get("tokenizer.ggml.unknown_token_id")
        backend = sentencepiece_bpe(tokens, scores,
                                    None if unknown_id is None else tokens[unknown_id])
        normalizer = [normalizers.Replace(" ", SPACE)]
        space_prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
        if space_prefix:
            normalizer.insert(0, normalizers.Prepend(SPACE))
        backend.normalizer = normalizers.Sequence(normalizer)
    else:
        merges = required_field(fields, "tokenizer.ggml.merges", path, "byte-level BPE")
        backend = byte_level_bpe(tokens, merges)
        backend.pre_tokenizer = gguf_pre_tokenizer(fields.get("tokenizer.ggml.pre"))
        space_prefix = False
    add_gguf_added_tokens(backend, tokens, types)
    bos_id = fields.get("tokenizer.ggml.bos_token_id")
    eos_id = fields.get("tokenizer.ggml.eos_token_id")
    post = framing_post_processor(
        tokens, bos_id if fields.get("tokenizer.ggml.add_bos_token", sentencepiece) else None,
        eos_id if fields.get("tokenizer.ggml.add_eos_token", False) else None)
    if post is not None:
        backend.post_processor = post
    return GGUFVocab(
        backend=backend, bos_token_id=bos_id,
        eos_token_ids=(eos_id, fields.get("tokenizer.ggml.eot_token_id")),
        pad_token_id=fields.get("tokenizer.ggml.padding_token_id"),
        chat_template=fields.get("tokenizer.chat_template"), space_prefix=space_prefix)
