"""`meshserve.LLM`: the batch API, shaped like vLLM's offline `LLM` so users can switch.

    llm = LLM(model="smollm2-135m-instruct", max_num_seqs=16)
    outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8, max_tokens=32))
    outputs = llm.chat([{"role": "user", "content": "Hi!"}])
    outputs = llm.chat(messages, tools=tools, tool_choice="required")   # as the HTTP API
    outputs[0].outputs[0].tool_calls                    # [{"id", "type", "function": {...}}]
    for partial in llm.generate_stream("Once upon a time", SamplingParams(max_tokens=32)):
        print(partial.outputs[0].text)                  # everything so far, as tokens arrive

    llm = LLM(model="smollm2-135m-instruct", mesh="data=2,model=4")  # or a MeshConfig
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_max": 4, "prompt_lookup_min": 2})

    llm = LLM(model=..., enable_lora=True, max_loras=2, max_lora_rank=16)
    sql = LoRARequest("sql", 1, "/path/to/peft/adapter")   # meshserve.LoRARequest
    outputs = llm.generate(prompts, params, lora_request=sql)          # or one per prompt

Keyword arguments other than `dtype`, `seed` and `cluster` are `EngineConfig` fields. Weights are
read one tensor at a time and go to the mesh's devices already split
(`meshserve.sharding.sharded_loading`).
Requests run through the continuous-batching engine (or the static baseline with
`policy="static"`); outputs come back in the order of the prompts.

Many hosts: pass `cluster=ClusterConfig(...)` (or call
`meshserve.serving.engine.multihost.initialize` first) and run the same script on every process.
Each process loads only its shards; process 0 schedules and the others follow its plan stream. Every
process makes the same `generate` calls, with the same arguments (checked), and every process gets
process 0's outputs.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
from typing import Any, Iterator, Sequence

from tqdm.auto import tqdm

from meshserve.batching import wire
from meshserve.batching.adapters import LoRARequest
from meshserve.batching.sampling import SamplingParams
from meshserve.model import native_dot
from meshserve.serving.engine import multihost
from meshserve.sharding.sharded_loading import load_sharded
from meshserve.serving.engine.admission import Prompt as EnginePrompt
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.core import Engine
from meshserve.serving.openai_api.chat_messages import read_messages
from meshserve.serving.openai_api.structured_fields import Structured, prompt_messages, read_request
from meshserve.serving.engine.outputs import RequestOutput
from meshserve.serving.openai_api.tool_calls import ChatTools, chat_tools

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str = "smollm2-135m-instruct", *, dtype: str = "float32",
                 seed: int = 0, cluster: multihost.ClusterConfig | None = None,
                 **engine_config: Any):
        config = EngineConfig(**engine_config)  # fails fast, before loading weights
        if cluster is not None and multihost.current() is None:
            multihost.initialize(cluster)
        self.cluster = multihost.current()
        if self.cluster is not None:
            multihost.check_mesh(config.mesh_config)
            if config.enable_lora:
                raise ValueError("enable_lora runs on one process; a multi-process job does "
                                 "not serve LoRA adapters yet")
        # settled before loading: with native kernels the CPU keeps blocks the head reads
        config = dataclasses.replace(config, native_kernels=native_dot.resolve(
            config.native_kernels, num_devices=config.mesh_config.num_devices))
        pretrained = load_sharded(model, config.mesh_config, dtype=dtype, seed=seed,
                                  quantization=config.quantization,
                                  native_kernels=config.native_kernels)
        self.tokenizer = pretrained.tokenizer
        self.model_config = pretrained.config
        self.engine = Engine.from_model(pretrained.model, pretrained.tokenizer,
                             dataclasses.replace(config, warmup=False))
        if self.cluster is not None:
            self.engine.runner.channel = self.cluster.stream
        if config.warmup:
            self.engine.warmup()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """`lora_request`: one LoRA adapter for every prompt, or one per prompt (None: the base
        model); the engine needs `enable_lora`."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        adapters = _as_lora_list(lora_request, len(prompts))
        ids: list[str] = []
        try:
            for prompt, sp, adapter in zip(prompts, params, adapters):
                ids.append(self.engine.add_request(prompt, sp, lora_request=adapter))
        except ValueError:
            for request_id in ids:  # all or nothing: no earlier prompt stays queued
                self.engine.abort(request_id)
            raise
        if self.cluster is None:
            return self._run(ids, use_tqdm=use_tqdm)
        digest = wire.digest_words(repr((prompts, params)))
        stream = self.cluster.stream
        if self.cluster.is_leader:
            stream.send(wire.BEGIN_CALL, digest)
            outputs = self._run(ids, use_tqdm=use_tqdm)
            stream.send(wire.END_CALL, payloads=[wire.bytes_to_payload(pickle.dumps(outputs))])
            return outputs
        return self._follow_call(ids, digest)

    def generate_stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
                        lora_request: LoRARequest | None = None) -> Iterator[RequestOutput]:
        """One prompt's partial `RequestOutput`s as its tokens arrive (each holds everything so
        far), the last one finished. Runs the engine in the caller's thread, like `generate`;
        leaving the loop early aborts the request and frees its pages. For many requests at once
        from asyncio, use `AsyncLLM`."""
        if self.cluster is not None:
            raise ValueError("generate_stream() runs on one process; use generate() on many")
        request_id = self.engine.add_request(prompt, sampling_params, lora_request=lora_request)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort(request_id)

    def _follow_call(self, ids: list[str], digest: tuple[int, ...]) -> list[RequestOutput]:
        """A follower's `generate`: its own requests only checked the arguments; it runs process
        0's steps and returns process 0's outputs."""
        for request_id in ids:
            self.engine.abort(request_id)
        header, _ = multihost.follow_or_exit(self.engine.runner, self.cluster)
        if header.command != wire.BEGIN_CALL:
            self.cluster.abandon(f"process 0 sent {header.name} where a generate() call began: "
                                 "every process must make the same LLM calls")
        if header.words[:len(digest)] != digest:
            self.cluster.abandon("its generate() call has other prompts or sampling params than "
                                 "process 0's; every process must pass the same")
        header, payloads = multihost.follow_or_exit(self.engine.runner, self.cluster)
        if header.command != wire.END_CALL:
            self.cluster.abandon(f"process 0 sent {header.name} where a generate() call ended")
        return pickle.loads(wire.payload_to_bytes(payloads[0]))

    def shutdown(self) -> None:
        """Multi-process: leaves the job together with the other processes (each one calls it).
        Alone: nothing to do."""
        if self.cluster is not None:
            self.cluster.shutdown(self.engine.runner)

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             tools: list[dict] | None = None, tool_choice: str | dict | None = None,
             parallel_tool_calls: bool | None = None,
             response_format: dict | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """One conversation (a list of messages, as the HTTP API reads them) or several; each
        gets the chat template. `tools`, `tool_choice`, `parallel_tool_calls` and
        `response_format` are the HTTP API's fields, read by the same code: they constrain the
        output, and with tools each output's `message` is the assistant's answer with its
        `tool_calls` parsed (finish_reason "tool_calls" when it called)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        fields = {name: value for name, value in (
            ("tools", tools), ("tool_choice", tool_choice),
            ("parallel_tool_calls", parallel_tool_calls), ("response_format", response_format))
            if value is not None}
        structured = read_request(fields, chat=True, chat_tools=self._chat_tools) if fields \
            else Structured()
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [EnginePrompt("chat_text",
                                self._chat_prompt(c, structured, add_generation_prompt),
                                "messages") for c in conversations]
        params = _as_params_list(sampling_params, len(prompts))
        if structured.output is not None:
            params = [_constrained(sp, structured) for sp in params]
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)
        if structured.tools is not None:
            for out in outputs:
                completion = out.outputs[0]
                completion.message, completion.finish_reason = structured.tools.message(
                    completion.text, completion.finish_reason)
        return outputs

    @functools.cached_property
    def _chat_tools(self) -> ChatTools:
        """What the chat template does with tools (found once)."""
        return chat_tools(self.tokenizer)

    def _chat_prompt(self, conversation: Sequence[dict], structured: Structured,
                     add_generation_prompt: bool) -> str:
        """A conversation through the chat template, with its tools as the HTTP API gives
        them."""
        read, tools = prompt_messages(read_messages(list(conversation)), structured.tools,
                                      self._chat_tools)
        return self.tokenizer.apply_chat_template(read, tools=tools,
                                                  add_generation_prompt=add_generation_prompt)

    def _run(self, ids: list[str], *, use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if not prompts:
        raise ValueError("generate() needs at least one prompt")
    return prompts


def _constrained(params: SamplingParams, structured: Structured) -> SamplingParams:
    if params.structured is not None:
        raise ValueError(f"sampling_params.structured and {structured.field} each constrain the "
                         "output: give one")
    return dataclasses.replace(params, structured=structured.output)


def _as_lora_list(lora_request, count: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    requests = list(lora_request)
    if len(requests) != count:
        raise ValueError(f"got {len(requests)} lora_requests for {count} prompts")
    return requests


def _as_params_list(params, count: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling_params for {count} prompts")
    return params
