"""meshserve against HF transformers, through the golden files of scripts/make_golden.py.

- Tiny random Llama, Llama-3-RoPE, Qwen2, GPT-2, Qwen3, Gemma 2, Gemma 3 and Phi-3 models saved by
  `save_pretrained`: logits of the dense path and of the paged path (prefill, then decode one
  token at a time) within 1e-4. The dense families' greedy tokens, batched, prefix-cached and on
  a TP mesh, are in tests/serving/test_families.py.
- SmolLM2-135M-Instruct from its GGUF: greedy tokens equal, and each step's logprob within 2e-3.
  A token may differ only where HF's top-2 margin is under 1e-3; the rest is then not compared.
- The same in bfloat16, on a GPU only (bf16 on the CPU is slow and not what it serves): logprobs
  within 0.25, and a token may differ only where HF's top-2 margin is under 0.25. bf16 keeps 8
  bits of mantissa, so a logit of about 20 is off by up to about 0.1 per rounding; 30 layers of
  such roundings move a margin by a few tenths at most on these prompts.
"""

import json

import numpy as np
import pytest

from meshserve.model.executor.runner import ModelRunner, RunnerConfig
from meshserve.model.loading import load_hf
from meshserve.model.transformer import model_from_params
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.greedy_reference import generate_greedy
from tests.model.paged import PagedStepper

TINY_MODELS = ["tiny-llama", "tiny-llama3-rope", "tiny-qwen2", "tiny-gpt2",
               "tiny-qwen3", "tiny-gemma2", "tiny-gemma3", "tiny-phi3"]


@pytest.fixture(scope="module", params=TINY_MODELS)
def tiny(request, golden_dir):
    directory = golden_dir / request.param
    config, params = load_hf(directory)
    reference = np.load(directory / "logits.npz")
    input_ids = reference["input_ids"]
    # Phi-3's LongRoPE: HF takes the long factors for these 20 tokens, past its original 16.
    config = config.for_context(input_ids.shape[1])
    return model_from_params(config, params), input_ids, reference["logits"]


def test_tiny_dense_logits_match_hf(tiny):
    model, input_ids, want = tiny
    stepper = PagedStepper(model, page_size=4, num_pages=4)
    np.testing.assert_allclose(stepper.dense(input_ids), want, atol=1e-4, rtol=1e-4)


def test_tiny_paged_logits_match_hf(tiny):
    model, input_ids, want = tiny
    rows, length = input_ids.shape
    page_size, prompt = 4, 9
    stepper = PagedStepper(model, page_size=page_size, num_pages=1 + rows * length // page_size)
    pages = [list(range(1 + r, 1 + rows * length // page_size, rows)) for r in range(rows)]
    (out,) = stepper.run(([(input_ids[r, :prompt], 0, pages[r]) for r in range(rows)], None))
    np.testing.assert_allclose(out.logits[:rows], want[:, prompt - 1], atol=1e-4, rtol=1e-4)
    for pos in range(prompt, length):
        (out,) = stepper.run(([(input_ids[r, pos:pos + 1], pos, pages[r]) for r in range(rows)],
                              None))
        np.testing.assert_allclose(out.logits[:rows], want[:, pos], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def smollm2_golden(golden_dir):
    return json.loads((golden_dir / "smollm2.json").read_text())


def _smollm2_kept_blocks(smollm2_files, scheme: str, bits: set[int],
                         native_kernels: bool = False):
    """SmolLM2 with its Q4_1 kernels kept as quantized blocks
    (`meshserve.model.quantized_kernel`), where `smollm2_pretrained` dequantizes them to
    float32."""
    from meshserve.model.loading.pretrained import load_pretrained
    from meshserve.model.quantized_weights import quantized_arrays

    model = load_pretrained(str(smollm2_files.path), quantization=scheme,
                            native_kernels=native_kernels).model
    assert {q.format.bits for q in quantized_arrays(model).values()} == bits, scheme
    return model


@pytest.fixture(scope="module")
def smollm2_native_blocks(smollm2_files):
    """As the engine loads it by default where native kernels run: `auto` keeps the file's Q4_1
    blocks packed in 4 bits (float16 scales and minimums), which the native packed kernel reads
    (with AVX-512 VNNI, x rounded to 16 bits per group into integer dots), and its tied Q8_0
    table in 8 for the native table head."""
    from meshserve.model import native_dot

    if not native_dot.resolve(None):
        pytest.skip("native kernels do not run here")
    return _smollm2_kept_blocks(smollm2_files, EngineConfig().quantization, {4, 8},
                                native_kernels=True)


@pytest.fixture(scope="module")
def smollm2_int4(smollm2_files):
    """As `auto` keeps them on a GPU: int4, a scale and a minimum per 32 weights."""
    return _smollm2_kept_blocks(smollm2_files, "int4", {4})


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["float32", "native blocks", "int4"])
def test_smollm2_greedy_matches_hf(weights, request, smollm2_golden):
    """The float32 weights, the engine's default on the CPU (`auto` with native kernels: the
    file's 4-bit blocks) and int4 kernels (`auto` on a GPU). `auto` without native kernels (int8
    containers, where no compiler builds them) holds the same codes exactly in 8 bits
    (tests/model/test_quant.py), so it computes the float32 case's function."""
    fixture = {"float32": "smollm2_pretrained", "native blocks": "smollm2_native_blocks",
               "int4": "smollm2_int4"}[weights]
    model = request.getfixturevalue(fixture)
    if weights == "float32":
        model = model.model
    cases = smollm2_golden["cases"]
    num_new = smollm2_golden["num_new_tokens"]
    assert len(cases) >= 6 and max(len(c["prompt_ids"]) for c in cases) > 1000
    runner = ModelRunner(model, RunnerConfig(
        num_pages=160, page_size=16, max_num_seqs=len(cases), max_num_batched_tokens=512,
        max_pages_per_seq=96))
    rows = generate_greedy(runner, [c["prompt_ids"] for c in cases], max_new_tokens=num_new)
    for case, row in zip(cases, rows):
        _assert_matches(case, row.token_ids, row.logprobs)


@pytest.mark.slow
def test_smollm2_bfloat16_tracks_hf(smollm2_files, smollm2_golden):
    import jax

    from meshserve.model.loading.pretrained import load_pretrained

    if jax.default_backend() != "gpu":
        pytest.skip("bfloat16 parity runs on a GPU (scripts/gpu_check.sh); the CPU serves f32")
    cases = smollm2_golden["cases"]
    model = load_pretrained(str(smollm2_files.path), dtype="bfloat16").model
    runner = ModelRunner(model, RunnerConfig(
        num_pages=160, page_size=16, max_num_seqs=len(cases), max_num_batched_tokens=512,
        max_pages_per_seq=96))
    rows = generate_greedy(runner, [c["prompt_ids"] for c in cases],
                           max_new_tokens=smollm2_golden["num_new_tokens"])
    for case, row in zip(cases, rows):
        _assert_matches(case, row.token_ids, row.logprobs, margin=0.25, tolerance=0.25)


def _assert_matches(case, tokens, logprobs, *, margin=1e-3, tolerance=2e-3):
    for step, (got, want) in enumerate(zip(tokens, case["greedy_ids"])):
        if got != want:
            assert case["top2_margin"][step] < margin, (
                f"{case['name']}: token {step} is {got}, HF chose {want} with a top-2 margin of "
                f"{case['top2_margin'][step]:.2e}")
            return  # a near-tie was broken the other way; later tokens are not comparable
        assert abs(logprobs[step] - case["greedy_logprobs"][step]) < tolerance, (
            case["name"], step, logprobs[step], case["greedy_logprobs"][step])


def test_smollm2_prompt_ids_match_hf(smollm2_golden, smollm2_files):
    from meshserve.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(smollm2_files.path)
    add_special = smollm2_golden["add_special_tokens"]
    for case in smollm2_golden["cases"]:
        assert tokenizer.encode(case["text"], add_special_tokens=add_special) == case["prompt_ids"]
