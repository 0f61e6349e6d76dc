"""The Responses API's objects of one request (`POST /v1/responses`): the response, whole or as
its stream of events, read off the chat answer that `Render` gives for the same request
(`meshserve.serving.http_api.render`), so text and tool calls are found as chat finds them.

The chat answer's chunks become output items, in the order they come: text is a `message` item
with one `output_text` part, and each tool call a `function_call` item (`call_id`: the chat call's
id, `id`: its own). Text after a call opens a new message. A whole response is the same reading of
the whole output in one piece (its events dropped), so it agrees with the stream; in one piece the
text comes before the calls, as in chat's whole message. An output with neither text nor a call
is one message of empty text.

Events, each with its `sequence_number`, counted from 0:

    response.created, response.in_progress     the response, in_progress, without output
    response.output_item.added                 an item opens (in_progress), then for a message:
      response.content_part.added                its output_text part
      response.output_text.delta ...             its text, piece by piece
      response.output_text.done
      response.content_part.done
    ... or for a function_call:
      response.function_call_arguments.delta ... its arguments, piece by piece
      response.function_call_arguments.done
    response.output_item.done                  the item, whole
    response.completed                         the response, whole, with its usage; or
    response.incomplete                        when it was cut short

Status: an output that stopped by itself is completed; one cut by max_output_tokens is incomplete
(`incomplete_details.reason` "max_output_tokens"), and so is one whose constraint could not go on
("unsatisfiable"); one the server aborted (a drain past its timeout) is cancelled, ending with
response.failed. The item being written when a response is cut short is incomplete too. A failure
after the stream began is response.failed, with the response's `error` saying why.
"""

from __future__ import annotations

import copy
import json
import time
import uuid

from meshserve.serving.engine.loop import Delta
from meshserve.serving.engine.outputs import RequestOutput
from meshserve.serving.http_api.render import Render, usage as chat_usage
from meshserve.serving.openai_api.request_model import OpenAIRequest
from meshserve.serving.openai_api.structured_fields import ToolCalls

# finish_reason -> (status, incomplete_details.reason, the last event)
_ENDS = {"stop": ("completed", None, "response.completed"),
         "length": ("incomplete", "max_output_tokens", "response.incomplete"),
         "unsatisfiable": ("incomplete", "unsatisfiable", "response.incomplete"),
         "abort": ("cancelled", None, "response.failed")}


class ResponsesRender:
    """One request's response, whole or as stream events (see the module docstring)."""

    END = ""  # no `data: [DONE]`: response.completed ends the stream

    def __init__(self, response_id: str, model: str, request: OpenAIRequest, *,
                 tools: ToolCalls | None = None):
        self.answer = Render(response_id, model, "", request, tools=tools)
        self.id, self.model, self.settings = response_id, model, request.echoed
        self.created = int(time.time())
        self.items: list[dict] = []  # the output so far; the last may be open
        self.is_open = False
        self.num_events = 0

    def whole(self, output: RequestOutput) -> dict:
        completion = output.outputs[0]
        self.delta(Delta(token_ids=list(completion.token_ids), text=completion.text,
                         logprobs=None, output=output))
        return self.finish(output)[-1]["response"]

    def opening(self) -> list[dict]:
        response = self._response("in_progress")
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def delta(self, delta: Delta) -> list[dict]:
        return [event for chunk in self.answer.delta(delta) for event in self._read(chunk)]

    def finish(self, output: RequestOutput) -> list[dict]:
        events = [event for chunk in self.answer.finish(output) for event in self._read(chunk)]
        status, reason, last = _ENDS[output.outputs[0].finish_reason]
        if not self.items:
            events += self._open_message()
        events += self._close("completed" if status == "completed" else "incomplete")
        response = self._response(status, reason=reason, usage=_usage(output))
        return events + [self._event(last, response=response)]

    def failure(self, error: dict) -> list[dict]:
        """A failure after the stream began (`error`: OpenAI's error object)."""
        error = error["error"]
        response = self._response("failed", error={"code": "server_error", "type": error["type"],
                                                    "message": error["message"]})
        return [self._event("response.failed", response=response)]

    @staticmethod
    def sse(event: dict) -> str:
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    # -- reading the chat answer ----------------------------------------------------------------

    def _read(self, chunk: dict) -> list[dict]:
        """The events of one chat chunk. A chunk's text may follow the open call's arguments
        (the call ended) and precede new calls, never the other way round."""
        delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
        calls = delta.get("tool_calls") or []
        first_new = next((i for i, call in enumerate(calls) if "id" in call), len(calls))
        events = [event for call in calls[:first_new] for event in self._arguments(call)]
        if delta.get("content"):
            events += self._text(delta["content"])
        for call in calls[first_new:]:
            if "id" in call:
                events += self._open_call(call)
            events += self._arguments(call)
        return events

    def _text(self, text: str) -> list[dict]:
        events = []
        if not (self.is_open and self.items[-1]["type"] == "message"):
            events = self._close("completed") + self._open_message()
        item = self.items[-1]
        item["content"][0]["text"] += text
        return events + [self._event("response.output_text.delta", **self._where(),
                                     content_index=0, delta=text, logprobs=[])]

    def _arguments(self, call: dict) -> list[dict]:
        piece = call["function"].get("arguments") or ""
        if not piece:
            return []
        item = self.items[-1]
        assert self.is_open and item["type"] == "function_call", (item, call)
        item["arguments"] += piece
        return [self._event("response.function_call_arguments.delta", **self._where(),
                            delta=piece)]

    # -- items ----------------------------------------------------------------------------------

    def _open_message(self) -> list[dict]:
        events = self._open({"id": f"msg_{uuid.uuid4().hex}", "type": "message",
                             "status": "in_progress", "role": "assistant", "content": []})
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.items[-1]["content"].append(part)
        return events + [self._event("response.content_part.added", **self._where(),
                                     content_index=0, part=copy.deepcopy(part))]

    def _open_call(self, call: dict) -> list[dict]:
        return self._close("completed") + self._open({
            "id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
            "call_id": call["id"], "name": call["function"]["name"], "arguments": ""})

    def _open(self, item: dict) -> list[dict]:
        self.items.append(item)
        self.is_open = True
        return [self._event("response.output_item.added", output_index=len(self.items) - 1,
                            item=copy.deepcopy(item))]

    def _close(self, status: str) -> list[dict]:
        """The open item's last events, `status` its own."""
        if not self.is_open:
            return []
        self.is_open = False
        item = self.items[-1]
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events = [self._event("response.output_text.done", **self._where(), content_index=0,
                                  text=part["text"], logprobs=[]),
                      self._event("response.content_part.done", **self._where(),
                                  content_index=0, part=copy.deepcopy(part))]
        else:
            events = [self._event("response.function_call_arguments.done", **self._where(),
                                  arguments=item["arguments"])]
        return events + [self._event("response.output_item.done",
                                     output_index=len(self.items) - 1, item=copy.deepcopy(item))]

    def _where(self) -> dict:
        """The last item's place, as its events name it."""
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.num_events, **fields}
        self.num_events += 1
        return event

    def _response(self, status: str, *, reason: str | None = None, usage: dict | None = None,
                  error: dict | None = None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created,
                "model": self.model, "status": status,
                "incomplete_details": None if reason is None else {"reason": reason},
                "error": error, "output": copy.deepcopy(self.items), "usage": usage,
                "store": False, "previous_response_id": None, "truncation": "disabled",
                **self.settings}


def _usage(output: RequestOutput) -> dict:
    counts = chat_usage(output)
    return {"input_tokens": counts["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": output.num_cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": counts["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts["total_tokens"]}
