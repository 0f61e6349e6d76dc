"""The engine and the gRPC server on the arithmetic runner (`tests/serving/fake_runner.py`): the
runner contract lets them run with no model, so these tests assert exact token streams, stops,
logprobs, page accounting and wire messages, and compile nothing."""

import grpc
import numpy as np
import pytest

from meshserve.batching.sampling import SamplingParams
from meshserve.serving.grpc_api.stubs import generation_pb2 as pb
from meshserve.serving.grpc_api.stubs import generation_pb2_grpc as pb_grpc
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.core import Engine
from meshserve.serving.grpc_api.server import GenerationServer, ServerConfig
from tests.serving.fake_runner import (VOCAB, FakeModelRunner, reference_outputs,
                                       token_logprob, top_ids)
from tests.serving.served import pages_free, wait_for

CONFIG = dict(num_pages=40, page_size=4, max_num_seqs=4, max_num_batched_tokens=16,
              prefill_chunk=8, max_model_len=64, max_logprobs=3, compilation_cache=False)


def _engine(**overrides) -> Engine:
    config = EngineConfig(**(CONFIG | overrides))
    return Engine(FakeModelRunner(config), None, config)


def _prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, size=length).tolist()


def _run(engine: Engine, requests) -> list:
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return [finished[i] for i in ids]


def _greedy(max_tokens: int, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **fields)


def _workload(seed: int, num: int) -> list[tuple[list[int], SamplingParams]]:
    rng = np.random.default_rng(seed)
    return [(_prompt(int(rng.integers(1, 30)), seed * 100 + i),
             _greedy(int(rng.integers(1, 20)))) for i in range(num)]


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_every_request_gets_its_solo_tokens_in_any_company(policy):
    engine = _engine(policy=policy)
    requests = _workload(seed=1, num=12)
    outputs = _run(engine, requests)
    for (prompt, params), out in zip(requests, outputs):
        assert out.outputs[0].token_ids == reference_outputs(prompt, params.max_tokens)
        assert out.outputs[0].finish_reason == "length"
    assert engine.scheduler.kv_usage().num_used_pages == 0
    assert engine.runner.num_executed == engine.stats.num_steps


def test_preemption_under_few_pages_keeps_the_tokens():
    """Twelve requests in 14 pages of 4: requests are preempted and recomputed; the poisoned
    free pages would show any stale read."""
    engine = _engine(num_pages=14)
    requests = _workload(seed=2, num=12)
    outputs = _run(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for (prompt, params), out in zip(requests, outputs):
        assert out.outputs[0].token_ids == reference_outputs(prompt, params.max_tokens)


def test_data_parallel_replicas_keep_the_tokens():
    engine = _engine(mesh="data=2")
    requests = _workload(seed=3, num=10)
    for (prompt, params), out in zip(requests, _run(engine, requests)):
        assert out.outputs[0].token_ids == reference_outputs(prompt, params.max_tokens)


def test_a_stop_token_ends_the_request_on_it():
    prompt = _prompt(9, seed=4)
    want = reference_outputs(prompt, 12)
    stop = want[5]
    first = want.index(stop)
    (out,) = _run(_engine(), [(prompt, _greedy(12, stop_token_ids=[stop]))])
    completion = out.outputs[0]
    assert completion.token_ids == want[:first + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)


def test_logprobs_are_the_runners_for_every_token():
    prompt = _prompt(7, seed=5)
    (out,) = _run(_engine(), [(prompt, _greedy(6, logprobs=2))])
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 6
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert set(entry) == set(top_ids(token, 2))
        assert entry[token].logprob == pytest.approx(token_logprob(token))
        assert entry[token].rank == 1
    assert completion.cumulative_logprob == pytest.approx(
        sum(token_logprob(t) for t in completion.token_ids))


def test_an_abort_frees_the_pages_at_once():
    engine = _engine()
    keep = engine.add_request(_prompt(20, seed=6), _greedy(30))
    drop = engine.add_request(_prompt(20, seed=7), _greedy(30))
    for _ in range(4):
        engine.step()
    used = engine.scheduler.kv_usage().num_used_pages
    assert engine.abort(drop)
    assert engine.scheduler.kv_usage().num_used_pages < used
    finished = [o for outputs in iter(engine.step, []) for o in outputs if o.finished]
    assert [o.request_id for o in finished] == [keep]
    assert engine.scheduler.kv_usage().num_used_pages == 0


@pytest.fixture
def served():
    engine = _engine()
    server = GenerationServer(engine, ServerConfig(port=0))
    port = server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield server, pb_grpc.GenerationStub(channel)
    channel.close()
    server.stop()


def test_the_server_streams_exactly_the_runners_tokens(served):
    server, stub = served
    prompt = _prompt(11, seed=8)
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt), request_id="exact",
        sampling=pb.SamplingParams(max_tokens=15, temperature=0, ignore_eos=True, logprobs=1))
    responses = list(stub.Generate(request))
    chunks = [r.chunk for r in responses if r.HasField("chunk")]
    [final] = [r.final for r in responses if r.HasField("final")]
    streamed = [t for chunk in chunks for t in chunk.token_ids]
    assert streamed == reference_outputs(prompt, 15)
    assert {r.request_id for r in responses} == {"exact"}
    chosen = [lp.chosen for chunk in chunks for lp in chunk.logprobs]
    assert [c.token_id for c in chosen] == streamed
    assert [c.logprob for c in chosen] == pytest.approx([token_logprob(t) for t in streamed])
    assert (final.finish_reason, final.usage.prompt_tokens, final.usage.completion_tokens) == (
        "length", 11, 15)
    wait_for(lambda: pages_free(server))


def test_concurrent_streams_each_get_their_own_tokens(served):
    server, stub = served
    prompts = [_prompt(3 + 2 * i, seed=20 + i) for i in range(8)]
    calls = [stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=p),
        sampling=pb.SamplingParams(max_tokens=5 + i, temperature=0, ignore_eos=True)))
        for i, p in enumerate(prompts)]
    for i, (prompt, call) in enumerate(zip(prompts, calls)):
        tokens = [t for r in call if r.HasField("chunk") for t in r.chunk.token_ids]
        assert tokens == reference_outputs(prompt, 5 + i)
    wait_for(lambda: pages_free(server))
    assert server.engine.stats.compiles_after_warmup == 0
