"""`AsyncLLM`: the in-process asyncio engine. Applications `await` and `async for` requests with
no server in between; the engine runs on the same engine loop (`meshserve.serving.engine.loop`) that
the gRPC and HTTP servers use, on its own thread, so many requests batch together.

    llm = AsyncLLM("smollm2-135m-instruct", max_num_seqs=16)
    out = await llm.generate("Hello, my name is", SamplingParams(max_tokens=32))
    async for partial in llm.stream([{"role": "user", "content": "Hi!"}]):
        print(partial.outputs[0].text)          # everything so far, as tokens arrive
    llm.shutdown()

A prompt is a text, token ids, or chat messages (a list of dicts, through the chat template).
Invalid input raises `ValueError` naming the field; a full queue raises `Refused` with kind
"queue_full" (`Limits` sets the bounds). Cancelling the task that awaits or iterates a request
aborts it at the next engine step, which frees its pages.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, AsyncIterator, Sequence

from meshserve.batching.adapters import LoRARequest
from meshserve.batching.sampling import SamplingParams
from meshserve.serving.engine.admission import Prompt
from meshserve.serving.engine.core import Engine
from meshserve.serving.engine.loop import EngineLoop, Failed, Finished, Limits, Refused
from meshserve.serving.engine.outputs import RequestOutput
from meshserve.serving.python_api.llm import LLM

__all__ = ["AsyncLLM", "Limits", "Refused", "RequestFailed"]

PromptInput = str | Sequence[int] | list[dict]


class RequestFailed(RuntimeError):
    """A request that was admitted and then failed (`kind`: deadline, unavailable, internal)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class AsyncLLM:
    def __init__(self, model: str = "smollm2-135m-instruct", *, limits: Limits = Limits(),
                 **llm_kwargs: Any):
        self.llm = LLM(model, **llm_kwargs)
        self._start(self.llm.engine, limits)

    @classmethod
    def from_engine(cls, engine: Engine, limits: Limits = Limits()) -> AsyncLLM:
        """Serves an engine built elsewhere (it must have no other owner)."""
        self = cls.__new__(cls)
        self.llm = None
        self._start(engine, limits)
        return self

    def _start(self, engine: Engine, limits: Limits) -> None:
        self.engine = engine
        self.loop = EngineLoop(engine, limits)
        self._ids = itertools.count()
        self.loop.start()
        self.loop.serving()

    async def generate(self, prompt: PromptInput, params: SamplingParams | None = None, *,
                       request_id: str | None = None, priority: int = 0,
                       lora_request: LoRARequest | None = None) -> RequestOutput:
        """The finished output."""
        last = None
        async for last in self.stream(prompt, params, request_id=request_id, priority=priority,
                                      lora_request=lora_request):
            pass
        return last

    async def chat(self, messages: list[dict], params: SamplingParams | None = None,
                   **kwargs) -> RequestOutput:
        return await self.generate(messages, params, **kwargs)

    async def stream(self, prompt: PromptInput, params: SamplingParams | None = None, *,
                     request_id: str | None = None, priority: int = 0,
                     lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Partial outputs as tokens arrive (each holds everything so far), the last one
        finished (finish_reason "abort" if it was cancelled another way). `lora_request` runs
        it with that LoRA adapter (`enable_lora`); a bad adapter raises ValueError."""
        sub = self._submit(prompt, params or SamplingParams(), request_id, priority,
                           lora_request)
        done = False
        try:
            async for item in sub.items():
                if isinstance(item, Failed):
                    done = True
                    if item.kind == "invalid":
                        raise ValueError(item.message)
                    raise RequestFailed(item.kind, item.message)
                done = isinstance(item, Finished)
                if not done and item.output.finished:
                    continue  # the Finished that follows carries the same output
                yield item.output
        finally:
            if not done:  # the task was cancelled, or the caller stopped iterating
                self.loop.cancel(sub.request_id)

    def _submit(self, prompt: PromptInput, params: SamplingParams, request_id: str | None,
                priority: int, lora_request: LoRARequest | None = None):
        """Checks the request (`EngineLoop.admission`: an AdmissionError, a ValueError, names
        the field) and queues it; the engine checks its adapter when it takes it."""
        self.loop.check_open()
        if lora_request is not None and self.engine.adapters is None:
            raise ValueError("lora_request: this engine serves no LoRA adapters; start it with "
                             "enable_lora=True")
        admitted = self.loop.admission.admit(Prompt.of(prompt), params,
                                             request_id=request_id or f"async-{next(self._ids)}")
        admitted = dataclasses.replace(admitted, lora_request=lora_request)
        return self.loop.submit(admitted, priority=priority)

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Lets running requests finish for up to `drain_timeout` seconds, aborts the rest and
        stops the loop."""
        self.loop.drain(drain_timeout)

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc) -> None:
        self.shutdown()

