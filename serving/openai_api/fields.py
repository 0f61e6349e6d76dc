"""The OpenAI request's field table: every field of OpenAI's chat and completions requests, of
vLLM's extras and of meshserve's own extension, with its verdict.

`FIELDS` is the one table. A row names a field, where it comes from (OpenAI, vLLM or meshserve),
the endpoints that take it and its verdict:

    honoured  the field does what OpenAI (or vLLM) documents (meshserve's: what its note says);
    accepted  the field is checked, and changes nothing a client gets back here (an end-user id,
              a prompt-cache hint: prefix caching is automatic and never changes an output);
    refused   a value other than a neutral one (one that changes nothing, such as the default)
              is a 400 naming the field, with the row's reason.

A field in no row, or one sent to an endpoint its row does not list, is refused too: a client
never gets a 200 for something that was not done. `docs/server.md` prints this table
(`markdown_table()`, or `python -m meshserve.serving.openai_api.fields`); a test keeps the two
equal. Making a refused field honoured is a change of its row (its verdict and check) and of
`meshserve.serving.openai_api.request_model._build`, which puts the value into the `OpenAIRequest`
(`BUILT` lists what it reads). The Responses API's table (`meshserve.serving.openai_api.responses`)
is made of the same rows, this table's own where a field is the same.

This module knows nothing of HTTP, the engine or the engine loop.
"""

from __future__ import annotations

import dataclasses
import json

from meshserve.serving.openai_api.checks import (BACKENDS, ENDPOINTS, RESPONSES, Check, backend,
                                                 json_value, logprobs, prompt, stop_strings,
                                                 stream_options, token_ids, typed)
from meshserve.serving.openai_api.chat_messages import check_messages

VERDICTS = ("honoured", "accepted", "refused")


@dataclasses.dataclass(frozen=True)
class Field:
    """One request field. `check` (honoured and accepted rows) raises RequestError for a value of
    the wrong kind and returns the value to use; `sampling` names the `SamplingParams` field it
    sets, if any; `neutral` (refused rows) are the values that change nothing, and pass."""

    name: str
    origin: str
    endpoints: tuple[str, ...]
    verdict: str
    note: str
    check: Check | None = None
    sampling: str | None = None
    neutral: tuple = ()

    def __post_init__(self):
        assert self.verdict in VERDICTS, self.verdict
        assert (self.check is None) == (self.verdict == "refused"), self.name
        assert set(self.endpoints) <= {*ENDPOINTS, *RESPONSES}, self.endpoints


def honoured(name: str, note: str, check: Check, *, origin: str = "OpenAI",
             endpoints: tuple[str, ...] = ENDPOINTS, sampling: str | None = None) -> Field:
    return Field(name, origin, endpoints, "honoured", note, check, sampling)


def accepted(name: str, note: str, kind: type, *, origin: str = "OpenAI",
             endpoints: tuple[str, ...] = ENDPOINTS) -> Field:
    return Field(name, origin, endpoints, "accepted", note, typed(kind))


def refused(name: str, note: str, *, neutral: tuple = (), origin: str = "OpenAI",
            endpoints: tuple[str, ...] = ENDPOINTS) -> Field:
    return Field(name, origin, endpoints, "refused", note, neutral=neutral)


CHAT, COMPLETIONS = ("chat",), ("completions",)
_STRUCTURED = "the output is constrained to it (structured output; one such field per request)"
_OLD_FUNCTIONS = "the old function calling: send tools and tool_choice"
_CACHE = "prefix caching is automatic and never changes an output"

FIELDS: tuple[Field, ...] = (
    # -- OpenAI ---------------------------------------------------------------------------------
    honoured("model", "one of the served names (`GET /v1/models`), or a LoRA adapter's name "
             "(`--lora-modules`): the request runs with that adapter; may be left out",
             typed(str)),
    honoured("prompt", "one text, or one list of token ids (a list of one of either too)",
             prompt, endpoints=COMPLETIONS),
    honoured("messages", "role and content (a string, or text parts), through the model's chat "
             "template; a message's name goes to the template too, which renders it where it "
             "reads names (most templates, SmolLM2's among them, leave it out)", check_messages,
             endpoints=CHAT),
    honoured("max_tokens", "default: 16 for completions, the rest of the context for chat; "
             "prompt + max_tokens must fit the context (nothing is truncated)", typed(int)),
    honoured("max_completion_tokens", "the same as max_tokens", typed(int), endpoints=CHAT),
    honoured("temperature", ">= 0; 0 is greedy", typed(float), sampling="temperature"),
    honoured("top_p", "(0, 1]", typed(float), sampling="top_p"),
    honoured("presence_penalty", "[-2, 2], on output tokens", typed(float),
             sampling="presence_penalty"),
    honoured("frequency_penalty", "[-2, 2], on output tokens", typed(float),
             sampling="frequency_penalty"),
    honoured("seed", "0 to 2^32 - 1; the same seed gives the same tokens, whatever the batch",
             typed(int), sampling="seed"),
    honoured("stop", "a string or a list; the text never ends inside a stop string", stop_strings,
             sampling="stop"),
    honoured("logprobs", "completions: the number of top alternatives per token; chat: true "
             "or false", logprobs),
    honoured("top_logprobs", "needs logprobs: true", typed(int), endpoints=CHAT),
    honoured("stream", "server-sent events, ending with `data: [DONE]`", typed(bool)),
    honoured("stream_options", "needs stream: true; include_usage, and vLLM's "
             "continuous_usage_stats (usage in every chunk); include_obfuscation: true is "
             "refused", stream_options),
    refused("n", "one choice per request: send n requests (with different seeds)",
            neutral=(1,)),
    refused("best_of", "one choice per request, and no ranking of candidates", neutral=(1,),
            origin="OpenAI (completions), vLLM (chat)"),
    refused("echo", "the prompt is not repeated in the output", neutral=(False,),
            origin="OpenAI (completions), vLLM (chat)"),
    refused("suffix", "no fill-in-the-middle", neutral=("",), endpoints=COMPLETIONS),
    refused("logit_bias", "no per-token bias", neutral=({},)),
    accepted("user", "an end-user id: checked, changes nothing", str),
    accepted("safety_identifier", "an end-user id: checked, changes nothing", str,
             endpoints=CHAT),
    accepted("prompt_cache_key", _CACHE, str, endpoints=CHAT),
    accepted("prompt_cache_options", _CACHE, dict, endpoints=CHAT),
    accepted("prompt_cache_retention", _CACHE, str, endpoints=CHAT),
    refused("store", "completions are not stored", neutral=(False,), endpoints=CHAT),
    refused("metadata", "it labels stored completions, and none are stored", neutral=({},),
            endpoints=CHAT),
    refused("service_tier", "one tier only", neutral=("auto", "default"), endpoints=CHAT),
    refused("modalities", "text output only", neutral=(["text"],), endpoints=CHAT),
    refused("audio", "no audio output", endpoints=CHAT),
    refused("prediction", "no predicted outputs", endpoints=CHAT),
    refused("reasoning_effort", "no reasoning-effort control", endpoints=CHAT),
    refused("verbosity", "no verbosity control", endpoints=CHAT),
    refused("web_search_options", "no web search", endpoints=CHAT),
    refused("moderation", "no moderation", endpoints=CHAT),
    honoured("response_format", "json_object or json_schema (name, description, schema, strict: "
             "enforced either way; no schema: any JSON object) constrain the output; text does "
             "not; any other key is refused by its path", json_value((dict,))),
    honoured("tools", "functions, answered as tool_calls: in the model's own format where its "
             "chat template declares tools (Hermes/Qwen `<tool_call>` blocks, each call held to "
             "its tool's schema), else through a system message; a function takes name, "
             "description, parameters and strict (held to its schema either way), any other key "
             "is refused by its path", json_value((list,)),
             endpoints=CHAT),
    honoured("tool_choice", "auto (the default with tools: text, calls or both; needs the "
             "model's own format, refused naming why without it), required, none, or a named "
             "function, `{\"type\": \"function\", \"function\": {\"name\"}}` and no other key",
             json_value((str, dict)), endpoints=CHAT),
    honoured("parallel_tool_calls", "false: one call at most; true (the default): as many as "
             "the model writes in its own format", typed(bool), endpoints=CHAT),
    refused("functions", _OLD_FUNCTIONS, neutral=([],), endpoints=CHAT),
    refused("function_call", _OLD_FUNCTIONS, neutral=("none",), endpoints=CHAT),
    # -- vLLM -----------------------------------------------------------------------------------
    honoured("top_k", ">= 1; 0 or -1 is off", typed(int), origin="vLLM", sampling="top_k"),
    honoured("min_p", "[0, 1]", typed(float), origin="vLLM", sampling="min_p"),
    honoured("repetition_penalty", "> 0, on prompt and output tokens", typed(float), origin="vLLM",
             sampling="repetition_penalty"),
    honoured("stop_token_ids", "token ids that end the request", token_ids, origin="vLLM",
             sampling="stop_token_ids"),
    honoured("ignore_eos", "EOS ends nothing", typed(bool), origin="vLLM", sampling="ignore_eos"),
    honoured("min_tokens", "EOS and stop_token_ids are held back until then, with or without "
             "ignore_eos", typed(int), origin="vLLM", sampling="min_tokens"),
    honoured("prompt_logprobs", "not with stream; in the response as vLLM gives them",
             typed(int), origin="vLLM", sampling="prompt_logprobs"),
    honoured("return_token_ids", "adds token_ids (and prompt_token_ids) to the response; "
             "streamed, each chunk has its own tokens' ids (and logprobs), tool calls too",
             typed(bool), origin="vLLM"),
    honoured("return_tokens_as_token_ids", "logprob tokens as `token_id:<id>`", typed(bool),
             origin="vLLM"),
    honoured("priority", "lower is scheduled first, as in vLLM", typed(int), origin="vLLM"),
    honoured("speculate", "false: this request never drafts when the server speculates "
             "(`--speculative-config`); the same tokens either way", typed(bool),
             origin="meshserve", sampling="speculate"),
    honoured("request_id", "the response's id is `cmpl-<request_id>` (`chatcmpl-` for chat); "
             "the x-request-id header wins over it", typed(str), origin="vLLM"),
    refused("use_beam_search", "no beam search", neutral=(False,), origin="vLLM"),
    refused("length_penalty", "beam search only", neutral=(1,), origin="vLLM"),
    refused("include_stop_str_in_output", "the stop string is never part of the text",
            neutral=(False,), origin="vLLM"),
    refused("skip_special_tokens", "special tokens are always left out of the text",
            neutral=(True,), origin="vLLM"),
    refused("spaces_between_special_tokens", "special tokens are left out of the text",
            neutral=(True,), origin="vLLM"),
    refused("truncate_prompt_tokens", "prompts are never truncated: a long one is refused",
            origin="vLLM"),
    refused("allowed_token_ids", "no token allow-list", origin="vLLM"),
    refused("bad_words", "no banned words", neutral=([],), origin="vLLM"),
    refused("logits_processors", "no custom logits processors", neutral=([],), origin="vLLM"),
    refused("add_special_tokens", "BOS is added when the model asks for it; send token ids to "
            "choose the tokens exactly", neutral=(True,), origin="vLLM"),
    refused("add_generation_prompt", "the assistant's turn is always opened", neutral=(True,),
            origin="vLLM", endpoints=CHAT),
    refused("continue_final_message", "the last message is not continued", neutral=(False,),
            origin="vLLM", endpoints=CHAT),
    refused("documents", "no documents for the chat template", neutral=([],), origin="vLLM",
            endpoints=CHAT),
    refused("chat_template", "the model's own chat template only", origin="vLLM",
            endpoints=CHAT),
    refused("chat_template_kwargs", "the model's own chat template only", neutral=({},),
            origin="vLLM", endpoints=CHAT),
    refused("include_reasoning", "no reasoning parser", neutral=(True,), origin="vLLM",
            endpoints=CHAT),
    refused("mm_processor_kwargs", "text only", neutral=({},), origin="vLLM"),
    refused("prompt_embeds", "token ids or text only", origin="vLLM", endpoints=COMPLETIONS),
    refused("cache_salt", "the prefix cache is not salted per request", origin="vLLM"),
    refused("kv_transfer_params", "no disaggregated serving", neutral=({},), origin="vLLM"),
    refused("vllm_xargs", "no extension arguments", neutral=({},), origin="vLLM"),
    honoured("structured_outputs", "one of json, regex, choice, grammar, json_object: "
             + _STRUCTURED, json_value((dict,)), origin="vLLM"),
    honoured("guided_json", "a JSON schema (or its text): " + _STRUCTURED,
             json_value((dict, str)), origin="vLLM"),
    honoured("guided_regex", "a regular expression: " + _STRUCTURED, json_value((str,)),
             origin="vLLM"),
    honoured("guided_choice", "a list of strings: " + _STRUCTURED, json_value((list,)),
             origin="vLLM"),
    honoured("guided_grammar", "a Lark or GBNF grammar: " + _STRUCTURED, json_value((str,)),
             origin="vLLM"),
    refused("structural_tag", "no structural tags", origin="vLLM"),
    Field("guided_decoding_backend", "vLLM", ENDPOINTS, "accepted",
          f"{', '.join(BACKENDS)}: llguidance constrains the output", backend),
    refused("guided_whitespace_pattern", "JSON is written compact, no other whitespace",
            origin="vLLM"),
    # -- meshserve ------------------------------------------------------------------------------
    honoured("structured_bounds", "bounds of the request's JSON constraint (a JSON schema or "
             "object from any field above, or a tool call written as JSON): "
             "`{\"max_string_length\": N, \"max_integer_digits\": D}`, either or both; no "
             "string or free key longer than N characters, no number with more than D digits "
             "before its point. One left out is the server's (`--structured-max-string-length`, "
             "`--structured-max-integer-digits`); none unless it sets them",
             json_value((dict,)), origin="meshserve"),
)
FIELDS_BY_NAME: dict[str, Field] = {f.name: f for f in FIELDS}
assert len(FIELDS_BY_NAME) == len(FIELDS), "a field has two rows"

SAMPLING = tuple(f for f in FIELDS if f.sampling)

# The fields that constrain the output, read whole by `structured_fields.read_request` once the
# engine's chat template is known (tool_choice auto depends on it).
STRUCTURED_FIELDS = ("response_format", "tools", "tool_choice", "parallel_tool_calls",
                     "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "structured_bounds")
# The honoured fields `request_model._build` reads, besides those that set a `SamplingParams`
# field: a row made honoured needs its use in `_build` and its name here, or it would be taken and
# do nothing.
BUILT = ("model", "prompt", "messages", "max_tokens", "max_completion_tokens", "logprobs",
         "top_logprobs", "stream", "stream_options", "return_token_ids",
         "return_tokens_as_token_ids", "priority", "request_id", *STRUCTURED_FIELDS)
assert {f.name for f in FIELDS if f.verdict == "honoured" and not f.sampling} == set(BUILT), (
    "an honoured field that request_model._build does not use, or a used one not honoured")


def markdown_table(fields: tuple[Field, ...] = FIELDS, *, by_endpoint: bool = True) -> str:
    """The table as docs/server.md prints it; `by_endpoint` adds the endpoints column."""
    lines = ["| field | endpoints | from | verdict | notes |", "|---|---|---|---|---|"]
    if not by_endpoint:
        lines = ["| field | from | verdict | notes |", "|---|---|---|---|"]
    for f in fields:
        endpoints = "both" if f.endpoints == ENDPOINTS else f.endpoints[0]
        verdict = f.verdict
        if f.neutral:
            verdict += " unless " + " or ".join(f"`{json.dumps(v)}`" for v in f.neutral)
        where = f" {endpoints} |" if by_endpoint else ""
        lines.append(f"| `{f.name}` |{where} {f.origin} | {verdict} | {f.note} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
