"""meshserve against llama.cpp on the same GGUF files: greedy tokens and teacher-forced logprobs.

`scripts/make_gguf_llama_golden.py` wrote the fixtures under tests/golden/gguf-llama/: three tiny
random GGUFs quantized by llama.cpp's own quantizer (every block type meshserve reads, F32 and F16
kernels, stacked kernels whose layers differ in type, llama.cpp's Q4_K_M mixture), and, for them
and the real Gemma 3 270M Q4_K_M, what llama.cpp computes: its greedy tokens with each step's
top-2 margin, the logprob of every next token of prompt + greedy continuation on the file as it
is (`logprobs`), and on the same weights dequantized to F32 by llama.cpp (`logprobs_f32`).

meshserve loads each file under `auto` (the quantized blocks kept, as the engine serves them) and
`none` (dequantized to float32), runs the prompt + continuation as one prefill step with targets
(the runner's prompt logprobs) and, under `auto`, greedy decoding (`generate_greedy`), and is held
to:

- `logprobs_f32` within `F32_TOLERANCE`: the same weights in float32 arithmetic on both sides,
  so this is the check of every block decoder (one wrong bit of a block type shows up as a
  whole nat). Gemma's is looser because llama.cpp's CPU GELU reads a float16 table (its input
  rounded to half precision); emulating that table on meshserve's side brings tiny-gemma3 from
  3.3e-3 to 3e-4.
- `logprobs` within `QUANTIZED_TOLERANCE`: inside each quantized dot llama.cpp rounds the
  activations to 8 bits (Q8_0 or Q8_1 blocks of 32, Q8_K blocks of 256; F16 for F16 weights), a
  relative error of up to about 1/250 per element that meshserve, which dots float32 activations
  with the exact weights, does not make. llama.cpp's own run on the F32 copy differs from its
  quantized run by as much as meshserve does: on random weights by up to 0.28 nats (0.04 to
  0.06 on average), on Gemma 3 270M by up to 0.35.
- greedy tokens equal to llama.cpp's, except where llama.cpp's top-2 margin at the first
  difference is under `NEAR_TIE`: an error of at most QUANTIZED_TOLERANCE in each of two
  logprobs can swap two tokens less than twice that apart (the splits seen are at margins of
  0.006 to 0.09). Later tokens then follow different contexts and are not compared. The argmax
  at each position of the teacher-forced step is held to the same rule; the greedy tokens also
  to those of llama.cpp on the F32 weights, with a near-tie of twice `F32_TOLERANCE` (they are
  equal on every prompt here, Gemma 3 270M included).

A live test re-runs llama.cpp on the committed tiny files, when llama-cpp-python is installed, to
check that the fixtures are its current output.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from meshserve.batching.plan import sub_batch_from_rows
from meshserve.model.executor.runner import ModelRunner, RunnerConfig
from meshserve.model.loading.gguf_blocks import BLOCK_TYPES
from meshserve.model.loading.pretrained import load_pretrained
from meshserve.model.quantized_weights import quantized_arrays
from meshserve.serving.engine.greedy_reference import generate_greedy

ROOT = Path(__file__).parents[2]
FIXTURES = ROOT / "tests" / "golden" / "gguf-llama"
TINY = ("tiny-llama", "tiny-gemma3", "tiny-mistral-q4km")
# Logprob tolerances, by GGUF architecture, over the largest |meshserve - llama.cpp| measured at
# any position of any prompt (auto and none give the same): against the F32 copy 6.1e-6 for the
# Llama-style files, 3.3e-3 for tiny-gemma3 and 2.3e-3 for Gemma 3 270M; against the quantized
# file 0.14 (tiny-llama), 0.24 (tiny-mistral-q4km), 0.28 (tiny-gemma3), 0.35 (Gemma 3 270M).
# The module docstring says where each comes from.
F32_TOLERANCE = {"llama": 2e-5, "gemma3": 5e-3}
# Through the native kernels (`native`: the blocks kept as the engine keeps them where the kernels
# run, 4/5/6-bit packed), each dot's activations are rounded per group to 16 bits (at most 1/65024
# of the group's largest |x|; tests/model/test_native_dot.py): against the F32 copy the Llama-style
# files then differ by up to 6.5e-4 (tiny-llama; 4.6e-4 tiny-mistral-q4km; 6.1e-6 through XLA's
# float dots), tiny-gemma3 by 3.7e-3 (3.3e-3), so the tolerance is this, or the architecture's own
# where that is larger.
NATIVE_TOLERANCE = 1e-3
QUANTIZED_TOLERANCE = 0.5
NEAR_TIE = 2 * QUANTIZED_TOLERANCE
# A canonical kernel and the GGUF tensor of each of its layers.
KERNEL_TENSORS = {"layers/attn/q/kernel": "attn_q", "layers/attn/k/kernel": "attn_k",
                  "layers/attn/v/kernel": "attn_v", "layers/attn/o/kernel": "attn_output",
                  "layers/mlp/gate/kernel": "ffn_gate", "layers/mlp/up/kernel": "ffn_up",
                  "layers/mlp/down/kernel": "ffn_down"}


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))


def _runner(model, cases, page_size: int = 16, *, native_kernels: bool | None = None
            ) -> ModelRunner:
    """A runner with room for every case at once, each in its own pages."""
    longest = max(len(c["prompt_ids"]) + len(c["greedy_ids"]) for c in cases)
    pages = -(-longest // page_size)
    return ModelRunner(model, RunnerConfig(
        num_pages=1 + pages * len(cases), page_size=page_size, max_num_seqs=len(cases),
        max_num_batched_tokens=128, max_pages_per_seq=pages, native_kernels=native_kernels))


def teacher_forced(runner: ModelRunner, cases) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each case's prompt + llama.cpp's continuation as one prefill step with targets: per
    case, the logprob of every next token and the argmax at every position."""
    sequences = [c["prompt_ids"] + c["greedy_ids"] for c in cases]
    per_row = runner.config.max_pages_per_seq
    rows = [(s[:-1], 0, list(range(1 + i * per_row, 1 + (i + 1) * per_row)))
            for i, s in enumerate(sequences)]
    plan = sub_batch_from_rows(rows, page_size=runner.config.page_size,
                               targets=[s[1:] for s in sequences])
    (out,) = runner.run_step([plan])
    return [(out.prompt_logprobs[i, :len(s) - 1], out.prompt_top_ids[i, :len(s) - 1, 0])
            for i, s in enumerate(sequences)]


def _assert_greedy(where: str, tokens, want: list[int], margins: list[float],
                   near_tie: float) -> None:
    for step, (got, wanted) in enumerate(zip(tokens, want)):
        if got != wanted:
            assert margins[step] < near_tie, (
                f"{where}: token {step} is {got}, llama.cpp chose {wanted} with a top-2 margin "
                f"of {margins[step]:.2e} (a near-tie is under {near_tie})")
            return  # a near-tie broken the other way: later tokens are not comparable


def check_against_llama_cpp(model, fixture: dict, *, f32_tolerance: float,
                            run_greedy: bool = True, native_kernels: bool | None = None
                            ) -> dict[str, float]:
    """The checks of the module docstring; returns the largest logprob differences seen."""
    cases = fixture["cases"]
    runner = _runner(model, cases, native_kernels=native_kernels)
    worst = {"f32": 0.0, "quantized": 0.0}
    for case, (logprobs, argmax) in zip(cases, teacher_forced(runner, cases)):
        where = f"{fixture['name']} {case['text']!r}"
        worst["f32"] = max(worst["f32"], np.abs(logprobs - case["logprobs_f32"]).max())
        worst["quantized"] = max(worst["quantized"], np.abs(logprobs - case["logprobs"]).max())
        np.testing.assert_allclose(logprobs, case["logprobs_f32"], rtol=0, atol=f32_tolerance,
                                   err_msg=f"{where}: against llama.cpp on F32 weights")
        np.testing.assert_allclose(logprobs, case["logprobs"], rtol=0, atol=QUANTIZED_TOLERANCE,
                                   err_msg=f"{where}: against llama.cpp's quantized dots")
        _assert_greedy(f"{where} (teacher-forced argmax)",
                       argmax[len(case["prompt_ids"]) - 1:].tolist(), case["greedy_ids"],
                       case["top2_margin"], NEAR_TIE)
    if run_greedy:
        rows = generate_greedy(runner, [c["prompt_ids"] for c in cases],
                               max_new_tokens=fixture["num_new_tokens"])
        for case, row in zip(cases, rows):
            where = f"{fixture['name']} {case['text']!r} (greedy)"
            _assert_greedy(where, row.token_ids, case["greedy_ids"], case["top2_margin"],
                           NEAR_TIE)
            _assert_greedy(f"{where} on F32 weights", row.token_ids, case["greedy_ids_f32"],
                           case["top2_margin_f32"], 2 * f32_tolerance)
    return worst


@pytest.mark.parametrize("scheme", ["auto", "none", "native"])
@pytest.mark.parametrize("name", TINY)
def test_a_tiny_gguf_matches_llama_cpp(name, scheme):
    """`auto` and `none` through XLA's float dots (every block decoder held to the F32 copy);
    `native`, the blocks as the engine keeps and multiplies them where native kernels run."""
    from meshserve.model import native_dot

    native = scheme == "native"
    if native and not native_dot.resolve(None):
        pytest.skip("native kernels do not run here")
    fixture = _fixture(name)
    path = FIXTURES / fixture["file"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == fixture["file_sha256"]
    pretrained = load_pretrained(str(path), quantization="auto" if native else scheme,
                                 native_kernels=native)
    for case in fixture["cases"]:
        assert pretrained.tokenizer.encode(case["text"]) == case["prompt_ids"], case["text"]
    arch = gguf.GGUFReader(str(path)).fields["general.architecture"].contents()
    tolerance = max(F32_TOLERANCE[arch], NATIVE_TOLERANCE) if native else F32_TOLERANCE[arch]
    worst = check_against_llama_cpp(pretrained.model, fixture, f32_tolerance=tolerance,
                                    run_greedy=scheme != "none", native_kernels=native)
    print(f"{name} {scheme}: max |logprob difference| {worst['f32']:.2e} against llama.cpp on "
          f"F32 weights, {worst['quantized']:.2e} against its quantized dots")


def test_the_tiny_files_hold_every_block_type_and_auto_keeps_them():
    """Every GGUF type meshserve reads is in some tiny file, there are stacked kernels whose
    layers differ in type, and `auto` keeps each kernel the file quantizes quantized."""
    seen, mixed = set(), set()
    for name in TINY:
        path = FIXTURES / f"{name}.gguf"
        types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
        seen |= set(types.values())
        model = load_pretrained(str(path), quantization="auto").model
        kept = set(quantized_arrays(model))
        for key, tensor in KERNEL_TENSORS.items():
            layers = {qtype for n, qtype in types.items() if n.endswith(f".{tensor}.weight")}
            if len(layers) > 1:
                mixed.add(f"{name} {tensor}: {sorted(t.name for t in layers)}")
            assert (key in kept) == bool(layers & set(BLOCK_TYPES)), (name, key)
    assert seen >= {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                    *BLOCK_TYPES}, sorted(t.name for t in seen)
    assert len(mixed) >= 3, mixed  # Q4_K with Q6_K (hand-made and llama.cpp's), Q5_0 with Q8_0


@pytest.mark.slow
def test_gemma_3_270m_matches_llama_cpp():
    """The real Gemma 3 270M Q4_K_M under `auto`, as the engine serves it by default."""
    from meshserve.model.loading.hub import resolve_model

    fixture = _fixture("gemma-3-270m")
    files = resolve_model("gemma-3-270m")
    pretrained = load_pretrained(str(files.path), quantization="auto")
    for case in fixture["cases"]:
        assert pretrained.tokenizer.encode(case["text"]) == case["prompt_ids"], case["text"]
    worst = check_against_llama_cpp(pretrained.model, fixture,
                                    f32_tolerance=F32_TOLERANCE["gemma3"])
    print(f"gemma-3-270m auto: max |logprob difference| {worst['f32']:.2e} against llama.cpp "
          f"on F32 weights, {worst['quantized']:.2e} against its quantized dots")


def test_the_tiny_fixtures_are_llama_cpps_current_output(monkeypatch):
    """llama.cpp re-run on the committed tiny files gives the committed fixtures (its tokens
    exactly, its logprobs to within what another CPU's summation order may change)."""
    pytest.importorskip("llama_cpp")
    spec = importlib.util.spec_from_file_location(
        "make_gguf_llama_golden", ROOT / "scripts" / "make_gguf_llama_golden.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclasses look it up there
    spec.loader.exec_module(script)
    for name in TINY:
        want = _fixture(name)
        got = script.fixture(FIXTURES / want["file"], script.PROMPTS, name=name,
                             file=want["file"])
        assert got["file_sha256"] == want["file_sha256"], name
        for got_case, want_case in zip(got["cases"], want["cases"], strict=True):
            assert got_case["prompt_ids"] == want_case["prompt_ids"], name
            assert got_case["greedy_ids"] == want_case["greedy_ids"], name
            assert got_case["greedy_ids_f32"] == want_case["greedy_ids_f32"], name
            for key in ("logprobs", "logprobs_f32", "top2_margin", "top2_margin_f32"):
                np.testing.assert_allclose(got_case[key], want_case[key], rtol=0, atol=1e-3,
                                           err_msg=f"{name} {key}")
