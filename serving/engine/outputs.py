"""What a request returns, shaped like vLLM's offline API so users can switch.

`RequestOutput.outputs` is a list of `CompletionOutput` (one today: `n` > 1 is not offered).
Logprobs are per output token a dict `{token_id: Logprob}` holding the chosen token and the top
`logprobs` alternatives, all from the model's raw distribution (before penalties, temperature and
filters). `rank` is the 1-based rank of the token in that distribution, or None when it lies
outside the top `max_logprobs` the step computed.
"""

from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class RequestMetrics:
    """Times are `time.monotonic()` seconds."""

    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    def record_token(self, now: float) -> None:
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None  # "stop", "length", "abort", "unsatisfiable", or None while running
    stop_reason: int | str | None = None  # the stop token id or string that ended it, or why
    # a structured output could not go on ("unsatisfiable")
    # `LLM.chat` with tools: the answer as OpenAI's assistant message, its tool calls parsed
    message: dict | None = None

    @property
    def tool_calls(self) -> list[dict]:
        """The calls the answer made (OpenAI's `tool_calls` entries); empty without any."""
        return list((self.message or {}).get("tool_calls") or [])

    @property
    def cumulative_logprob(self) -> float | None:
        if self.logprobs is None:
            return None
        return sum(entry[token].logprob for entry, token in zip(self.logprobs, self.token_ids))

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None  # first entry None, as in vLLM
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
