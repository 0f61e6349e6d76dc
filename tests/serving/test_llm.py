"""`meshserve.LLM`, the batch API: the lazy import root, prompt and parameter forms, output order.

The fast tests use the tiny random Llama preset (token-id prompts, no tokenizer); the slow ones
load the real SmolLM2-135M-Instruct for chat and text prompts.
"""

import json
import subprocess
import sys

import pytest

from meshserve.serving.python_api.llm import LLM as EngineLLM
from tests.serving.served import SMOL

# tests/serving/test_engine.py's shapes: its programs, compiled once a session.
SMALL = dict(num_pages=64, page_size=16, max_num_seqs=4, max_num_batched_tokens=32,
             prefill_chunk=16, max_model_len=128, max_logprobs=5, warmup=False,
             compilation_cache=False)
PROMPTS = [[5, 6, 7], list(range(10, 40)), [9]]  # the second one is prefilled in two chunks


def test_root_exports_load_on_first_use():
    import meshserve
    from meshserve import LLM, EngineConfig, SamplingParams
    from meshserve.batching.sampling import SamplingParams as BatchingSamplingParams
    from meshserve.serving.engine.engine_config import EngineConfig as ServingEngineConfig

    assert (LLM, SamplingParams, EngineConfig) == (EngineLLM, BatchingSamplingParams,
                                                   ServingEngineConfig)
    with pytest.raises(AttributeError, match="no attribute 'Engine'"):
        meshserve.Engine  # noqa: B018


def test_batching_imports_without_jax():
    code = ("import importlib, pkgutil, sys\n"
            "import meshserve, meshserve.batching as batching\n"
            "for module in pkgutil.iter_modules(batching.__path__):\n"
            "    importlib.import_module('meshserve.batching.' + module.name)\n"
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)\n"
            "print(len([m for m in sys.modules if m.startswith('meshserve.batching.')]))\n")
    result = subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                            capture_output=True, text=True)
    assert int(result.stdout) >= 6  # buckets, pages, plan, request, sampling, scheduler


@pytest.fixture(scope="module")
def llm():
    from meshserve import LLM

    return LLM("tiny-llama", **SMALL)


def _greedy(max_tokens: int):
    from meshserve import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_generate_returns_outputs_in_prompt_order(llm):
    outputs = llm.generate(PROMPTS, _greedy(6), use_tqdm=False)
    assert [out.prompt_token_ids for out in outputs] == PROMPTS
    assert len({out.request_id for out in outputs}) == len(PROMPTS)
    for out in outputs:
        assert out.finished and out.prompt is None
        assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"
    assert not llm.engine.has_unfinished()


def test_one_token_list_is_one_prompt(llm):
    together = llm.generate(PROMPTS, _greedy(6), use_tqdm=False)
    (alone,) = llm.generate(PROMPTS[1], _greedy(6), use_tqdm=False)
    assert alone.prompt_token_ids == PROMPTS[1]
    assert alone.outputs[0].token_ids == together[1].outputs[0].token_ids


def test_sampling_params_per_prompt(llm):
    outputs = llm.generate(PROMPTS, [_greedy(2), _greedy(7), _greedy(4)], use_tqdm=False)
    assert [len(out.outputs[0].token_ids) for out in outputs] == [2, 7, 4]


def test_sampling_params_list_must_match_the_prompts(llm):
    with pytest.raises(ValueError, match="got 2 sampling_params for 3 prompts"):
        llm.generate(PROMPTS, [_greedy(2), _greedy(3)], use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_no_prompts_is_an_error(llm):
    with pytest.raises(ValueError, match="at least one prompt"):
        llm.generate([], use_tqdm=False)


def test_text_prompts_need_a_tokenizer(llm):
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("Hello", use_tqdm=False)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)


def test_a_rejected_prompt_leaves_nothing_queued(llm):
    """generate() either runs all its prompts or none: a bad prompt after good ones fails the call
    without leaving the good ones in the engine, to run during some later call."""
    try:
        with pytest.raises(ValueError, match="no tokenizer"):
            llm.generate([[5, 6], "Hello"], use_tqdm=False)
        assert not llm.engine.has_unfinished()
    finally:
        llm.engine.shutdown()


def test_bad_engine_option_fails_before_loading():
    from meshserve import LLM

    with pytest.raises(ValueError, match="policy must be one of"):
        LLM("no-such-model", **(SMALL | dict(policy="fifo")))
    with pytest.raises(TypeError, match="max_batch"):
        LLM("tiny-llama", max_batch=4)


@pytest.fixture(scope="module")
def smol_llm(smollm2_files):
    from meshserve import LLM

    return LLM(str(smollm2_files.path), **SMOL)


@pytest.mark.slow
def test_smollm2_chat_knows_the_capital_of_france(smol_llm):
    from meshserve import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=16)
    (out,) = smol_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           greedy, use_tqdm=False)
    assert "Paris" in out.outputs[0].text
    assert out.prompt.endswith("<|im_start|>assistant\n")
    prompt = "The capital of France is"
    (echo,) = smol_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4),
                                use_tqdm=False)
    assert echo.prompt == prompt
    assert echo.prompt_token_ids == smol_llm.tokenizer.encode(prompt, add_special_tokens=True)
    assert echo.outputs[0].text and len(echo.outputs[0].token_ids) == 4


WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "The weather in a city.",
                                           "parameters": WEATHER}}]


@pytest.mark.slow
def test_smollm2_chat_takes_tools_and_response_format_as_the_http_api_does(smol_llm):
    """The same fields, read by the same code: SmolLM2's chat template declares no tools, so
    "required" constrains the output to a call, and "auto" is refused."""
    import jsonschema
    from meshserve import SamplingParams

    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    greedy = SamplingParams(temperature=0, max_tokens=48)
    (out,) = smol_llm.chat(ask, greedy, tools=TOOLS, tool_choice="required", use_tqdm=False)
    completion = out.outputs[0]
    assert completion.finish_reason == "tool_calls" and "You can call" in out.prompt
    (call,) = completion.tool_calls
    assert call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    assert completion.message == {"role": "assistant", "content": None, "tool_calls": [call]}
    with pytest.raises(ValueError, match="tool_choice 'auto'"):
        smol_llm.chat(ask, greedy, tools=TOOLS, use_tqdm=False)
    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"], "additionalProperties": False}
    (out,) = smol_llm.chat(ask, greedy, use_tqdm=False, response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": city}})
    jsonschema.validate(json.loads(out.outputs[0].text), city)
    assert out.outputs[0].message is None and out.outputs[0].tool_calls == []
