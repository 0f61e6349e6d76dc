"""Generate the committed reference fixtures under ``tests/golden/``.

This script is a *developer tool*, not part of meshserve's runtime: it needs
HF ``transformers`` + ``torch`` (CPU is enough), plus ``gguf``, ``tokenizers``,
``safetensors``, ``accelerate`` (HF refuses to load a GGUF without it) and
``jinja2``.  None of these are meshserve runtime dependencies, so run it from a
separate virtual environment.  Everything is offline; nothing is downloaded.

Regenerate with::

    /path/to/venv-with-transformers/bin/python scripts/make_golden.py \\
        --gguf /path/to/SmolLM2-135M-Instruct.Q4_1.gguf [--out tests/golden]

What it writes (``--out``, default ``tests/golden`` next to this script):

``smollm2.json``
    Greedy-decoding reference for the real SmolLM2-135M-Instruct GGUF.  HF
    loads the GGUF itself (``from_pretrained(dir, gguf_file=name)``), i.e. it
    dequantizes Q4_1/Q8_0 to float32 and un-permutes Q/K on its own, which makes
    it an independent reference for meshserve's GGUF loader.  For every case:
    the exact prompt text (chat template already rendered for chat cases), the
    prompt ids, 32 greedy (plain argmax, EOS ignored, no logits processors)
    token ids, the log_softmax log-probability of each chosen token computed
    from the raw logits, and the top-1 minus top-2 log-prob margin at each step
    (a small margin means a tie that float noise may legitimately flip).

``smollm2_tokenizer.json``
    Tokenizer reference: ~30 encode cases, chat-template renderings, the
    special tokens HF reports, vocab size, the chat template itself.  The ids
    come from the *true SmolLM2 tokenizer behaviour* (the hub tokenizer.json
    pre-tokenizer ``Sequence[Digits(individual_digits=True), ByteLevel]``,
    which is also llama.cpp's ``tokenizer.ggml.pre = "smollm"``), rebuilt here
    with the ``tokenizers`` library from the GGUF vocab + merges.  HF's GGUF
    tokenizer conversion ignores ``pre = "smollm"`` (plain ByteLevel only), which
    differs whenever a whitespace run is followed by a digit; where it differs
    the HF ids are recorded as ``hf_gguf_ids`` too.  See
    ``encode_reference_note`` in the file.  (Cross-checked once by hand against
    llama-cpp-python 0.3.36, whose tokenizer reproduces every reference id,
    including the cases where HF differs.)

``tiny-llama/``, ``tiny-llama3-rope/``, ``tiny-qwen2/``, ``tiny-gpt2/``
    Tiny randomly initialised HF models saved with ``save_pretrained``
    (safetensors; tiny-llama is sharded with ``model.safetensors.index.json``),
    each with ``logits.npz`` holding ``input_ids`` (int32 [2, 20]) and
    ``logits`` (float32 [2, 20, vocab]) from a plain full forward pass (no KV
    cache, all-ones attention mask).  Weights are re-initialised with larger
    values than HF's default (std 0.02 gives near-zero logits): matrices
    N(0, 0.2^2) (logits std ~1.6), norm weights 1 + N(0, 0.1^2), biases N(0, 0.1^2).
    transformers 5 writes ``rope_parameters`` in config.json; the script also
    adds the legacy ``rope_theta`` / ``rope_scaling`` keys that hub checkpoints
    written by transformers 4.x carry, and checks that HF reloads the folder to
    bit-identical logits.

Every output records the transformers / torch versions.  Runs are
deterministic (seeds, float32, ``torch.set_num_threads(2)``, deterministic
algorithms, fixed zip timestamps in .npz): running the script twice gives
byte-identical files on the same machine and library versions.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import random
import shutil
import sys
import zipfile
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
NUM_NEW_TOKENS = 32
MATRIX_STD = 0.2  # tiny models: weight matrices ~ N(0, 0.2^2) -> logits std ~1.6
ADD_SPECIAL_TOKENS = False  # this GGUF says add_bos_token=False; HF adds nothing either way (checked below)

# --------------------------------------------------------------------------- #
# prompts

LONG_PASSAGE = """\
The town of Marrowick sits where the river Alder bends twice before it reaches the sea, and for most of its history the town was defined less by what it made than by what it could not cross. Farmers on the northern bank grew barley and kept sheep on the chalk hills; the southern bank, lower and wetter, belonged to fishermen, rope-makers and the families who cut reeds for thatch. Between them ran a river that was shallow enough to ford for three months of the year and dangerous for the other nine.

For centuries the only reliable link was a ferry, a flat-bottomed boat hauled across on a chain by whoever happened to be on duty. Parish records from the early seventeenth century complain that the ferryman was often drunk, sometimes absent, and occasionally both. A petition signed by forty-one householders in 1702 asked the county to build a bridge, but the county replied that Marrowick was too small to deserve one and too poor to pay for one itself. The petition was filed, forgotten, and rediscovered two hundred years later by a schoolteacher who found it wrapped around a bundle of tithe receipts.

The first bridge was eventually built not by the county but by a wool merchant named Edith Carrow, who had grown tired of losing carts to the spring floods. In 1788 she paid a team of carpenters from the coast to raise a timber bridge on oak piles driven into the riverbed. It was narrow, creaked alarmingly in high wind, and charged a toll of one penny for a person on foot and fourpence for a loaded wagon. Within a decade the toll had repaid her investment, and the bridge had changed the shape of the town. Markets that had been held separately on each bank merged into a single Saturday fair on the northern side, and the southern bank, once a place people passed through only when they had to, became a neighbourhood of workshops and small inns.

Timber, however, does not love water. The oak piles rotted from the inside, and by the 1830s carters had learned to cross one at a time and never to stop in the middle. In the winter of 1841 a week of heavy rain upstream sent a surge of water and broken trees down the Alder. The surge struck the bridge at night, tore away the two central spans, and carried them almost a mile downstream, where they lodged against the mill weir. Nobody was killed, which the local newspaper attributed to providence and the townspeople attributed to the fact that the bridge had been closed at dusk ever since a cow fell through it the previous autumn.

What followed was an argument that lasted six years. One faction wanted to rebuild quickly in timber, as before, because timber was cheap and the carpenters were still available. Another faction, led by the mill owner Josiah Pell, insisted on stone. Pell had watched the wreckage of the old bridge pile up against his weir and had no wish to see it happen again; he also pointed out, with some justice, that a stone bridge would not need its piles replaced every forty years. The timber faction accused him of wanting a monument rather than a crossing. The stone faction replied that a crossing which fell down was not much of a crossing at all.

The deadlock was broken by money rather than persuasion. The arrival of the railway in a neighbouring valley threatened to draw trade away from Marrowick entirely, and the merchants of both banks realised that a town without a dependable bridge would soon be a town without a market. They formed a subscription, each family contributing according to its means, and Pell agreed to match whatever the town raised if the bridge was built of stone. The subscription raised a little over eleven hundred pounds; Pell kept his word, and the combined sum was enough to hire an engineer from the city and a crew of masons.

The stone bridge opened in the spring of 1849. It has three arches of local grey limestone, with cutwaters on the upstream side shaped like the prows of ships to split floating debris before it can strike the piers. The masons carved their marks into the underside of the arches, and on a calm day at low water you can still see them from a rowing boat: a triangle, a key, a pair of crossed hammers, and a small fish that nobody has ever been able to attribute to a particular man. The toll was abolished in 1872, and the toll house at the northern end became, in turn, a cobbler's shop, a post office, a tea room and, today, a small museum.

The bridge has survived every flood since, including the great flood of 1953, when water rose to within a hand's breadth of the parapet. It has survived, too, the arrival of motor traffic, although lorries over a certain weight have been forbidden to use it since the 1970s and now take a concrete bypass built a mile upstream. Most residents agree that the bypass is ugly, practical and entirely forgettable, which is perhaps the highest praise a piece of infrastructure can receive.

Historians of the town like to say that Marrowick was made twice: once by the river, which gave it fish, reeds and fertile silt, and once by the bridges, which turned two wary settlements into one community. The ferry chain is displayed in the museum beside Edith Carrow's account book, in which she recorded every penny of toll in a small, careful hand. Visitors often ask why the second bridge was built so differently from the first. The guides usually answer with a single sentence written by Josiah Pell in a letter to his brother: a town that has lost one bridge to the river should not offer it a second.\
"""

LONG_QUESTION = (
    "Based only on the passage above, why was the second bridge built of stone rather than timber, "
    "and how was it paid for? Answer in two sentences."
)


def build_cases(hf_tok):
    """(name, text) pairs; chat cases are rendered with HF's chat template."""

    def chat(messages):
        return hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    return [
        ("plain_english", "The capital of France is"),
        ("chat_english", chat([{"role": "user", "content": "What is the boiling point of water at sea level in Celsius?"}])),
        ("digits", "Compute 12345 + 678 ="),
        ("chat_chinese", chat([{"role": "user", "content": "请用两句话介绍一下北京。"}])),
        ("code_python", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
        ("chat_long_context", chat([{"role": "user", "content": LONG_PASSAGE + "\n\n" + LONG_QUESTION}])),
        ("one_token", "Hello"),
        # whitespace run followed by digits: the case where HF's GGUF tokenizer (no Digits
        # pre-tokenizer) and the true SmolLM2 tokenizer disagree
        ("numbered_list", "Shopping list:\n\n1. eggs\n2. milk\n3."),
        ("chat_system_multiturn", chat([
            {"role": "system", "content": "You are a terse assistant. Answer in at most ten words."},
            {"role": "user", "content": "Name a primary colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Name another one."},
        ])),
    ]


ENCODE_TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "",
    "2024",
    "3.14159",
    "1,000,000",
    "In 2024, about 8 billion people lived on Earth.",
    "  2024",
    "Shopping list:\n\n1. eggs\n2. milk",
    "Year:\t\t1999",
    "a\n\n\n2",
    "multiple   spaces    here",
    "line one\nline two\n\nline four\n",
    "tab\tseparated\tvalues",
    "trailing spaces   ",
    "emoji: 😀🎉👍🏽 done",
    "北京是中国的首都。",
    "日本語のテキストです。カタカナとひらがな。",
    "Café, naïve, résumé, Zürich, São Paulo, Ångström",
    "def add(a, b):\n    return a + b\n\n\nclass Foo:\n\tpass\n",
    "for (int i = 0; i < 10; ++i) { x[i] *= 2; }",
    "<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|>text after eos",
    "<|im_start|>assistant\nThe answer is 42.<|im_end|>\n",
    "I'm sure you'll see they've done it, didn't they?",
    "URL: https://example.com/path?q=1&x=y#frag",
    "½ cup, x² + y², ①②③, １２３",
    "Привет, мир! Γειά σου κόσμε!",
    "mixedCASE snake_case kebab-case CONSTANT_CASE",
]

CHAT_RENDERINGS = [
    ([{"role": "user", "content": "Hi there!"}], True),
    ([{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Where is the treasure?"}], True),
    ([
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ], True),
    ([{"role": "user", "content": "Tell me a joke."}, {"role": "assistant", "content": "Why did the chicken cross the road?"}], False),
]


# --------------------------------------------------------------------------- #
# helpers


def setup_determinism(seed: int = 0) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float32)


def versions() -> dict:
    import transformers

    return {"transformers_version": transformers.__version__, "torch_version": torch.__version__}


def _dump(obj, indent: int = 0) -> str:
    """JSON with nested structure indented but lists of scalars kept on one line."""
    pad = " " * indent
    inner = " " * (indent + 1)
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f"{inner}{json.dumps(k, ensure_ascii=False)}: {_dump(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, (list, tuple)):
        if all(not isinstance(x, (dict, list, tuple)) for x in obj):
            return json.dumps(list(obj), ensure_ascii=False)
        items = [inner + _dump(v, indent + 1) for v in obj]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    if isinstance(obj, float):
        assert math.isfinite(obj), obj
    return json.dumps(obj, ensure_ascii=False)


def write_json(path: Path, obj) -> None:
    path.write_text(_dump(obj) + "\n", encoding="utf-8")


def write_npz(path: Path, **arrays) -> None:
    """Like np.savez but with fixed zip timestamps, so the bytes are reproducible."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, arr in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.require(np.asarray(arr), requirements="C"), allow_pickle=False)
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_STORED
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def r6(x: float) -> float:
    return round(float(x), 6)


# --------------------------------------------------------------------------- #
# SmolLM2 tokenizer


def read_gguf_tokenizer_fields(gguf_path: Path) -> dict:
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields

    def get(key, default=None):
        f = fields.get(key)
        return f.contents() if f is not None else default

    return {
        "tokens": get("tokenizer.ggml.tokens"),
        "merges": get("tokenizer.ggml.merges"),
        "token_type": list(get("tokenizer.ggml.token_type")),
        "model": get("tokenizer.ggml.model"),
        "pre": get("tokenizer.ggml.pre"),
        "add_bos_token": get("tokenizer.ggml.add_bos_token"),
        "add_eos_token": get("tokenizer.ggml.add_eos_token"),
        "bos_token_id": get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": get("tokenizer.ggml.eos_token_id"),
        "unknown_token_id": get("tokenizer.ggml.unknown_token_id"),
        "padding_token_id": get("tokenizer.ggml.padding_token_id"),
        "chat_template": get("tokenizer.chat_template"),
    }


def build_reference_tokenizer(meta: dict):
    """The true SmolLM2 tokenizer (hub tokenizer.json / llama.cpp pre='smollm'), from GGUF vocab+merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    assert meta["model"] == "gpt2", meta["model"]
    assert meta["pre"] == "smollm", f"expected tokenizer.ggml.pre 'smollm', got {meta['pre']!r}"
    toks = meta["tokens"]
    vocab = {t: i for i, t in enumerate(toks)}
    merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tk.decoder = decoders.ByteLevel()
    # token_type 3 == CONTROL: <|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>, ...
    specials = [AddedToken(toks[i], special=True, normalized=False) for i, t in enumerate(meta["token_type"]) if t == 3]
    tk.add_special_tokens(specials)
    return tk


def load_hf_tokenizer(gguf_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def check_no_bos(hf_tok, ref_tok) -> None:
    for text in ["Hello", "The capital of France is"]:
        a = hf_tok(text, add_special_tokens=True).input_ids
        b = hf_tok(text, add_special_tokens=False).input_ids
        c = ref_tok.encode(text, add_special_tokens=False).ids
        assert a == b == c, (text, a, b, c)


def make_tokenizer_golden(gguf_path: Path, out: Path, meta: dict, hf_tok, ref_tok) -> None:
    encode = []
    n_diff = 0
    for text in ENCODE_TEXTS:
        ids = ref_tok.encode(text, add_special_tokens=False).ids
        hf_ids = hf_tok(text, add_special_tokens=False).input_ids
        assert ref_tok.decode(ids, skip_special_tokens=False) == text, text
        assert hf_tok.decode(ids, skip_special_tokens=False) == text, text
        entry = {"text": text, "ids": ids}
        if hf_ids != ids:
            entry["hf_gguf_ids"] = hf_ids
            n_diff += 1
        encode.append(entry)
    assert n_diff > 0, "expected HF's GGUF tokenizer to differ on whitespace-before-digit cases"

    hf_digits = hf_tok("2024", add_special_tokens=False).input_ids
    digit_tokens = sorted(i for i, t in enumerate(meta["tokens"]) if any("0" <= ch <= "9" for ch in t))
    assert len(digit_tokens) == 10, digit_tokens

    chat = []
    for messages, agp in CHAT_RENDERINGS:
        rendered = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=agp)
        chat.append({
            "messages": messages,
            "add_generation_prompt": agp,
            "rendered": rendered,
            "ids": ref_tok.encode(rendered, add_special_tokens=False).ids,
        })

    special = {}
    for name in ("bos", "eos", "unk", "pad"):
        tok_str = getattr(hf_tok, f"{name}_token")
        special[name] = tok_str
        special[f"{name}_id"] = getattr(hf_tok, f"{name}_token_id")
    special["gguf_metadata_ids"] = {
        "bos_token_id": meta["bos_token_id"],
        "eos_token_id": meta["eos_token_id"],
        "unknown_token_id": meta["unknown_token_id"],
        "padding_token_id": meta["padding_token_id"],
    }
    special["gguf_add_bos_token"] = meta["add_bos_token"]
    special["gguf_add_eos_token"] = meta["add_eos_token"]
    special["hf_adds_bos"] = hf_tok("Hello", add_special_tokens=True).input_ids != hf_tok(
        "Hello", add_special_tokens=False).input_ids
    special["control_tokens"] = {
        meta["tokens"][i]: i for i, t in enumerate(meta["token_type"]) if t == 3
    }
    assert special["hf_adds_bos"] is False

    assert hf_tok.chat_template == meta["chat_template"]
    obj = {
        "source": gguf_path.name,
        **versions(),
        "gguf_tokenizer_model": meta["model"],
        "gguf_tokenizer_pre": meta["pre"],
        "add_special_tokens": ADD_SPECIAL_TOKENS,
        "encode_reference_note": (
            "'ids' are from the true SmolLM2 tokenizer behaviour: byte-level BPE over the GGUF vocab+merges "
            "with pre-tokenizer Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False, "
            "use_regex=True)] (= hub tokenizer.json; = llama.cpp tokenizer.ggml.pre='smollm': regex '\\p{N}' "
            "then the GPT-2 regex), built with the `tokenizers` library by scripts/make_golden.py. "
            f"HF transformers {versions()['transformers_version']} AutoTokenizer(gguf_file=...) does NOT map "
            "pre='smollm' (it is absent from GGUF_PRE_TOKENIZER_SPLITS), so it uses plain ByteLevel(use_regex=True). "
            "ASCII digits still come out one per token with HF (the vocab's only tokens containing an ASCII digit "
            f"are the ten single digits 0-9, ids {digit_tokens}; HF encodes '2024' as {hf_digits}), but the two differ when a "
            "whitespace run precedes a digit or other numeric char (e.g. '  2024', '\\n\\n1.', '\\t\\t1999', ', ①'): Digits "
            "(every Unicode numeric char, like llama.cpp's \\p{N}) splits the run off as "
            "its own pre-token so it merges ('ĠĠ', 'ĊĊ', 'ĉĉ'), whereas the GPT-2 regex leaves the last whitespace "
            "char attached to the digit. Where HF differs, its ids are given as 'hf_gguf_ids'. Special tokens "
            "(token_type CONTROL) are matched in raw text. No BOS is added (GGUF add_bos_token=false)."
        ),
        "reference_pre_tokenizer": json.loads(ref_tok.to_str())["pre_tokenizer"],
        "hf_gguf_pre_tokenizer": json.loads(hf_tok.backend_tokenizer.to_str())["pre_tokenizer"],
        "encode": encode,
        "chat_template_source": "GGUF metadata tokenizer.chat_template (HF exposes it unchanged as tokenizer.chat_template)",
        "chat_template": meta["chat_template"],
        "chat": chat,
        "special_tokens": special,
        "vocab_size": len(hf_tok),
    }
    assert len(hf_tok) == len(meta["tokens"]) == ref_tok.get_vocab_size(with_added_tokens=True)
    write_json(out / "smollm2_tokenizer.json", obj)
    print(f"smollm2_tokenizer.json: {len(encode)} encode cases ({n_diff} differ from HF GGUF), {len(chat)} chats")


# --------------------------------------------------------------------------- #
# SmolLM2 greedy decode


def _cache_kw(model) -> str:
    """transformers >= 5.x names the KV-cache argument `cache`; older versions `past_key_values`."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def greedy(model, prompt_ids: list[int], n: int):
    kw = _cache_kw(model)
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
    past = getattr(out, kw)
    logits = out.logits[0, -1]
    toks, lps, margins = [], [], []
    for step in range(n):
        lp = torch.log_softmax(logits.float(), dim=-1)
        top2 = torch.topk(lp, 2)
        tok = int(torch.argmax(lp))
        assert tok == int(top2.indices[0])
        toks.append(tok)
        lps.append(float(lp[tok]))
        margins.append(float(top2.values[0] - top2.values[1]))
        if step == n - 1:
            break
        nxt = torch.tensor([[tok]], dtype=torch.long)
        total = len(prompt_ids) + len(toks)
        out = model(input_ids=nxt, attention_mask=torch.ones((1, total), dtype=torch.long),
                    use_cache=True, **{kw: past})
        past = getattr(out, kw)
        logits = out.logits[0, -1]
    return toks, lps, margins


@torch.no_grad()
def check_against_full_forward(model, prompt_ids, toks, lps, margins) -> float:
    """Recompute all steps with one cache-free forward; argmax must agree unless it's a near tie."""
    seq = torch.tensor([prompt_ids + toks[:-1]], dtype=torch.long)
    logits = model(input_ids=seq, attention_mask=torch.ones_like(seq), use_cache=False).logits[0]
    lp = torch.log_softmax(logits[len(prompt_ids) - 1:].float(), dim=-1)
    worst = 0.0
    for i, tok in enumerate(toks):
        if int(torch.argmax(lp[i])) != tok:
            assert margins[i] < 1e-3, (i, margins[i])
        worst = max(worst, abs(float(lp[i, tok]) - lps[i]))
    return worst


def make_smollm2_golden(gguf_path: Path, out: Path, hf_tok, ref_tok) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    model.eval()
    assert model.dtype == torch.float32
    cases = []
    for name, text in build_cases(hf_tok):
        prompt_ids = ref_tok.encode(text, add_special_tokens=False).ids
        hf_ids = hf_tok(text, add_special_tokens=ADD_SPECIAL_TOKENS).input_ids
        toks, lps, margins = greedy(model, prompt_ids, NUM_NEW_TOKENS)
        assert len(toks) == NUM_NEW_TOKENS
        worst = check_against_full_forward(model, prompt_ids, toks, lps, margins)
        cases.append({
            "name": name,
            "text": text,
            "prompt_ids": prompt_ids,
            "hf_gguf_tokenizer_agrees": hf_ids == prompt_ids,
            "greedy_ids": toks,
            "greedy_logprobs": [r6(x) for x in lps],
            "top2_margin": [r6(x) for x in margins],
        })
        print(f"  {name}: {len(prompt_ids)} prompt tokens, hf_tok_agrees={hf_ids == prompt_ids}, "
              f"min margin {min(margins):.4f}, cache-vs-full max |dlogprob| {worst:.2e}")
        print(f"    -> {hf_tok.decode(toks)!r}")
    assert any(len(c["prompt_ids"]) > 1000 for c in cases)
    assert any(len(c["prompt_ids"]) == 1 for c in cases)
    obj = {
        "source": gguf_path.name,
        **versions(),
        "dtype": "float32",
        "num_new_tokens": NUM_NEW_TOKENS,
        "add_special_tokens": ADD_SPECIAL_TOKENS,
        "note": (
            "HF AutoModelForCausalLM.from_pretrained(gguf_file=...) float32 (HF dequantizes the GGUF itself). "
            "Greedy = plain argmax over raw logits, KV-cached, EOS not special, no logits processors; logprobs are "
            "log_softmax of the raw logits, rounded to 6 decimals. prompt_ids come from the true SmolLM2 tokenizer "
            "(see smollm2_tokenizer.json encode_reference_note); no BOS is prepended. "
            "hf_gguf_tokenizer_agrees says whether HF's GGUF-converted tokenizer gives the same prompt ids."
        ),
        "cases": cases,
    }
    write_json(out / "smollm2.json", obj)


# --------------------------------------------------------------------------- #
# tiny random models


def tiny_configs():
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    llama = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=50000.0,
                 max_position_embeddings=128, rms_norm_eps=1e-5)
    llama3_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32}
    return [
        # (folder, config, seed, max_shard_size, legacy rope keys to add to config.json or None)
        ("tiny-llama", LlamaConfig(**llama, tie_word_embeddings=False), 1, "200KB",
         {"rope_theta": 50000.0, "rope_scaling": None}),
        ("tiny-llama3-rope", LlamaConfig(**llama, tie_word_embeddings=True, rope_scaling=dict(llama3_scaling)), 2,
         None, {"rope_theta": 50000.0, "rope_scaling": dict(llama3_scaling)}),
        ("tiny-qwen2", Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0,
                                   max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                   bos_token_id=None, eos_token_id=2), 3,
         None, {"rope_theta": 1000000.0, "rope_scaling": None}),
        ("tiny-gpt2", GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                 bos_token_id=0, eos_token_id=0), 4, None, None),
    ]


@torch.no_grad()
def reinit(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():  # tied parameters appear once
        if p.ndim >= 2:
            p.copy_(torch.randn(p.shape, generator=gen) * MATRIX_STD)
        elif name.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        elif name.endswith("weight"):  # RMSNorm / LayerNorm scale
            p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.1)
        else:
            raise ValueError(f"unexpected parameter {name} {tuple(p.shape)}")


def make_tiny_models(out: Path) -> None:
    from transformers import AutoModelForCausalLM

    for folder, config, seed, shard, legacy in tiny_configs():
        d = out / folder
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.eval()
        reinit(model, seed)
        if folder == "tiny-qwen2":
            attn = model.model.layers[0].self_attn
            assert attn.q_proj.bias is not None and attn.k_proj.bias is not None and attn.v_proj.bias is not None
            assert attn.o_proj.bias is None
        gen = torch.Generator().manual_seed(1000 + seed)
        input_ids = torch.randint(0, config.vocab_size, (2, 20), generator=gen)
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False).logits
        assert logits.shape == (2, 20, config.vocab_size) and torch.isfinite(logits).all()

        kwargs = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(str(d), **kwargs)
        cfg_path = d / "config.json"
        cfg = json.loads(cfg_path.read_text())
        if legacy:
            cfg.update(legacy)
        cfg["golden_note"] = (f"random tiny model from scripts/make_golden.py (seed {seed}); "
                               f"transformers {versions()['transformers_version']}, torch {torch.__version__}")
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        write_npz(d / "logits.npz", input_ids=input_ids.numpy().astype(np.int32),
                  logits=logits.numpy().astype(np.float32),
                  versions=np.array(json.dumps(versions(), sort_keys=True)))

        # round trip: HF must reload the folder (with the legacy keys) to identical logits
        re = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
        re.eval()
        with torch.no_grad():
            logits2 = re(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False).logits
        assert torch.equal(logits, logits2), f"{folder}: reload mismatch {(logits - logits2).abs().max()}"
        if shard:
            assert (d / "model.safetensors.index.json").exists()
            assert len(list(d.glob("model-*-of-*.safetensors"))) >= 2
        size = sum(f.stat().st_size for f in d.iterdir())
        print(f"  {folder}: logits std {logits.std().item():.3f}, |max| {logits.abs().max().item():.2f}, "
              f"files {sorted(f.name for f in d.iterdir())}, {size / 1024:.0f} KiB")
        assert 1.0 <= logits.std().item() <= 5.0, logits.std().item()
        assert size < 1024 * 1024


# --------------------------------------------------------------------------- #


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", required=True, type=Path, help="path to SmolLM2-135M-Instruct GGUF")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "golden")
    p.add_argument("--parts", default="tokenizer,smollm2,tiny",
                   help="comma-separated subset of: tokenizer, smollm2, tiny")
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    setup_determinism(0)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    gguf_path = args.gguf.resolve()
    print(f"transformers/torch: {versions()}; out={out}")

    if parts & {"tokenizer", "smollm2"}:
        meta = read_gguf_tokenizer_fields(gguf_path)
        ref_tok = build_reference_tokenizer(meta)
        hf_tok = load_hf_tokenizer(gguf_path)
        check_no_bos(hf_tok, ref_tok)
        if "tokenizer" in parts:
            make_tokenizer_golden(gguf_path, out, meta, hf_tok, ref_tok)
        if "smollm2" in parts:
            print("smollm2.json:")
            make_smollm2_golden(gguf_path, out, hf_tok, ref_tok)
    if "tiny" in parts:
        print("tiny models:")
        make_tiny_models(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
