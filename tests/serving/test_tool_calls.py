"""tool_choice "auto" and the model's own tool-call format (serving/openai_api/tool_calls.py).

No tool-calling model can be fetched here, so the model is a scripted runner that writes a given
token sequence whatever the prompt, under a real byte-level tokenizer (tests/serving/
tiny_tokenizer.py with Qwen's or Llama 3's tokens added) and a Hermes-style or Llama-3-style chat
template written for these tests. Everything else is real: the template renders the tools, the engine enforces the
llguidance grammar on every token the script writes (a call off its schema ends
"unsatisfiable"), and the official `openai` client reads the answers from a server on
127.0.0.1. Also: the parser alone (streamed and whole agree at every split), the grammar's masks,
which templates declare tools, streamed logprobs and token ids on every way a chat answer streams
(a template without tools too, where "required" and a named function constrain the output), and
the keys the objects in response_format, tools and tool_choice take.
"""

import json
import random

import numpy as np
import pytest
from tokenizers import AddedToken

from meshserve.batching.structured import StructuredOutput
from meshserve.model.tokenizer import SpecialTokens, Tokenizer, end_token_ids
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.core import Engine
from meshserve.serving.engine.grammar import GrammarCompiler
from meshserve.serving.grpc_api.server import GenerationServer, ServerConfig
from meshserve.serving.openai_api.tool_calls import FORMATS, CallParser, chat_tools
from tests.serving.fake_runner import MODEL, FakeModelRunner
from tests.serving.tiny_tokenizer import EOS_ID, tiny_tokenizer

openai = pytest.importorskip("openai")

HERMES, LLAMA = FORMATS
# A Hermes-style template (Qwen's layout): the tools in the system turn, calls as <tool_call>
# blocks, tool results as <tool_response> in a user turn.
TEMPLATE = """{%- if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}Functions you may call, one JSON signature a line:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call one, write <tool_call>
{"name": <its name>, "arguments": <its arguments>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls or [] %}
{% if message.content or not loop.first %}
{% endif %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role != 'system' or not loop.first %}
<|im_start|>{{ message.role }}{{ ' (' ~ message.name ~ ')' if message.name }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
NO_TOOLS = """{% for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}{% if tools %}{% endif %}<|im_start|>assistant
"""
# A Llama-3-style template: the tools in the first turn, a call is the whole answer.
LLAMA_TEMPLATE = """{%- for message in messages %}
<|start_header_id|>{{ 'ipython' if message.role == 'tool' else message.role }}<|end_header_id|>

{% if tools and loop.first %}Tools, one JSON signature a line:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}To call one, answer {"name": its name, "parameters": its arguments} alone (builtin
tools after <|python_tag|>).

{% endif %}
{%- for call in message.tool_calls or [] %}{"name": "{{ call.function.name }}", "parameters": \
{{ call.function.arguments | tojson }}}{% endfor %}{{ message.content }}
{{- '<|eom_id|>' if message.tool_calls and builtin_tools is defined else '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time.",
                                           "parameters": {"type": "object", "properties": {}}}}]
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
OSLO = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def hermes_tokenizer(template: str = TEMPLATE, *, special_markers: bool = False) -> Tokenizer:
    """The tiny byte-level tokenizer with Qwen's turn tokens (special), and its tool-call
    markers and `<think>` (added, kept in the text as Qwen's are; the markers special with
    `special_markers`)."""
    backend = tiny_tokenizer()._backend
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in ("<|im_start|>", "<|im_end|>")])
    backend.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    markers = [AddedToken(t, special=special_markers, normalized=False)
               for t in ("<tool_call>", "</tool_call>")]
    if special_markers:
        backend.add_special_tokens(markers)
    else:
        backend.add_tokens(markers)
    end_of_turn = backend.token_to_id("<|im_end|>")
    return Tokenizer(backend, special=SpecialTokens(bos_token_id=None,
                                                    eos_token_ids=(EOS_ID, end_of_turn),
                                                    pad_token_id=0), chat_template=template)


def llama_tokenizer() -> Tokenizer:
    """The tiny byte-level tokenizer with Llama 3's header, turn, message and python-tag tokens;
    its end ids found in the template as a loaded tokenizer's are."""
    backend = tiny_tokenizer()._backend
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (
        "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
        "<|python_tag|>")])
    return Tokenizer(backend, special=SpecialTokens(
        bos_token_id=None, eos_token_ids=end_token_ids(backend, [EOS_ID], LLAMA_TEMPLATE),
        pad_token_id=0), chat_template=LLAMA_TEMPLATE)


def _stream(text: str, sizes, fmt=None) -> tuple[str, list[dict], CallParser]:
    parser = CallParser(fmt or HERMES)
    content, deltas, at = [], [], 0
    for size in sizes:
        piece_content, piece_deltas = parser.add(text[at:at + size])
        content.append(piece_content)
        deltas += piece_deltas
        at += size
    assert at >= len(text)
    end_content, end_deltas = parser.finish()
    return "".join(content) + end_content, deltas + end_deltas, parser


def _joined(deltas: list[dict]) -> list[tuple[str, str]]:
    """(name, arguments) per call index, from OpenAI's deltas."""
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        if "id" in delta:
            assert delta["index"] not in calls and delta["id"].startswith("call_")
            calls[delta["index"]] = [delta["function"]["name"], ""]
        calls[delta["index"]][1] += delta["function"]["arguments"]
    return [tuple(calls[i]) for i in sorted(calls)]


# -- the parser --------------------------------------------------------------------------------

OUTPUTS = {
    "text only": ("Sunny, 18 C.\n", "Sunny, 18 C.\n", []),
    "text then a call": (f"Let me look.\n<tool_call>\n{PARIS}\n</tool_call>", "Let me look.",
                         [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    "two calls and text": (f"<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{OSLO}\n"
                           "</tool_call>\nBoth asked.", "Both asked.",
                           [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                            ("get_weather", '{"city": "Oslo", "unit": "celsius"}')]),
    "arguments first": ('<tool_call>\n{"arguments": {"q": "}"}, "name": "find"}\n</tool_call>',
                        "", [("find", '{"q": "}"}')]),
    "nested braces": ('<tool_call>\n{"name": "f", "arguments": {"a": {"b": {}}, "c": "}\\n"}}'
                      "\n</tool_call>", "", [("f", '{"a": {"b": {}}, "c": "}\\n"}')]),
    "not a call": ("So \n<tool_call>\nnot JSON\n</tool_call> then text",
                   "So \n<tool_call>\nnot JSON\n</tool_call> then text", []),
    "a marker begun, never finished": ("Use <tool_ca", "Use <tool_ca", []),
    "a lone less-than": ("a < b and c <\n", "a < b and c <\n", []),
    "cut off in the arguments": ('Hm <tool_call>\n{"name": "f", "arguments": {"a": "xy',
                                 "Hm", [("f", '{"a": "xy')]),
    "complete but for the end marker": (f"<tool_call>\n{PARIS}", "",
                                        [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    "cut off in the head": ('<tool_call>\n{"name": "f", "argu', '<tool_call>\n{"name": "f", "argu',
                            []),
}


# A bare format's output: one call, or text (<|python_tag|> is special: not in the text).
BARE_OUTPUTS = {
    "text": ("It is sunny. {not a call}", "It is sunny. {not a call}", []),
    "a call": ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
               "", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    "a call after whitespace": ('\n {"name": "f", "parameters": {}}', "", [("f", "{}")]),
    "braces, not a call": ("{not JSON}", "{not JSON}", []),
    "cut off": ('{"name": "f", "parameters": {"a": [1, 2', "", [("f", '{"a": [1, 2')]),
}
CASES = [(HERMES, name) for name in OUTPUTS] + [(LLAMA, name) for name in BARE_OUTPUTS]


def _case(fmt, name):
    return (OUTPUTS if fmt is HERMES else BARE_OUTPUTS)[name]


@pytest.mark.parametrize("fmt,name", CASES)
def test_whole_outputs_give_content_and_calls(fmt, name):
    text, content, calls = _case(fmt, name)
    parser = CallParser(fmt)
    assert parser.read_whole(text) == (content if content or not calls else None)
    assert [(c.name, c.arguments) for c in parser.calls] == calls
    assert all(json.loads(c.arguments) is not None for c in parser.calls if c.is_complete)


@pytest.mark.parametrize("fmt,name", CASES)
def test_streamed_pieces_agree_with_the_whole_at_every_split(fmt, name):
    text, content, calls = _case(fmt, name)
    rng = random.Random(0)
    splits = [[1] * len(text), [2] * len(text), [len(text)]]
    splits += [[rng.randint(1, 9) for _ in text] for _ in range(20)]
    for sizes in splits:
        streamed, deltas, parser = _stream(text, sizes, fmt)
        assert streamed == content and _joined(deltas) == calls, sizes
        assert [c.is_complete for c in parser.calls] == [
            c.is_complete for c in _stream(text, [len(text)], fmt)[2].calls]


def test_markers_never_reach_the_content_and_arguments_come_in_pieces():
    text = f"Let me look.\n<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{OSLO}\n</tool_call>"
    parser = CallParser(HERMES)
    pieces = [parser.add(ch) for ch in text] + [parser.finish()]
    assert all(len({d["index"] for d in ds}) == len(ds) for _, ds in pieces)  # one per call
    contents = [c for c, _ in pieces if c]
    assert "".join(contents) == "Let me look." and not any("<" in c for c in contents)
    argument_pieces = [d for _, ds in pieces for d in ds if "id" not in d]
    assert len(argument_pieces) > 10 and {d["index"] for d in argument_pieces} == {0, 1}
    assert parser.is_complete


def test_a_cut_off_call_is_not_complete():
    parser = CallParser(HERMES)
    parser.read_whole('<tool_call>\n{"name": "f", "arguments": {"a": 1')
    assert [c.arguments for c in parser.calls] == ['{"a": 1'] and not parser.is_complete


# -- the grammar ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    return hermes_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer.to_json(), vocab_size=512,
                           eos_token_ids=tokenizer.eos_token_ids)


@pytest.fixture(scope="module")
def llama():
    return llama_tokenizer()


def _grammar(tokenizer, *, is_required=False, is_parallel=True) -> StructuredOutput:
    tools = [(t["function"]["name"], t["function"]["parameters"]) for t in TOOLS]
    return StructuredOutput(grammar=chat_tools(tokenizer).grammar(
        tools, is_required=is_required, is_parallel=is_parallel))


def _advance(matcher, ids) -> bool:
    return all(matcher.advance(t) for t in ids)


def _allowed(matcher) -> set[int]:
    mask = np.zeros(512 // 32, np.int32)
    matcher.fill_mask(mask)
    return {t for t in range(512) if (int(mask[t // 32]) >> (t % 32)) & 1}


def _bytes(tokenizer, text: str) -> list[int]:
    """`text` one byte-level symbol a token (ASCII only): a marker the model spells out."""
    return [tokenizer.token_to_id(ch) for ch in text]


def test_text_is_free_and_a_call_follows_its_tools_schema(tokenizer, compiler):
    auto = _grammar(tokenizer)
    matcher = compiler.matcher(auto)
    assert _advance(matcher, tokenizer.encode("<think>Any text, even {.<think>"))
    assert EOS_ID in _allowed(matcher)
    for call, is_valid in [(PARIS, True), ('{"name": "get_time", "arguments": {}}', True),
                           ('{"name": "get_weather", "arguments": {"town": "Paris"}}', False),
                           ('{"name": "get_weather", "arguments": {"city": "Paris"}}', False),
                           ('{"name": "get_news", "arguments": {}}', False),
                           ('{"name":"get_time","arguments":{}}', False)]:
        matcher = compiler.matcher(auto)
        ids = tokenizer.encode(f"So: <tool_call>\n{call}\n</tool_call> done")
        assert _advance(matcher, ids) == is_valid, call
    for opening in (tokenizer.encode("<tool_call>"), _bytes(tokenizer, "<tool_call>")):
        matcher = compiler.matcher(auto)
        assert _advance(matcher, tokenizer.encode("x ") + opening + tokenizer.encode("\n"))
        assert _allowed(matcher) == {tokenizer.token_to_id("{")}


def test_required_needs_a_call_and_one_call_ends_the_output(tokenizer, compiler):
    matcher = compiler.matcher(_grammar(tokenizer, is_required=True))
    assert _advance(matcher, tokenizer.encode("Thinking first."))
    assert EOS_ID not in _allowed(matcher)
    assert _advance(matcher, tokenizer.encode(f"<tool_call>\n{PARIS}\n</tool_call>"))
    assert EOS_ID in _allowed(matcher)
    single = compiler.matcher(_grammar(tokenizer, is_parallel=False))
    assert _advance(single, tokenizer.encode(f"<tool_call>\n{PARIS}\n</tool_call>"))
    assert single.is_stopped()


def test_a_bare_call_is_the_whole_answer_or_there_is_none(llama):
    compiler = GrammarCompiler(llama.to_json(), vocab_size=512, eos_token_ids=llama.eos_token_ids)
    auto, required = _grammar(llama), _grammar(llama, is_required=True)
    tag = llama.token_to_id("<|python_tag|>")
    call = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
    for grammar, ids, is_valid in [
            (auto, llama.encode("Sunny. {braces} later are text."), True),
            (auto, llama.encode(call), True), (auto, [tag] + llama.encode(call), True),
            (auto, llama.encode(call.replace("city", "town")), False),
            (auto, llama.encode('{"text": 1}'), False),
            (required, llama.encode("Sunny."), False), (required, llama.encode(call), True)]:
        matcher = compiler.matcher(grammar)
        assert _advance(matcher, ids) == is_valid, llama.decode(ids)
    matcher = compiler.matcher(auto)
    assert _advance(matcher, llama.encode(call)) and _allowed(matcher) == set(
        llama.eos_token_ids)


# -- which templates declare tools ---------------------------------------------------------------

def test_the_template_decides_whether_tools_are_served():
    assert hermes_tokenizer().renders_tools and chat_tools(hermes_tokenizer()).format is HERMES
    plain = hermes_tokenizer(NO_TOOLS)  # mentions tools, shows the model none
    assert not plain.renders_tools
    assert "needs a chat template that declares tools, and this model's does not" in \
        chat_tools(plain).refusal
    assert "has no chat template" in chat_tools(None).refusal
    mistral = TEMPLATE.replace("<tool_call>", "[TOOL_CALLS]").replace("</tool_call>", "")
    assert "Mistral's [TOOL_CALLS], which meshserve does not read" in \
        chat_tools(hermes_tokenizer(mistral)).refusal
    assert chat_tools(llama_tokenizer()).format is LLAMA
    hidden = chat_tools(hermes_tokenizer(special_markers=True))
    assert hidden.format is None and "<tool_call> is a special token" in hidden.refusal


# -- served, with the openai client ----------------------------------------------------------------

class ScriptedRunner(FakeModelRunner):
    """Samples `script[i]` as every request's i-th output token (then EOS), whatever the
    prompt: the stand-in for a model that writes tool calls."""

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.model_config = MODEL.__class__(**(vars(MODEL) | {"name": "scripted",
                                                              "vocab_size": 512}))
        self.config = config.for_model(self.model_config).runner_config()
        self.script: list[int] = []

    def execute(self, plan):
        self.num_executed += 1
        return [self._rows(np.array([self._token(int(step)) for step in sampling.steps],
                                    np.int32)) for sampling in plan.sampling]

    def _token(self, step: int) -> int:
        return self.script[step] if step < len(self.script) else EOS_ID


ENGINE = dict(num_pages=128, page_size=16, max_num_seqs=4, max_num_batched_tokens=256,
              prefill_chunk=256, max_model_len=1024, max_logprobs=3, compilation_cache=False)


def _serve(tokenizer):
    config = EngineConfig(**ENGINE)
    runner = ScriptedRunner(config)
    server = GenerationServer(Engine(runner, tokenizer, config), ServerConfig(port=0, http_port=0))
    server.start()
    with openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none",
                       max_retries=0) as client:
        yield client, runner
    server.stop()


@pytest.fixture(scope="module")
def served(tokenizer):
    yield from _serve(tokenizer)


@pytest.fixture(scope="module")
def served_llama(llama):
    yield from _serve(llama)


def _say(served, tokenizer, *parts) -> None:
    """Scripts the next answers: text parts are tokenized, lists are token ids as they are."""
    served[1].script = [t for part in parts
                        for t in (part if isinstance(part, list) else tokenizer.encode(part))]


def _chat(served, stream=False, **fields):
    return served[0].chat.completions.create(
        model="scripted", messages=fields.pop("messages", ASK), stream=stream,
        max_tokens=fields.pop("max_tokens", 200), tools=fields.pop("tools", TOOLS), **fields)


def _read_stream(chunks) -> tuple[str, list[tuple[str, str]], set[str], str]:
    content, calls, ids, finish = "", {}, set(), None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        assert "<tool" not in (delta.content or "") and "</tool" not in (delta.content or "")
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id:
                ids.add(call.id)
                calls[call.index] = [call.function.name, ""]
            calls[call.index][1] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], ids, finish


def test_auto_answers_content_and_a_call_through_the_template(served, tokenizer):
    _say(served, tokenizer, f"Let me look.\n<tool_call>\n{PARIS}\n</tool_call>")
    done = _chat(served, extra_body={"return_token_ids": True})
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    prompt = tokenizer.decode(done.prompt_token_ids, skip_special_tokens=False)
    assert "<tools>\n" + json.dumps(TOOLS[0]) in prompt  # the template's tools, not ours
    assert "You can call these functions" not in prompt


@pytest.mark.parametrize("markers", ["one token each", "spelled out byte by byte"])
def test_a_streamed_call_is_content_then_openai_tool_call_deltas(served, tokenizer, markers):
    opening, closing = (("<tool_call>", "</tool_call>") if markers == "one token each" else
                        (_bytes(tokenizer, "<tool_call>"), _bytes(tokenizer, "</tool_call>")))
    _say(served, tokenizer, "Let me look.\n", opening, f"\n{PARIS}\n", closing, "\n", opening,
         f"\n{OSLO}\n", closing)
    content, calls, ids, finish = _read_stream(_chat(served, stream=True))
    assert content == "Let me look." and finish == "tool_calls" and len(ids) == 2
    assert calls == [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                     ("get_weather", '{"city": "Oslo", "unit": "celsius"}')]
    done = _chat(served)  # the same output whole
    assert [(c.function.name, c.function.arguments) for c in done.choices[0].message.tool_calls
            ] == calls and done.choices[0].message.content == "Let me look."


def test_text_alone_is_a_plain_answer(served, tokenizer):
    _say(served, tokenizer, "It is sunny in Paris.")
    done = _chat(served)
    assert done.choices[0].message.content == "It is sunny in Paris."
    assert done.choices[0].message.tool_calls is None and done.choices[0].finish_reason == "stop"
    assert _read_stream(_chat(served, stream=True))[:2] == ("It is sunny in Paris.", [])


def test_parallel_tool_calls_false_ends_the_answer_after_one_call(served, tokenizer):
    _say(served, tokenizer, f"<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{OSLO}\n"
                            "</tool_call>")
    done = _chat(served, parallel_tool_calls=False)
    assert done.choices[0].finish_reason == "tool_calls"
    assert [c.function.arguments for c in done.choices[0].message.tool_calls] == [
        '{"city": "Paris", "unit": "celsius"}']


@pytest.mark.parametrize("tool_choice", [
    "auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_call_off_its_schema_is_stopped_by_the_grammar(served, tokenizer, tool_choice):
    _say(served, tokenizer, '<tool_call>\n{"name": "get_weather", "arguments": {"town": "x"}}'
                            "\n</tool_call>")
    done = _chat(served, tool_choice=tool_choice)
    assert done.choices[0].finish_reason == "unsatisfiable"
    _say(served, tokenizer, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    finish = _chat(served, tool_choice=tool_choice).choices[0].finish_reason
    assert finish == ("unsatisfiable" if isinstance(tool_choice, dict) else "tool_calls")


def test_history_tool_calls_go_to_the_template_as_the_model_writes_them(served, tokenizer):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    _say(served, tokenizer, "Sunny, 18 C.")
    done = _chat(served, messages=history, extra_body={"return_token_ids": True})
    assert done.choices[0].message.content == "Sunny, 18 C."
    prompt = tokenizer.decode(done.prompt_token_ids, skip_special_tokens=False)
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in prompt
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt


def test_a_message_s_name_goes_to_the_template(served, tokenizer):
    _say(served, tokenizer, "Hi Ann.")
    done = _chat(served, tools=None, extra_body={"return_token_ids": True}, messages=[
        {"role": "user", "name": "ann", "content": "Hi!"}])
    assert done.choices[0].message.content == "Hi Ann."
    prompt = tokenizer.decode(done.prompt_token_ids, skip_special_tokens=False)
    assert "<|im_start|>user (ann)\nHi!<|im_end|>" in prompt


def test_a_bare_format_answers_a_call_or_text(served_llama, llama):
    call = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
    _say(served_llama, llama, [llama.token_to_id("<|python_tag|>")], call)
    done = _chat(served_llama, extra_body={"return_token_ids": True})
    (made,) = done.choices[0].message.tool_calls
    assert done.choices[0].finish_reason == "tool_calls" and done.choices[0].message.content is None
    assert (made.function.name, made.function.arguments) == (
        "get_weather", '{"city": "Paris", "unit": "celsius"}')
    assert json.dumps(TOOLS[1]) in llama.decode(done.prompt_token_ids)
    content, calls, ids, finish = _read_stream(_chat(served_llama, stream=True))
    assert (content, calls, len(ids), finish) == (
        "", [("get_weather", '{"city": "Paris", "unit": "celsius"}')], 1, "tool_calls")
    _say(served_llama, llama, "Sunny {and warm}.")
    assert _chat(served_llama).choices[0].message.content == "Sunny {and warm}."


def test_llama_3_s_end_of_message_token_ends_a_turn(served_llama, llama):
    """Llama 3.1+ ends a turn that called a tool with <|eom_id|> (its template writes it): it is
    one of the end ids, so it ends the answer, and the tools' grammar lets it."""
    eom = llama.token_to_id("<|eom_id|>")
    assert llama.eos_token_ids == (EOS_ID, llama.token_to_id("<|eot_id|>"), eom)
    for tools in (TOOLS, None):
        _say(served_llama, llama, "Let me run that.", [eom], "more text")
        done = _chat(served_llama, tools=tools)
        assert (done.choices[0].message.content, done.choices[0].finish_reason) == (
            "Let me run that.", "stop")


def test_a_tool_schema_that_does_not_compile_is_a_400_naming_tools(served):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]
    with pytest.raises(openai.BadRequestError) as error:
        _chat(served, tools=bad)
    assert error.value.body["param"] == "tools" and "foo" in error.value.body["message"]


# -- logprobs and token ids, streamed and whole ----------------------------------------------------

@pytest.fixture(scope="module")
def plain():
    """The tokenizer of a template that shows the model no tools: "required" and a named
    function constrain the whole output to one call, streamed by `ToolCallStream`."""
    return hermes_tokenizer(NO_TOOLS)


@pytest.fixture(scope="module")
def served_plain(plain):
    yield from _serve(plain)


NAMED = {"type": "function", "function": {"name": "get_weather"}}
WEATHER_ARGUMENTS = '{"city": "Paris", "unit": "celsius"}'
# (server, tokenizer, tool_choice or None for no tools, the script): every way a chat answer
# streams, the constrained call (ToolCallStream), the model's own format (CallParser) and text.
STREAMED_WAYS = {
    "required, no tool format": ("served_plain", "plain", "required", PARIS),
    "named, no tool format": ("served_plain", "plain", NAMED, WEATHER_ARGUMENTS),
    "auto, own format": ("served", "tokenizer", "auto",
                         f"Let me look.\n<tool_call>\n{PARIS}\n</tool_call>"),
    "no tools": ("served_plain", "plain", None, "It is sunny in Paris."),
}


def _stream_extras(chunks) -> dict:
    """What a stream's chunks carry beside its text: each chunk's logprobs entries and token
    ids (checked to cover the same tokens), the prompt's ids, the calls and the finish."""
    entries, ids, prompt_ids, calls, finish = [], [], None, {}, None
    for chunk in chunks:
        choice = chunk.choices[0]
        chunk_entries = choice.logprobs.content if choice.logprobs is not None else []
        chunk_ids = getattr(choice, "token_ids", None)
        if chunk_ids is None:
            chunk_ids = []
        else:  # a chunk's logprobs are its own tokens'
            assert len(chunk_entries) == len(chunk_ids), chunk
        entries += chunk_entries
        ids += chunk_ids
        if getattr(chunk, "prompt_token_ids", None) is not None:
            assert prompt_ids is None, "prompt_token_ids come once, in the first chunk"
            prompt_ids = chunk.prompt_token_ids
        for call in choice.delta.tool_calls or []:
            if call.id:
                calls[call.index] = [call.function.name, ""]
            calls[call.index][1] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return dict(entries=entries, ids=ids, prompt_ids=prompt_ids,
                calls=[tuple(calls[i]) for i in sorted(calls)], finish=finish)


def _entry(lp) -> tuple:
    return lp.token, lp.logprob, lp.bytes, [(t.token, t.logprob, t.bytes) for t in lp.top_logprobs]


@pytest.mark.parametrize("way", list(STREAMED_WAYS))
def test_streamed_chunks_carry_logprobs_and_token_ids_as_the_whole_answer(request, way):
    """logprobs, top_logprobs and return_token_ids: the chunks together carry every output
    token once, with the same entries and ids as the whole answer (the script is the greedy
    output, the same both times), and a tool call streams the same call as the whole one."""
    server, tokenizer, tool_choice, script = STREAMED_WAYS[way]
    served, tokenizer = request.getfixturevalue(server), request.getfixturevalue(tokenizer)
    _say(served, tokenizer, script)
    tools = {} if tool_choice is None else {"tool_choice": tool_choice}
    fields = dict(logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True},
                  tools=TOOLS if tool_choice is not None else None, **tools)
    streamed = _stream_extras(_chat(served, stream=True, **fields))
    whole = _chat(served, **fields)
    choice = whole.choices[0]
    ids = tokenizer.encode(script)  # then EOS, unless the constraint ended the output
    assert choice.token_ids in (ids, ids + [EOS_ID])
    assert streamed["ids"] == choice.token_ids and streamed["prompt_ids"] == (
        whole.prompt_token_ids)
    assert [_entry(lp) for lp in streamed["entries"]] == [
        _entry(lp) for lp in choice.logprobs.content]
    assert all(len(lp.top_logprobs) == 2 for lp in streamed["entries"])
    del fields["extra_body"]  # logprobs alone stream the same entries
    _say(served, tokenizer, script)
    alone = _stream_extras(_chat(served, stream=True, **fields))
    assert alone["ids"] == [] and [_entry(lp) for lp in alone["entries"]] == [
        _entry(lp) for lp in choice.logprobs.content]
    made = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert streamed["calls"] == made and streamed["finish"] == choice.finish_reason
    assert (choice.finish_reason, len(made)) == (("stop", 0) if tool_choice is None
                                                 else ("tool_calls", 1))


# -- the objects in response_format, tools and tool_choice -----------------------------------------

def _weather_tool(**extra) -> dict:
    return {"type": "function", "function": TOOLS[0]["function"] | extra}


def _schema_format(**spec) -> dict:
    return {"type": "json_schema", "json_schema": spec}


# (fields, param): a key OpenAI's API does not define in that object, or a wrong value of one
# it does; each a 400 naming the key's path.
NESTED_REFUSALS = [
    ({"response_format": {"type": "json_object", "schema": WEATHER}}, "response_format.schema"),
    ({"response_format": {"type": "text", "json_schema": {"name": "w"}}},
     "response_format.json_schema"),
    ({"response_format": _schema_format(name="w", schema=WEATHER, colour="red")},
     "response_format.json_schema.colour"),
    ({"response_format": _schema_format(name="w", json_schema=WEATHER)},
     "response_format.json_schema.json_schema"),
    ({"response_format": _schema_format(schema=WEATHER)}, "response_format.json_schema.name"),
    ({"response_format": _schema_format(name="a name", schema=WEATHER)},
     "response_format.json_schema.name"),
    ({"response_format": _schema_format(name="w", schema=WEATHER, strict="yes")},
     "response_format.json_schema.strict"),
    ({"response_format": _schema_format(name="w", schema=WEATHER, description=3)},
     "response_format.json_schema.description"),
    ({"tools": [TOOLS[0], TOOLS[1] | {"colour": "red"}]}, "tools[1].colour"),
    ({"tools": [_weather_tool(colour="red")]}, "tools[0].function.colour"),
    ({"tools": [_weather_tool(arguments={})]}, "tools[0].function.arguments"),
    ({"tools": [_weather_tool(strict="yes")]}, "tools[0].function.strict"),
    ({"tool_choice": NAMED | {"colour": "red"}}, "tool_choice.colour"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather", "arguments": {}}}},
     "tool_choice.function.arguments"),
    ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
    ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "get_weather"}}]}}}, "tool_choice.type"),
]


@pytest.mark.parametrize("fields,param", NESTED_REFUSALS,
                         ids=[param for _, param in NESTED_REFUSALS])
def test_a_nested_key_not_served_is_a_400_naming_its_path(served, fields, param):
    runs = served[1].num_executed
    fields = {"tools": None} | fields if "response_format" in fields else fields
    with pytest.raises(openai.BadRequestError) as error:
        _chat(served, **fields)
    body = error.value.body
    assert error.value.status_code == 400 and body["param"] == param, body
    assert body["message"].startswith(param), body
    is_unknown = param.rsplit(".", 1)[-1] in ("colour", "schema", "json_schema", "arguments")
    assert body["code"] == ("unknown_parameter" if is_unknown else "invalid_value"), body
    assert served[1].num_executed == runs  # refused before anything ran


def test_the_keys_openai_defines_in_those_objects_are_served(served, tokenizer):
    """description and strict in a function and in response_format.json_schema; a json_schema
    without a schema (OpenAI's is optional) holds the output to any JSON object."""
    _say(served, tokenizer, f"<tool_call>\n{PARIS}\n</tool_call>")
    done = _chat(served, tools=[_weather_tool(strict=True), TOOLS[1]], tool_choice=NAMED)
    assert done.choices[0].finish_reason == "tool_calls"
    for strict in (True, False, None):
        _say(served, tokenizer, WEATHER_ARGUMENTS)
        done = _chat(served, tools=None, response_format=_schema_format(
            name="weather", description="The weather.", schema=WEATHER, strict=strict))
        assert (done.choices[0].message.content, done.choices[0].finish_reason) == (
            WEATHER_ARGUMENTS, "stop")
    for script, finish in [('{"any": [1, "object"]}', "stop"), ("[1]", "unsatisfiable"),
                           ("Sunny.", "unsatisfiable")]:
        _say(served, tokenizer, script)
        done = _chat(served, tools=None, response_format=_schema_format(name="anything"))
        assert done.choices[0].finish_reason == finish, script
