"""Writes the GGUF vocabulary fixtures under tests/golden/gguf-vocab/ from llama.cpp itself.

    .venv/bin/python scripts/make_gguf_vocab_golden.py            # the tiny files and Gemma 3
    .venv/bin/python scripts/make_gguf_vocab_golden.py --tiny-only

llama.cpp (through llama-cpp-python, the `peers-llama-cpp` extra; vocab only, so nothing is
decoded and the AMX build question does not arise) is the reference for how a GGUF vocabulary
encodes and decodes. For each file, and each string of `CORPUS` (leading spaces, tabs and
newlines, accents, CJK, emoji, digits, a URL, special-token text, text that spells a byte token),
the fixture holds `llama_tokenize`'s ids with special tokens parsed, without and with the BOS the
file asks for, and `llama_detokenize`'s text of those ids both ways: special tokens removed and
not printed, and kept and printed.

The files: two tiny SentencePiece vocabularies written here with the `gguf` package (Llama 2
style, with and without `add_space_prefix`: control, user-defined and byte tokens, scores that
decide the merges, characters only the byte fallback spells), and the real Gemma 3 270M Q4_K_M
GGUF (`gemma-3-270m`, a 262k SentencePiece vocabulary), fetched as meshserve fetches it.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
from pathlib import Path

import gguf

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "golden" / "gguf-vocab"
CORPUS = (
    "The capital of France is",
    " leading space",
    "  two spaces",
    "    four spaces",
    "trailing space ",
    " ",
    "",
    "tabs\tand\nnewlines\n\n\nthree",
    "\t\tdouble tab",
    "a\r\nb",
    "accents: café naïve Ångström",
    "Ünïcödé ǅ ﬁ ℌ",
    "CJK: 你好，世界 日本語 한국어",
    "emoji: 🤖👍🏽🇫🇷",
    "digits 1234567890 3.14159",
    "URL https://example.com/a?b=c&d=e#f",
    "<s>text</s>",
    "<bos>text<eos>",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<tool>x<tool>",
    "literal <0x41> byte",
    "\u00a0no-break space and zero\u200bwidth",
    "x" * 40,
)


def tiny_vocabulary() -> list[tuple[str, int, float]]:
    """(text, token type, score) of the tiny SentencePiece vocabulary: Llama 2's layout (unknown,
    BOS, EOS, 256 byte tokens, then the pieces by falling score), two user-defined tokens."""
    tokens = [("<unk>", 2), ("<s>", 3), ("</s>", 3)]
    tokens += [(f"<0x{byte:02X}>", 6) for byte in range(256)]
    pieces = ["\u2581", *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
              *".,:;!?'\"()-/_#&=<>", "\u2581t", "he", "\u2581the", "\u2581a", "in", "er",
              "\u2581in", "on", "\u2581c", "ca", "\u2581ca", "pi", "ta", "\u2581of", "\u2581F", "ra",
              "nce", "\u2581is", "\u2581\u2581", "\u2581\u2581\u2581\u2581", "12", "123", "ht", "tp",
              "s:", "//", "<0", "x4", "1>", "<0x4", "\u2581le", "ad", "ing", "\u2581sp", "ace",
              "\u2581two", "\u2581spaces", "é", "\u2581caf"]
    seen = {text for text, _ in tokens}
    for piece in pieces:
        if piece not in seen:
            tokens.append((piece, 1))
            seen.add(piece)
    tokens += [("<tool>", 4), ("\t\t", 4)]
    return [(text, kind, -float(i) if kind == 1 else 0.0) for i, (text, kind) in enumerate(tokens)]


def add_tiny_vocabulary(writer: gguf.GGUFWriter, *, add_space_prefix: bool) -> None:
    """The tiny SentencePiece vocabulary's keys, written as llama.cpp's converter writes a
    Llama 2 file's (BOS 1, EOS 2, unknown 0; a BOS added, no EOS)."""
    vocabulary = tiny_vocabulary()
    writer.add_tokenizer_model("llama")
    writer.add_token_list([text for text, _, _ in vocabulary])
    writer.add_token_scores([score for _, _, score in vocabulary])
    writer.add_token_types([kind for _, kind, _ in vocabulary])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(add_space_prefix)


def write_tiny(path: Path, *, add_space_prefix: bool) -> None:
    """A vocabulary-only llama GGUF with the tiny SentencePiece vocabulary."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(4)
    add_tiny_vocabulary(writer, add_space_prefix=add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def reference(path: Path) -> dict:
    """llama.cpp's ids and texts for every corpus string (see the module docstring)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)

    def detokenize(ids: list[int], remove_special: bool, unparse_special: bool) -> str:
        array = (llama_cpp.llama_token * len(ids))(*ids)
        size = 64 * (len(ids) + 1)
        buffer = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(vocab, array, len(ids), buffer, size, remove_special,
                                       unparse_special)
        if n < 0:
            raise RuntimeError(f"llama_detokenize needs {-n} bytes")
        return buffer.raw[:n].decode("utf-8")

    cases = []
    for text in CORPUS:
        for add_bos in (False, True):
            ids = llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)
            cases.append({"text": text, "add_bos": add_bos, "ids": ids,
                          "decoded_skip_special": detokenize(ids, True, False),
                          "decoded_with_special": detokenize(ids, False, True)})
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"file": path.name, "file_sha256": digest,
            "reference": f"llama-cpp-python {llama_cpp.__version__}: llama_tokenize (special "
                         f"tokens parsed), llama_detokenize", "cases": cases}


def _dump(fixture: dict) -> str:
    """The fixture as JSON with one case per line, so a diff shows which strings changed."""
    head = {key: value for key, value in fixture.items() if key != "cases"}
    cases = ",\n".join("  " + json.dumps(case, ensure_ascii=False) for case in fixture["cases"])
    return json.dumps(head, ensure_ascii=False, indent=1)[:-2] + ',\n "cases": [\n' + cases + "\n ]\n}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny-only", action="store_true", help="leave the Gemma fixture alone")
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    files = []
    for name, prefix in (("tiny-spm.gguf", True), ("tiny-spm-no-prefix.gguf", False)):
        write_tiny(OUT / name, add_space_prefix=prefix)
        files.append((OUT / name, OUT / name.replace(".gguf", ".json")))
    if not args.tiny_only:
        from meshserve.model.loading.hub import resolve_model

        files.append((resolve_model("gemma-3-270m").path, OUT / "gemma-3-270m.json"))
    for gguf_path, fixture in files:
        fixture.write_text(_dump(reference(gguf_path)), encoding="utf-8")
        print(f"wrote {fixture.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
