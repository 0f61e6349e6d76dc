"""A request's output stream: its text, stop strings and logprobs, beside the scheduler's state.

The scheduler owns a request's tokens, pages and token-level stops (EOS, stop ids, max_tokens).
A `Stream` turns those tokens into what the caller sees: the decoded text cut at the first stop
string, the logprob entries, and a `RequestOutput`. It reads the request and never changes it:
when a stop string ends a request, `advance` returns the cut (`StopCut`) and the engine applies it
through the scheduler.

Invariants:
  - text is decoded one token at a time, so when one call brought several tokens (pipeline
    rounds), a stop string ends the request at the token that completed it;
  - the text of a running request never ends in a partial stop string: the last
    `len(longest stop) - 1` characters are held back until they can no longer start one;
  - a finished stream shows all its text, and its logprobs match its tokens one for one.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np

from meshserve.batching.request import Request
from meshserve.model.tokenizer import IncrementalDecoder, Tokenizer
from meshserve.serving.engine.outputs import (CompletionOutput, Logprob, RequestMetrics,
                                              RequestOutput)


@dataclasses.dataclass(frozen=True)
class StopCut:
    """Where a stop string ends a request: it keeps its first `num_outputs` tokens."""

    num_outputs: int
    stop: str


@dataclasses.dataclass
class Stream:
    """What the engine tracks per request beyond the scheduler's state."""

    request: Request
    prompt: str | None
    tokenizer: Tokenizer | None
    decoder: IncrementalDecoder | None
    text: str = ""  # decoded so far, cut at a stop string once one is found
    emitted: int = 0  # characters of `text` already safe to show
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics = dataclasses.field(default_factory=RequestMetrics)

    @classmethod
    def open(cls, request: Request, prompt: str | None, tokenizer: Tokenizer | None) -> Stream:
        params = request.params
        return cls(request=request, prompt=prompt, tokenizer=tokenizer,
                   decoder=IncrementalDecoder(tokenizer) if tokenizer is not None else None,
                   logprobs=[] if params.logprobs is not None else None,
                   prompt_logprobs=[None] if params.prompt_logprobs is not None else None)

    # -- logprobs -------------------------------------------------------------------------------

    def record_token(self, rows, r: int) -> None:
        """Row `r` of a step's result (`SampledRows`) sampled this stream's next token."""
        token = int(rows.tokens[r])
        self.metrics.record_token(time.monotonic())
        if self.logprobs is not None:
            self.logprobs.append(self._entry(token, float(rows.logprobs[r]), rows.top_ids[r],
                                             rows.top_logprobs[r], self.request.params.logprobs))

    def record_prompt_logprobs(self, rows, r: int, batch) -> None:
        """The prompt logprobs of the chunk row `r` of sub-batch `batch` computed."""
        if self.prompt_logprobs is None or rows.prompt_logprobs is None:
            return
        request, count = self.request, self.request.params.prompt_logprobs
        for t in range(int(batch.num_new[r])):
            position = int(batch.positions[r, t]) + 1
            if position != len(self.prompt_logprobs) or position >= request.num_prompt_tokens:
                continue  # already recorded before a preemption, or past the prompt
            self.prompt_logprobs.append(self._entry(
                request.prompt_token_ids[position], float(rows.prompt_logprobs[r, t]),
                rows.prompt_top_ids[r, t], rows.prompt_top_logprobs[r, t], count))

    def _entry(self, token: int, logprob: float, top_ids: np.ndarray, top_logprobs: np.ndarray,
               count: int) -> dict[int, Logprob]:
        entry = {token: Logprob(logprob=logprob, rank=_rank(token, top_ids),
                                decoded_token=self._token_text(token))}
        for rank, (tid, lp) in enumerate(zip(top_ids[:count], top_logprobs[:count]), start=1):
            entry.setdefault(int(tid), Logprob(logprob=float(lp), rank=rank,
                                               decoded_token=self._token_text(int(tid))))
        return entry

    def _token_text(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token], skip_special_tokens=False)

    # -- text -----------------------------------------------------------------------------------

    def advance(self) -> StopCut | None:
        """Decodes the tokens not yet decoded; returns where a stop string cuts the request."""
        request = self.request
        if self.decoder is None:
            return None
        new = request.output_token_ids[len(self.decoder.token_ids):]
        for count, token in enumerate(new, start=1):
            self.text += self.decoder.add(token)
            if count < len(new) and (hit := self._find_stop()) is not None:
                return self._cut(hit, len(request.output_token_ids) - len(new) + count)
        if request.is_finished:
            self.text += self.decoder.flush()
        hit = self._find_stop()
        return None if hit is None else self._cut(hit, len(request.output_token_ids))

    def _find_stop(self) -> tuple[int, str] | None:
        return find_stop(self.text, self.request.params.stop, self.emitted)

    def _cut(self, hit: tuple[int, str], num_outputs: int) -> StopCut:
        self.text = self.text[:hit[0]]
        if self.logprobs is not None:
            del self.logprobs[num_outputs:]
        return StopCut(num_outputs=num_outputs, stop=hit[1])

    def output(self) -> RequestOutput:
        """What the caller sees now: all the text once finished, else the text safe to show."""
        request = self.request
        if request.is_finished:
            self.emitted = len(self.text)
            self.metrics.finished_time = time.monotonic()
        else:
            hold = max((len(s) for s in request.params.stop), default=1) - 1
            self.emitted = max(self.emitted, len(self.text) - hold)
        completion = CompletionOutput(
            index=0, text=self.text[:self.emitted], token_ids=list(request.output_token_ids),
            logprobs=self.logprobs, finish_reason=request.finish_reason,
            stop_reason=request.stop_reason)
        self.metrics.num_preemptions = request.num_preemptions
        return RequestOutput(
            request_id=request.request_id, prompt=self.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            prompt_logprobs=self.prompt_logprobs, outputs=[completion],
            finished=request.is_finished, metrics=self.metrics,
            num_cached_tokens=request.num_cached_tokens)


def find_stop(text: str, stops: Sequence[str], start: int) -> tuple[int, str] | None:
    """Earliest stop string in `text` that ends after `start - len(stop)`: (index, stop)."""
    found = []
    for stop in stops:
        index = text.find(stop, max(0, start - len(stop) + 1))
        if index >= 0:
            found.append((index, stop))
    return min(found) if found else None


def _rank(token: int, top_ids: np.ndarray) -> int | None:
    matches = np.nonzero(top_ids == token)[0]
    return int(matches[0]) + 1 if matches.size else None
