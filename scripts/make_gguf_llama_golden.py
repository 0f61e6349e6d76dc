"""Writes the llama.cpp parity fixtures under tests/golden/gguf-llama/: tiny random GGUF models
made here, and llama.cpp's greedy tokens and teacher-forced logprobs on them and on Gemma 3 270M.

    .venv/bin/python scripts/make_gguf_llama_golden.py            # the tiny files and Gemma 3
    .venv/bin/python scripts/make_gguf_llama_golden.py --tiny-only

The files (`TINY_MODELS`), each two layers with the SentencePiece vocabulary of
scripts/make_gguf_vocab_golden.py, written in float32 with the `gguf` package and then quantized
by llama.cpp's own quantizer (`llama_model_quantize`), so each block holds what llama.cpp would
write from those weights:

    tiny-llama          Llama 2 style, tied embedding: one type per kernel, every legacy type
                        (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and F32 and F16 kernels
    tiny-gemma3         Gemma 3: K-quants (Q4_K, Q5_K, Q6_K, the tied embedding in Q6_K), and
                        stacked kernels whose layers differ in type (ffn_up Q4_K then Q6_K,
                        ffn_down Q5_0 then Q8_0); sliding-window and full layers
    tiny-mistral-q4km   Mistral style (4:1 grouped KV heads, untied LM head), llama.cpp's
                        Q4_K_M mixture as it chooses it: ffn_down Q4_K and Q6_K, and, where a
                        row is not a multiple of 256 wide, its fallbacks (attn_v Q5_0 and Q8_0)

K-quants need rows of 256 weights, so their kernels read a 256-wide input; the rest are kept
narrow (64) so that each file stays a few hundred KB at most.

The reference, for each prompt: llama.cpp (llama-cpp-python, the `peers-llama-cpp` extra) runs
every token through its one-token decode path (`n_batch = n_ubatch = 1`: prompt and continuation
alike, so every logit comes from the same kernels), with an F32 KV cache (its default F16 cache
would round K, V and, in its flash attention, Q to half precision: noise that says nothing about
the weights). It picks `NUM_NEW_TOKENS` greedy tokens (the argmax of each step's logits) and
records, for the prompt plus that continuation, the log-softmax (float64) of each position's
logits at the next token (`logprobs`), and each greedy step's top-2 margin (for the near-tie
rule of the test). Inside its quantized dots llama.cpp rounds the activations to 8 bits (Q8_0,
Q8_1 or Q8_K blocks, F16 for F16 weights), so these differ from exact arithmetic on the same
weights. The same tokens are then run on a copy of the file whose weights llama.cpp itself has
dequantized to F32 (`llama_model_quantize` to `ALL_F32`, in scratch): `logprobs_f32`, exact
arithmetic on the file's weights, which meshserve must match closely; and that copy's own greedy
tokens and margins (`greedy_ids_f32`, `top2_margin_f32`).

llama.cpp runs in a child process (this script, `--child`), so a crash of its native code ends
that process only and is reported with the AMX hint of `meshserve.serving.bench.peers`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "golden" / "gguf-llama"
NUM_NEW_TOKENS = 16
PROMPTS = ("The capital of France is", "Once upon a time, there was", "a1 b2 c3: the cat sat")
GEMMA_PROMPTS = ("The capital of France is", "Once upon a time, there was",
                 "def fibonacci(n):")
# llama.cpp's threads spin while they wait, so on a busy CPU two are far slower than one; the
# results do not depend on the count (each dot runs whole on one thread).
THREADS = 1
CONTEXT = 256
ALL_F32 = 0  # LLAMA_FTYPE_ALL_F32
LOGIT_STD = 3.0
TIED_EMBEDDING_STD = 0.005
_T = gguf.GGMLQuantizationType


@dataclasses.dataclass(frozen=True)
class TinyModel:
    name: str
    arch: str  # general.architecture
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool
    # llama.cpp's quantizer: a `llama_ftype`, and tensor-name patterns (std::regex, the first
    # match wins) with the type each gets; without patterns llama.cpp chooses, as for a download.
    ftype: int
    types: tuple[tuple[str, _T], ...] = ()
    num_layers: int = 2
    sliding_window: int = 0
    seed: int = 0


TINY_MODELS = (
    TinyModel("tiny-llama", "llama", hidden=64, heads=4, kv_heads=2, head_dim=32, ffn=128,
              tied=True, ftype=7, seed=1, types=(  # 7: LLAMA_FTYPE_MOSTLY_Q8_0
                  (r"token_embd\.weight", _T.Q8_0), (r"attn_q\.weight", _T.Q4_0),
                  (r"attn_k\.weight", _T.F32), (r"attn_v\.weight", _T.F16),
                  (r"attn_output\.weight", _T.Q4_1), (r"ffn_gate\.weight", _T.Q5_0),
                  (r"ffn_up\.weight", _T.Q5_1), (r"ffn_down\.weight", _T.Q8_0))),
    TinyModel("tiny-gemma3", "gemma3", hidden=256, heads=2, kv_heads=1, head_dim=32, ffn=64,
              tied=True, ftype=7, sliding_window=6, seed=2, types=(
                  (r"token_embd\.weight", _T.Q6_K), (r"attn_q\.weight", _T.Q4_K),
                  (r"attn_k\.weight", _T.Q5_K), (r"attn_v\.weight", _T.Q6_K),
                  (r"attn_output\.weight", _T.Q8_0), (r"ffn_gate\.weight", _T.Q5_K),
                  (r"blk\.0\.ffn_up\.weight", _T.Q4_K), (r"blk\.1\.ffn_up\.weight", _T.Q6_K),
                  (r"blk\.0\.ffn_down\.weight", _T.Q5_0),
                  (r"blk\.1\.ffn_down\.weight", _T.Q8_0))),
    TinyModel("tiny-mistral-q4km", "llama", hidden=64, heads=4, kv_heads=1, head_dim=32,
              ffn=256, tied=False, ftype=15, seed=3),  # 15: LLAMA_FTYPE_MOSTLY_Q4_K_M
)


# --- The files ----------------------------------------------------------------------------------


def _tiny_vocabulary_module():
    """`scripts/make_gguf_vocab_golden.py`, which holds the tiny SentencePiece vocabulary."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_gguf_vocab_golden

    return make_gguf_vocab_golden


def _vocabulary() -> list[tuple[str, int, float]]:
    return _tiny_vocabulary_module().tiny_vocabulary()


def write_float_model(path: Path, model: TinyModel) -> None:
    """The model in float32 with random weights: kernels of std 1/sqrt(fan-in), norm weights
    near 1, logits of std about `LOGIT_STD`.

    A tied embedding is small (`TIED_EMBEDDING_STD`) and the final norm large instead: the
    residual stream keeps the last token's own embedding, which would otherwise outscore every
    other row of the same matrix, and the model would only repeat its last token."""
    rng = np.random.default_rng(model.seed)
    vocabulary = _vocabulary()
    D, F, hd = model.hidden, model.ffn, model.head_dim
    Q, KV = model.heads * hd, model.kv_heads * hd

    def kernel(out: int, inp: int, std: float | None = None) -> np.ndarray:
        std = 1 / np.sqrt(inp) if std is None else std
        return (std * rng.standard_normal((out, inp))).astype(np.float32)

    def norm(n: int, center: float = 1.0) -> np.ndarray:
        return (center * (1.0 + 0.1 * rng.standard_normal(n))).astype(np.float32)

    if model.tied:
        std, head_norm = TIED_EMBEDDING_STD, LOGIT_STD / (np.sqrt(D) * TIED_EMBEDDING_STD)
    else:
        std, head_norm = None, 1.0
    tensors = {"token_embd.weight": kernel(len(vocabulary), D, std),
               "output_norm.weight": norm(D, head_norm)}
    if not model.tied:
        tensors["output.weight"] = kernel(len(vocabulary), D, LOGIT_STD / np.sqrt(D))
    is_gemma = model.arch == "gemma3"
    for i in range(model.num_layers):
        block = {"attn_norm": norm(D), "attn_q": kernel(Q, D), "attn_k": kernel(KV, D),
                 "attn_v": kernel(KV, D), "attn_output": kernel(D, Q), "ffn_norm": norm(D),
                 "ffn_gate": kernel(F, D), "ffn_up": kernel(F, D), "ffn_down": kernel(D, F)}
        if is_gemma:
            block |= {"attn_q_norm": norm(hd), "attn_k_norm": norm(hd),
                      "post_attention_norm": norm(D), "post_ffw_norm": norm(D)}
        tensors |= {f"blk.{i}.{name}.weight": w for name, w in block.items()}

    writer = gguf.GGUFWriter(str(path), model.arch)
    writer.add_name(model.name)
    writer.add_block_count(model.num_layers)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(D)
    writer.add_feed_forward_length(F)
    writer.add_head_count(model.heads)
    writer.add_head_count_kv(model.kv_heads)
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_layer_norm_rms_eps(1e-6 if is_gemma else 1e-5)
    if is_gemma:
        writer.add_rope_freq_base(1e6)
        writer.add_sliding_window(model.sliding_window)
        # Layer 0 slides, layer 1 attends to everything (Gemma 3's 5:1 in miniature).
        writer.add_sliding_window_pattern([True, False])
    else:
        writer.add_rope_freq_base(10000.0)
        writer.add_rope_dimension_count(hd)
    _tiny_vocabulary_module().add_tiny_vocabulary(writer, add_space_prefix=True)
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tensor_types(path: Path) -> dict[str, str]:
    """{tensor name: GGUF type name} of a file, in file order."""
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


# --- llama.cpp, in a child process --------------------------------------------------------------


def run_child(job: dict) -> dict:
    """Runs this script's `--child` on `job` and returns its result; a failure raises with the
    child's output, and a death by a signal with the AMX hint."""
    with tempfile.TemporaryDirectory(prefix="meshserve-gguf-llama-") as scratch:
        job_path, result_path = Path(scratch) / "job.json", Path(scratch) / "result.json"
        job_path.write_text(json.dumps(job))
        done = subprocess.run([sys.executable, __file__, "--child", str(job_path),
                               str(result_path)], capture_output=True, text=True)
        if done.returncode != 0:
            from meshserve.serving.bench.peers import NO_AMX_FLAGS

            hint = (f" (killed by signal {-done.returncode}: llama.cpp built with AMX dies so "
                    f"on some CPUs; reinstall llama-cpp-python with {' '.join(NO_AMX_FLAGS)} in "
                    "its C and C++ flags)" if done.returncode < 0 else "")
            raise RuntimeError(f"llama.cpp's process exited with status {done.returncode}"
                               f"{hint}:\n{done.stderr[-4000:]}")
        return json.loads(result_path.read_text())


def _child(job: dict) -> dict:
    if job["kind"] == "quantize":
        return _quantize(job)
    return _reference(job)


def _quantize(job: dict) -> dict:
    """llama.cpp's quantizer from `source` to `target`; with ftype 0 (all F32) it dequantizes
    a quantized file with llama.cpp's own block decoders."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = job["ftype"]
    params.nthread = THREADS
    params.allow_requantize = True
    overrides = (llama_cpp.llama_model_tensor_override * (len(job["types"]) + 1))()
    for slot, (pattern, qtype) in zip(overrides, job["types"]):
        slot.pattern, slot.type = pattern.encode(), qtype
    if job["types"] or job["ftype"] == ALL_F32:  # llama.cpp's own mixture rules stay out
        params.pure = True
    if job["types"]:
        params.tt_overrides = ctypes.cast(overrides, type(params.tt_overrides))
    status = llama_cpp.llama_model_quantize(job["source"].encode(), job["target"].encode(),
                                            ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize returned {status}")
    return {}


def _reference(job: dict) -> dict:
    """Greedy tokens and teacher-forced logprobs of each prompt on `model`, and on `f32_model`
    the logprobs of the same tokens and its own greedy tokens (see the module docstring)."""
    import llama_cpp

    llm = _open(job["model"])
    cases = []
    for text in job["prompts"]:
        prompt = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
        greedy, margins = _greedy(llm, prompt, job["num_new_tokens"])
        cases.append({"text": text, "prompt_ids": prompt, "greedy_ids": greedy,
                      "top2_margin": margins, "logprobs": _forced_logprobs(llm, prompt + greedy)})
    del llm
    f32 = _open(job["f32_model"])
    for case in cases:
        case["logprobs_f32"] = _forced_logprobs(f32, case["prompt_ids"] + case["greedy_ids"])
        case["greedy_ids_f32"], case["top2_margin_f32"] = _greedy(f32, case["prompt_ids"],
                                                                  job["num_new_tokens"])
    return {"version": llama_cpp.__version__, "cases": cases}


def _greedy(llm, prompt: list[int], num_new_tokens: int) -> tuple[list[int], list[float]]:
    """`num_new_tokens` greedy tokens after `prompt`, and each step's top-2 logit margin; the
    last token is not evaluated."""
    llm.reset()
    llm.eval(prompt)
    greedy, margins = [], []
    while True:
        logits = np.asarray(llm.scores[llm.n_tokens - 1], np.float64)
        top2 = np.sort(logits)[-2:]
        greedy.append(int(np.argmax(logits)))
        margins.append(float(top2[1] - top2[0]))
        if len(greedy) == num_new_tokens:
            return greedy, _rounded(margins)
        llm.eval(greedy[-1:])


def _open(path: str):
    """llama.cpp on `path`: one token per decode (n_batch = n_ubatch = 1), logits kept for
    every position, an F32 KV cache."""
    import llama_cpp

    return llama_cpp.Llama(model_path=path, n_ctx=CONTEXT, n_batch=1, n_ubatch=1,
                           logits_all=True, type_k=llama_cpp.GGML_TYPE_F32,
                           type_v=llama_cpp.GGML_TYPE_F32, n_threads=THREADS,
                           n_threads_batch=THREADS, verbose=False)


def _forced_logprobs(llm, tokens: list[int]) -> list[float]:
    """The log-softmax (float64) of the logits at each position of `tokens` but the last, at
    the token that follows it."""
    if llm.n_tokens != len(tokens) - 1 or list(llm.input_ids[:llm.n_tokens]) != tokens[:-1]:
        llm.reset()
        llm.eval(tokens[:-1])
    logits = np.asarray(llm.scores[:len(tokens) - 1], np.float64)  # [n - 1, V]
    logprobs = logits - logits.max(axis=-1, keepdims=True)
    logprobs -= np.log(np.exp(logprobs).sum(axis=-1, keepdims=True))
    return _rounded(logprobs[np.arange(len(tokens) - 1), tokens[1:]])


def _rounded(values) -> list[float]:
    return [round(float(x), 6) for x in values]


# --- Fixtures -----------------------------------------------------------------------------------


def fixture(path: Path, prompts: tuple[str, ...], *, name: str, file: str | None) -> dict:
    """llama.cpp's greedy tokens and logprobs on `path`, and its logprobs on `path`'s weights
    dequantized to F32 by llama.cpp (in scratch)."""
    with tempfile.TemporaryDirectory(prefix="meshserve-gguf-llama-") as scratch:
        f32 = Path(scratch) / "f32.gguf"
        run_child({"kind": "quantize", "source": str(path), "target": str(f32),
                   "ftype": ALL_F32, "types": []})
        result = run_child({"kind": "reference", "model": str(path), "f32_model": str(f32),
                            "prompts": list(prompts), "num_new_tokens": NUM_NEW_TOKENS})
    return {
        "name": name, "file": file, "file_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "tensor_types": sorted(set(tensor_types(path).values())),
        "reference": f"llama-cpp-python {result['version']}, CPU, every token through the "
                     "one-token decode (n_batch = n_ubatch = 1), F32 KV cache; logprobs: the "
                     "float64 log-softmax of its logits at the next token of prompt + greedy; "
                     "logprobs_f32: the same tokens on the weights dequantized to F32 by "
                     "llama.cpp, and greedy_ids_f32, top2_margin_f32 its own greedy tokens",
        "num_new_tokens": NUM_NEW_TOKENS, "cases": result["cases"],
    }


def write_tiny(model: TinyModel) -> Path:
    """The tiny model's quantized GGUF, written into OUT (its float32 source is scratch)."""
    target = OUT / f"{model.name}.gguf"
    with tempfile.TemporaryDirectory(prefix="meshserve-gguf-llama-") as scratch:
        source = Path(scratch) / "f32.gguf"
        write_float_model(source, model)
        run_child({"kind": "quantize", "source": str(source), "target": str(target),
                   "ftype": model.ftype, "types": [[p, int(t)] for p, t in model.types]})
    return target


def _dump(data: dict) -> str:
    """The fixture as JSON with one case per line, so a diff shows which prompt changed."""
    head = {key: value for key, value in data.items() if key != "cases"}
    cases = ",\n".join("  " + json.dumps(case, ensure_ascii=False) for case in data["cases"])
    return (json.dumps(head, ensure_ascii=False, indent=1)[:-2] + ',\n "cases": [\n' + cases
            + "\n ]\n}\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        job = json.loads(Path(argv[1]).read_text())
        Path(argv[2]).write_text(json.dumps(_child(job)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny-only", action="store_true", help="leave the Gemma fixture alone")
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    for model in TINY_MODELS:
        path = write_tiny(model)
        data = fixture(path, PROMPTS, name=model.name, file=path.name)
        (OUT / f"{model.name}.json").write_text(_dump(data), encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size // 1024} KB): "
              f"{', '.join(data['tensor_types'])}")
    if not args.tiny_only:
        from meshserve.model.loading.hub import resolve_model

        path = resolve_model("gemma-3-270m").path
        data = fixture(path, GEMMA_PROMPTS, name="gemma-3-270m", file=None)
        (OUT / "gemma-3-270m.json").write_text(_dump(data), encoding="utf-8")
        print(f"wrote {(OUT / 'gemma-3-270m.json').relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
