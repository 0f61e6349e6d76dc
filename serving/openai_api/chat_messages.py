"""OpenAI's chat messages, read as the chat endpoint reads them: role, content (a string or text
parts), a participant's name, and a tool call's traces in the history (an assistant's
`tool_calls`, a tool's `tool_call_id`). The HTTP API's `messages` field and `LLM.chat` read
them here; any other key with a value is refused, naming the message and key.
"""

from __future__ import annotations

from typing import Any

from meshserve.serving.openai_api.checks import RequestError, shown


def read_messages(messages: Any) -> list[dict]:
    """Chat messages read as the chat endpoint reads them; ValueError naming the message and key
    at fault (the Python API's `LLM.chat`)."""
    try:
        return check_messages("messages", messages, "chat")
    except RequestError as err:
        raise ValueError(err.message) from None


def check_messages(name: str, value: Any, endpoint: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RequestError(name, "messages must be a non-empty list of {role, content}")
    return [read_message(f"{name}[{i}]", message) for i, message in enumerate(value)]


# Message keys other than role, content and name: OpenAI clients send them back as null with an
# assistant message; any other value would change the conversation, and is refused.
_MESSAGE_EXTRAS = ("tool_calls", "tool_call_id", "function_call", "refusal", "audio",
                   "annotations", "reasoning_content")
MAX_NAME_CHARS = 64  # a participant's name, as OpenAI bounds function names


def read_message(where: str, message: Any) -> dict:
    """One chat message, at path `where` (`messages[2]`), read as the chat endpoint reads it."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(where, f"{where} must be an object with a role (a string)")
    for key, value in message.items():
        if key in ("role", "content", "name") or value in (None, [], "") or \
                _is_tool_key(message, key):
            continue
        why = ("only role, content and name are served" if key in _MESSAGE_EXTRAS
               else "not a chat message field")
        raise RequestError(f"{where}.{key}", f"{where}.{key}: {why}; leave it out",
                           code="unsupported_parameter")
    if message["role"] == "assistant" and message.get("tool_calls"):
        read = _tool_calls_message(f"{where}.tool_calls", message)
    else:
        read = {"role": message["role"], "content": _content(f"{where}.content",
                                                             message.get("content"))}
    if message["role"] == "tool" and isinstance(message.get("tool_call_id"), str):
        read["tool_call_id"] = message["tool_call_id"]
    if message.get("name") is not None:
        read["name"] = _name(f"{where}.name", message["name"])
    return read


def _name(where: str, name: Any) -> str:
    """A participant's name: the chat template gets it as the message's `name`."""
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_CHARS:
        raise RequestError(where, f"{where} must be a string of 1 to {MAX_NAME_CHARS} "
                                  f"characters, got {shown(name)}")
    return name


def _is_tool_key(message: dict, key: str) -> bool:
    """A tool call's traces in the history: an assistant's `tool_calls`, a tool's
    `tool_call_id` (the result is the tool message's content)."""
    return ((key == "tool_calls" and message["role"] == "assistant")
            or (key == "tool_call_id" and message["role"] == "tool"))


def _tool_calls_message(where: str, message: dict) -> dict:
    """An assistant turn that called tools: its content (possibly empty) and its calls, which
    `structured.prompt_messages` hands to the chat template as the model reads them."""
    calls = message["tool_calls"]
    if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str) for c in calls):
        raise RequestError(where, f"{where} must be a list of "
                                  '{"type": "function", "function": {"name", "arguments"}}')
    content = message.get("content")
    text = "" if content is None else _content(where.replace("tool_calls", "content"), content)
    return {"role": "assistant", "content": text, "tool_calls": [
        {"id": c.get("id"), "type": "function",
         "function": {"name": c["function"]["name"],
                      "arguments": c["function"].get("arguments", "{}")}} for c in calls]}


def _content(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(where, f"{where} must be a string or a list of text parts, got "
                                  f"{shown(content)}")
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text"
                and isinstance(part.get("text"), str) and set(part) <= {"type", "text"}):
            kind = part.get("type") if isinstance(part, dict) else None
            raise RequestError(f"{where}[{j}]", f"{where}[{j}]: only text parts "
                               f'({{"type": "text", "text": ...}}) are served, got type '
                               f"{shown(kind)}", code="unsupported_value")
        texts.append(part["text"])
    return "".join(texts)
