"""Per-step host cost of the grammar libraries meshserve could constrain decoding with.

Measures llguidance and xgrammar, whichever are installed, on one tokenizer (SmolLM2's 49,152
ids by default) and the same constraints: for each, the compile time, then a replay of a valid
output token by token, timing each step's mask (a numpy int32 bitmask [1, vocab/32]) and the
advance of the matcher by the token. It also reports whether importing the library needs torch.

    .venv/bin/python scripts/compare_grammar_libraries.py --tokenizer /tmp/tokenizer.json

`--tokenizer` is a HF `tokenizer.json`; without it the script builds SmolLM2's from meshserve.
The libraries may live in another environment than meshserve's (xgrammar needs torch):
write the tokenizer once with `--write-tokenizer PATH` and pass it there.

With `--output`, the JSON also names the command, the machine and the commit of the source it ran
from (`meshserve.serving.bench.result_files`, loaded from this checkout where meshserve is not
installed): a tree with uncommitted changes is refused unless `--allow-dirty`, and so is a file
that exists (a result is never overwritten).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
                 "maxItems": 5},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "tags", "address"],
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@math.org",
            "tags": ["red", "blue", "green"], "address": {"city": "London", "zip": "W1"},
            "score": 0.875}
REGEX = r"[A-Z][a-z]+ (is|was) [0-9]{1,3} years old\."
REGEX_TEXT = "Ada was 36 years old."


def smollm2_tokenizer_json() -> tuple[str, int, list[int]]:
    from meshserve.model.loading.hub import resolve_model
    from meshserve.model.loading.pretrained import load_tokenizer

    tokenizer = load_tokenizer(resolve_model("smollm2-135m-instruct"))
    return tokenizer._backend.to_str(), tokenizer.vocab_size, list(tokenizer.eos_token_ids)


def timed(fn, repeats: int = 1) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats


def summary(step_us: list[float]) -> dict:
    ordered = sorted(step_us)
    return {"steps": len(ordered), "mean_us": round(statistics.fmean(ordered), 1),
            "p50_us": round(ordered[len(ordered) // 2], 1),
            "p99_us": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 1)}


def needs_torch(module: str) -> bool:
    """Whether importing `module` pulls in torch."""
    before = "torch" in sys.modules
    importlib.import_module(module)
    return not before and "torch" in sys.modules


def run_llguidance(tokenizer_json: str, vocab: int, eos: list[int], cases) -> dict:
    import llguidance
    import llguidance.numpy as llnp

    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
    out = {"version": llguidance.__version__}
    for name, (kind, source, tokens) in cases.items():
        grammar = (llguidance.LLMatcher.grammar_from_json_schema(source) if kind == "json"
                   else llguidance.LLMatcher.grammar_from_regex(source))
        started = time.perf_counter()
        template = llguidance.LLMatcher(tokenizer, grammar)
        compile_ms = (time.perf_counter() - started) * 1e3
        assert not template.is_error(), template.get_error()
        mask = llnp.allocate_token_bitmask(1, vocab)
        steps = []
        for _ in range(5):
            matcher = template.deep_copy()
            for token in tokens:
                started = time.perf_counter()
                llnp.fill_next_token_bitmask(matcher, mask)
                assert mask[0, token // 32] >> (token % 32) & 1, "a valid token was masked"
                assert matcher.consume_token(token), matcher.get_error()
                steps.append((time.perf_counter() - started) * 1e6)
        out[name] = {"compile_ms": round(compile_ms, 1), **summary(steps)}
    return out


def run_xgrammar(tokenizer_json: str, vocab: int, eos: list[int], cases) -> dict:
    import xgrammar
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json))
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
    compiler = xgrammar.GrammarCompiler(info)
    out = {"version": importlib.metadata.version("xgrammar")}
    for name, (kind, source, tokens) in cases.items():
        started = time.perf_counter()
        compiled = (compiler.compile_json_schema(json.dumps(source)) if kind == "json"
                    else compiler.compile_regex(source))
        compile_ms = (time.perf_counter() - started) * 1e3
        mask = np.full((1, (vocab + 31) // 32), -1, np.int32)
        steps = []
        for _ in range(5):
            matcher = xgrammar.GrammarMatcher(compiled)
            for token in tokens:
                started = time.perf_counter()
                matcher.fill_next_token_bitmask(mask)
                assert mask[0, token // 32] >> (token % 32) & 1, "a valid token was masked"
                assert matcher.accept_token(token)
                steps.append((time.perf_counter() - started) * 1e6)
        out[name] = {"compile_ms": round(compile_ms, 1), **summary(steps)}
    return out


def result_files():
    """meshserve's result-file module: from the installed package, or in an environment
    without meshserve from this checkout's `serving/bench/result_files.py` (standard library
    only), so that one module stamps every result."""
    try:
        from meshserve.serving.bench import result_files as module
    except ImportError:
        path = Path(__file__).resolve().parents[1] / "serving" / "bench" / "result_files.py"
        spec = importlib.util.spec_from_file_location("meshserve_result_files", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while defining
        spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", help="a HF tokenizer.json (default: SmolLM2's)")
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--eos", type=int, nargs="*", default=[2])
    parser.add_argument("--write-tokenizer", help="write SmolLM2's tokenizer.json here and exit")
    parser.add_argument("--output", help="also write the JSON to this new file; {date} and "
                                         "{commit} in the name are filled in")
    files = result_files()
    files.add_allow_dirty_argument(parser)
    args = parser.parse_args()
    try:
        source, output = files.prepare_output(args.output, allow_dirty=args.allow_dirty)
    except ValueError as err:
        parser.error(str(err))
    if args.write_tokenizer:
        text, _, _ = smollm2_tokenizer_json()
        open(args.write_tokenizer, "w").write(text)
        return
    if args.tokenizer:
        text, vocab, eos = open(args.tokenizer).read(), args.vocab_size, args.eos
    else:
        text, vocab, eos = smollm2_tokenizer_json()
    from tokenizers import Tokenizer

    encode = Tokenizer.from_str(text).encode
    cases = {
        "json_schema": ("json", SCHEMA,
                        encode(json.dumps(INSTANCE), add_special_tokens=False).ids + eos[:1]),
        "regex": ("regex", REGEX, encode(REGEX_TEXT, add_special_tokens=False).ids + eos[:1]),
    }
    results = {"vocab_size": vocab}
    for library, run in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar)):
        try:
            results[library] = {"imports_torch": needs_torch(library),
                                **run(text, vocab, eos, cases)}
        except ImportError as error:
            results[library] = {"skipped": f"not installed ({error})"}
    print(json.dumps(results, indent=2))
    if output is not None:
        command = shlex.join(["scripts/compare_grammar_libraries.py", *sys.argv[1:]])
        files.write_json(output, {"command": command,
                                  "environment": files.host_environment(source)} | results)
        print(f"wrote {output}", file=sys.stderr)


if __name__ == "__main__":
    main()
