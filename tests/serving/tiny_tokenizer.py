"""A real byte-level BPE tokenizer small enough for the tiny presets' 512-token vocabulary.

Ids: 0 `<pad>`, 1 `<eos>` (the tiny presets' EOS), 2..257 the 256 bytes, then one merged token
per merge below. Built with HF `tokenizers`, as SmolLM2's is, so a grammar library reads it the
same way; structured-output tests run random-weight tiny models with it (any text can be
written with it, byte by byte).
"""

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from meshserve.model.tokenizer import SpecialTokens, Tokenizer

EOS_ID = 1
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "a"), ("i", "n"), ("e", "r"), ("o", "n"),
          ("r", "e"), ("Ġ", "s"), ("a", "n"), ("\"", ":"), ("Ġ", "\""), ("t", "r"), ("u", "e"),
          ("tr", "ue"), ("Ġ", "1"), ("0", "0")]


def byte_symbols() -> list[str]:
    """The printable character byte-level BPE writes for each byte 0..255 (GPT-2's mapping:
    printable Latin-1 bytes stand for themselves, the others move to 256 and up)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    moved = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(moved)) for b in range(256)]


def tiny_tokenizer() -> Tokenizer:
    vocab = {"<pad>": 0, "<eos>": EOS_ID}
    for symbol in byte_symbols():
        vocab[symbol] = len(vocab)
    for left, right in MERGES:
        vocab.setdefault(left + right, len(vocab))
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=MERGES, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<pad>", special=True),
                                AddedToken("<eos>", special=True)])
    return Tokenizer(backend, special=SpecialTokens(bos_token_id=None, eos_token_ids=(EOS_ID,),
                                                    pad_token_id=0), chat_template=None)
