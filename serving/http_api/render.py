"""The OpenAI response shapes of one request: a whole completion or chat completion, or its stream
chunks, from the engine's `RequestOutput`s (`meshserve.serving.http_api.app` sends them).

Shapes follow OpenAI's `text_completion`, `chat.completion` and `chat.completion.chunk`, with
vLLM's extras where the request asked for them: `token_ids` and `prompt_token_ids`
(`return_token_ids`), `prompt_logprobs`, usage in every chunk (`continuous_usage_stats`), tokens
as `token_id:<id>` (`return_tokens_as_token_ids`). Every object carries the server's
`system_fingerprint`. Tool calls (`tools`) come as a `tool_calls` message with finish_reason
"tool_calls", or streamed as OpenAI's tool-call deltas: read from the model's own format by
`tool_calls.CallParser`, with any content beside them, or from an output constrained to one call
by `ToolCallStream`. Whichever way a stream goes, logprobs and `token_ids` (when asked) come in
the chunk of the step that made their tokens, even one whose text is held back, so a stream's
chunks together carry each output token once, as the whole response does.
"""

from __future__ import annotations

import json
import time

from meshserve.serving.engine.loop import Delta
from meshserve.serving.openai_api.request_model import OpenAIRequest
from meshserve.serving.openai_api.structured_fields import ToolCalls, ToolCallStream
from meshserve.serving.engine.outputs import Logprob, RequestOutput
from meshserve.serving.openai_api.tool_calls import CallParser


class Render:
    """One request's response objects, whole or as stream chunks. A stream is `opening()` (no
    chunk here), the chunks of each `delta` and of `finish` (or `failure`), each framed by
    `sse`, then `END`."""

    END = "data: [DONE]\n\n"

    def __init__(self, response_id: str, model: str, fingerprint: str, request: OpenAIRequest,
                 *, tools: ToolCalls | None = None):
        self.id, self.model, self.fingerprint = response_id, model, fingerprint
        self.tools = tools
        own = tools is not None and tools.own is not None
        self.tool_stream = ToolCallStream(tools) if tools is not None and not own else None
        self.parser = CallParser(tools.own.format) if own else None
        self.chat = request.is_chat
        self.num_top = request.logprobs
        self.include_usage = request.include_usage
        self.continuous_usage = request.include_usage and request.continuous_usage
        self.return_token_ids = request.return_token_ids
        self.tokens_as_ids = request.tokens_as_ids
        self.created = int(time.time())
        self.is_first = True
        self.num_chars = 0  # completions' text offset

    def opening(self) -> list[dict]:
        return []

    @staticmethod
    def failure(error: dict) -> list[dict]:
        """A failure after the stream began: OpenAI's error object, as one event."""
        return [error]

    @staticmethod
    def sse(event: dict) -> str:
        return f"data: {json.dumps(event, ensure_ascii=False)}\n\n"

    def _base(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def whole(self, output: RequestOutput) -> dict:
        completion = output.outputs[0]
        logprobs = self._logprobs(completion.token_ids, completion.logprobs)
        if self.tools is not None:
            message, finish_reason = self.tools.message(completion.text,
                                                        completion.finish_reason)
            choice = {"index": 0, "message": message, "logprobs": logprobs,
                      "finish_reason": finish_reason}
            body = self._base("chat.completion")
        elif self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": completion.text},
                      "logprobs": logprobs, "finish_reason": completion.finish_reason}
            body = self._base("chat.completion")
        else:
            choice = {"index": 0, "text": completion.text, "logprobs": logprobs,
                      "finish_reason": completion.finish_reason}
            body = self._base("text_completion")
        choice["stop_reason"] = completion.stop_reason
        # vLLM puts the prompt's extras on the choice for completions, beside it for chat
        extras = self._prompt_extras(output)
        if self.return_token_ids:
            choice["token_ids"] = list(completion.token_ids)
        if self.chat:
            body |= extras
        else:
            choice |= extras
        return body | {"choices": [choice], "usage": usage(output)}

    def _prompt_extras(self, output: RequestOutput) -> dict:
        extras = {}
        if self.return_token_ids:
            extras["prompt_token_ids"] = list(output.prompt_token_ids)
        if output.prompt_logprobs is not None:
            extras["prompt_logprobs"] = [None if entry is None else _vllm_entry(entry)
                                         for entry in output.prompt_logprobs]
        return extras

    def _own_finish(self, completion) -> str:
        """"tool_calls" when the model made calls and stopped by itself after them."""
        is_called = self.parser.is_complete and completion.finish_reason == "stop"
        return "tool_calls" if is_called else completion.finish_reason

    def delta(self, delta: Delta) -> list[dict]:
        """The chunks of one `Delta`. With logprobs or `return_token_ids`, every delta gives a
        chunk carrying its own tokens' logprobs and ids (even when its text is held back), so
        a stream's chunks together carry each output token once, as the whole response does."""
        logprobs = self._logprobs(delta.token_ids, delta.logprobs)
        is_first = self.is_first
        if self.tool_stream is not None:
            chunks = self._tool_chunks(self.tool_stream.add(delta.text), None, delta.output,
                                       logprobs, has_tokens=self._carries_tokens(logprobs))
        else:
            text, calls = delta.text, []
            if self.parser is not None:
                text, calls = self.parser.add(delta.text)
            if not (text or calls or is_first or self._carries_tokens(logprobs)):
                return []
            chunks = [self._chunk(text, logprobs, None, delta.output, calls)]
        if self.return_token_ids:
            for chunk in chunks:
                chunk["choices"][0]["token_ids"] = delta.token_ids
                if is_first:
                    chunk["prompt_token_ids"] = list(delta.output.prompt_token_ids)
        return chunks

    def _carries_tokens(self, logprobs: dict | None) -> bool:
        """Whether a delta's tokens go out in a chunk of their own, text or none."""
        return bool(logprobs) or self.return_token_ids

    def _tool_chunks(self, calls: list[dict], finish_reason: str | None,
                     output: RequestOutput, logprobs: dict | None = None, *,
                     has_tokens: bool = False) -> list[dict]:
        """A chat chunk carrying OpenAI's tool-call deltas; none when there is nothing new (no
        call delta, no finish, not the first, and no tokens to carry)."""
        if not (calls or finish_reason is not None or self.is_first or has_tokens):
            return []
        delta = {"tool_calls": calls} if calls else {}
        if self.is_first:
            delta = {"role": "assistant", "content": None} | delta
        self.is_first = False
        body = self._base("chat.completion.chunk")
        if self.include_usage:
            body["usage"] = usage(output) if self.continuous_usage else None
        return [body | {"choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": finish_reason}]}]

    def finish(self, output: RequestOutput) -> list[dict]:
        completion = output.outputs[0]
        if self.tool_stream is not None:
            is_call = (completion.finish_reason == "stop"
                       and self.tools.parse(completion.text) is not None)
            chunks = self._tool_chunks([], "tool_calls" if is_call else completion.finish_reason,
                                       output)
        elif self.parser is not None:
            text, calls = self.parser.finish()  # what was held back
            chunks = [self._chunk(text, None, None, output, calls)] if text or calls else []
            chunks.append(self._chunk("", None, self._own_finish(completion), output))
        else:
            chunks = [self._chunk("", None, completion.finish_reason, output)]
        chunks[-1]["choices"][0]["stop_reason"] = output.outputs[0].stop_reason
        if self.include_usage:
            kind = "chat.completion.chunk" if self.chat else "text_completion"
            chunks.append(self._base(kind) | {"choices": [], "usage": usage(output)})
        return chunks

    def _chunk(self, text: str, logprobs: dict | None, finish_reason: str | None,
               output: RequestOutput, tool_calls: list[dict] | None = None) -> dict:
        if self.chat:
            delta = {"content": text} if text or (finish_reason is None and not tool_calls) \
                else {}
            if tool_calls:
                delta["tool_calls"] = tool_calls
            if self.is_first:
                delta = {"role": "assistant"} | delta
            choice = {"index": 0, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}
            body = self._base("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs,
                      "finish_reason": finish_reason}
            body = self._base("text_completion")
        self.is_first = False
        if self.include_usage:
            body["usage"] = usage(output) if self.continuous_usage else None
        return body | {"choices": [choice]}

    def _logprobs(self, token_ids: list[int], entries: list[dict] | None) -> dict | None:
        if entries is None or self.num_top is None:
            return None
        tops = [_top(entry, self.num_top) for entry in entries]
        if self.chat:
            return {"content": [
                self._chat_logprob(token, entry[token]) | {"top_logprobs": [
                    self._chat_logprob(t, lp) for t, lp in top]}
                for token, entry, top in zip(token_ids, entries, tops)]}
        tokens = [self._token_text(t, entry[t]) for t, entry in zip(token_ids, entries)]
        offsets = []
        for text in tokens:
            offsets.append(self.num_chars)
            self.num_chars += len(text)
        return {"tokens": tokens,
                "token_logprobs": [entry[t].logprob for t, entry in zip(token_ids, entries)],
                "top_logprobs": [{self._token_text(t, lp): lp.logprob for t, lp in top}
                                 for top in tops],
                "text_offset": offsets}

    def _token_text(self, token: int, lp: Logprob) -> str:
        if self.tokens_as_ids or lp.decoded_token is None:
            return f"token_id:{token}"
        return lp.decoded_token

    def _chat_logprob(self, token: int, lp: Logprob) -> dict:
        text = self._token_text(token, lp)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}


def usage(output: RequestOutput) -> dict:
    num_prompt, num_completion = len(output.prompt_token_ids), len(output.outputs[0].token_ids)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion,
            "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens}}


def _top(entry: dict, num_top: int) -> list:
    """The `num_top` most likely tokens, by rank."""
    return sorted(((t, lp) for t, lp in entry.items()
                   if lp.rank is not None and lp.rank <= num_top), key=lambda item: item[1].rank)


def _vllm_entry(entry: dict[int, Logprob]) -> dict[str, dict]:
    return {str(token): {"logprob": lp.logprob, "rank": lp.rank,
                         "decoded_token": lp.decoded_token} for token, lp in entry.items()}
