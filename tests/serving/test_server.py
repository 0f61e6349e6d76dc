"""The gRPC server for real: a server on 127.0.0.1 (port 0) in this process, real gRPC clients.

On the tiny random Llama (token-id prompts), one shared server: streamed tokens and logprobs
against `LLM.generate`, bad input, server info, health and reflection. Servers with other settings
(cancellation, disconnects, deadlines, queue bounds, an api key, TLS, metrics, drain, an engine
that fails) are started per test on the arithmetic runner (`tests/serving/fake_runner.py`, nothing
compiled), behind a `StepGate`: the engine computes only the steps the test allows, so a request
that should have been stopped early cannot pass by finishing on its own, and busy seats stay busy
however fast or loaded the machine. The SIGTERM drain of a `meshserve serve` process, gRPC and
HTTP streams in flight, is in tests/serving/test_http.py.
"""

import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)

from meshserve.batching.sampling import SamplingParams
from meshserve.serving.grpc_api.stubs import generation_pb2 as pb
from meshserve.serving.grpc_api.stubs import generation_pb2_grpc as pb_grpc
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.core import Engine
from meshserve.serving.python_api.llm import LLM
from meshserve.serving.grpc_api.server import SERVICE_NAME, GenerationServer, ServerConfig
from tests.serving.fake_runner import VOCAB, FakeModelRunner
from tests.serving.served import (ENGINE, SMOL, StepGate, pages_free, prompt_ids, record_aborts,
                                  record_cancels, wait_for)

# The arithmetic runner's engine: room for 8 requests of 200 tokens, and 8 prompts of 12 tokens
# prefilled in one step.
FAKE = dict(num_pages=512, page_size=4, max_num_seqs=8, max_num_batched_tokens=128,
            prefill_chunk=16, max_model_len=512, max_logprobs=3, compilation_cache=False)


def _greedy(max_tokens: int, **fields) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **fields)


def _request(prompt: list[int], sampling: pb.SamplingParams, **fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling, **fields)


def _collect(responses) -> tuple[list[int], pb.Final]:
    tokens, final = [], None
    for response in responses:
        if response.HasField("chunk"):
            tokens += list(response.chunk.token_ids)
        else:
            final = response.final
    return tokens, final


def _start(llm: LLM, **config) -> tuple[GenerationServer, grpc.Channel]:
    server = GenerationServer(llm.engine, ServerConfig(port=0, **config))
    port = server.start()
    return server, grpc.insecure_channel(f"127.0.0.1:{port}")


@pytest.fixture
def start():
    """Starts gRPC servers with other settings on the arithmetic runner (nothing compiled), each
    engine behind a `StepGate` (shut at first with `shut=True`; `step_seconds` slows each step),
    and stops them afterwards (gate opened first), whatever the test did."""
    started = []

    def start_server(*, shut: bool = False, step_seconds: float = 0.0, **config):
        engine_config = EngineConfig(**FAKE)
        engine = Engine(FakeModelRunner(engine_config), None, engine_config)
        if step_seconds:
            step = engine.step
            engine.step = lambda: (time.sleep(step_seconds), step())[1]
        gate = StepGate(engine, shut=shut)
        server = GenerationServer(engine, ServerConfig(port=0, **config))
        channel = grpc.insecure_channel(f"127.0.0.1:{server.start()}")
        started.append((server, channel, gate))
        return server, pb_grpc.GenerationStub(channel), gate

    yield start_server
    for server, channel, gate in started:
        gate.open()
        channel.close()
        server.stop()


def _fake_prompt(seed: int, length: int = 12) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, size=length).tolist()


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", **ENGINE)


@pytest.fixture(scope="module")
def served(llm):
    server, channel = _start(llm)
    yield server, pb_grpc.GenerationStub(channel)
    channel.close()
    server.stop()


@pytest.fixture(scope="module")
def other_llm(llm):
    """An LLM with an engine of its own that is never served, on the served LLM's runner (its
    weights and compiled programs, nothing compiled twice): what `LLM.generate` gives. Engines
    sharing a runner take turns with its KV cache, so it runs only while the served engine is
    idle (every test here waits for its own requests to end)."""
    other = LLM.__new__(LLM)
    other.cluster, other.tokenizer = None, llm.tokenizer
    other.engine = Engine(llm.engine.runner, llm.tokenizer, llm.engine.config,
                          model=llm.engine.model)
    return other


@pytest.fixture(scope="module")
def reference(other_llm):
    """The tokens `LLM.generate` gives."""

    def tokens(prompts, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        outputs = other_llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]

    return tokens


def test_streamed_tokens_equal_llm_generate(served, reference):
    _, stub = served
    prompt = prompt_ids(0)
    responses = list(stub.Generate(_request(prompt, _greedy(12)), timeout=60))
    tokens, final = _collect(responses)
    assert tokens == reference([prompt], 12)[0]
    assert len(responses) > 2, "tokens are streamed as they come, not in one message"
    assert final.finish_reason == "length"
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (12, 12)
    assert {r.request_id for r in responses} == {responses[0].request_id} != {""}


def test_logprobs_and_a_given_request_id_come_back(served):
    _, stub = served
    responses = list(stub.Generate(_request(prompt_ids(1), _greedy(3, logprobs=2),
                                            request_id="mine"), timeout=60))
    assert {r.request_id for r in responses} == {"mine"}
    chunks = [r.chunk for r in responses if r.HasField("chunk")]
    logprobs = [lp for c in chunks for lp in c.logprobs]
    assert len(logprobs) == 3
    for lp, token in zip(logprobs, [t for c in chunks for t in c.token_ids]):
        assert lp.chosen.token_id == token and lp.chosen.logprob <= 0
        assert len(lp.top) == 2 and lp.top[0].rank == 1  # greedy: the chosen one is the top
        assert lp.top[0].token_id == token


def test_64_concurrent_streams_all_complete_correctly(served, reference):
    _, stub = served
    prompts = [prompt_ids(100 + i, length=4 + i % 20) for i in range(64)]
    want = reference(prompts, 6)
    with futures.ThreadPoolExecutor(64) as pool:
        got = list(pool.map(
            lambda p: _collect(stub.Generate(_request(p, _greedy(6)), timeout=120))[0], prompts))
    assert got == want


def test_a_cancel_mid_stream_stops_the_request_at_once_and_frees_its_pages(start):
    server, stub, gate = start(shut=True)
    cancelled, aborted = record_cancels(server.loop), record_aborts(server.loop)
    call = stub.Generate(_request(_fake_prompt(2), _greedy(200), request_id="gone"), timeout=60)
    gate.allow(2)  # the prompt's step and one decode: 2 tokens of 200
    next(call), next(call)
    assert server.engine.scheduler.kv_usage().num_used_pages > 0
    call.cancel()
    wait_for(lambda: cancelled == ["gone"])  # the disconnect callback reached the engine loop
    gate.open()
    wait_for(lambda: pages_free(server))
    assert aborted == ["gone"] and server.engine.stats.num_steps == 2  # not its 200 tokens


_KILLED_CLIENT = """
import sys, grpc
from meshserve.serving.grpc_api.stubs import generation_pb2 as pb, generation_pb2_grpc as pb_grpc
stub = pb_grpc.GenerationStub(grpc.insecure_channel(sys.argv[1]))
request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[int(t) for t in sys.argv[2:]]),
                             request_id="killed", sampling=pb.SamplingParams(
                                 max_tokens=200, temperature=0, ignore_eos=True))
for response in stub.Generate(request, timeout=60):
    print(len(response.chunk.token_ids), flush=True)
"""


def test_a_client_process_that_dies_mid_stream_has_its_request_stopped(start):
    """The client's process is killed (its connection drops, nothing is cancelled politely):
    the server's disconnect callback aborts the request at the next step."""
    server, _, gate = start(shut=True)
    cancelled, aborted = record_cancels(server.loop), record_aborts(server.loop)
    client = subprocess.Popen([sys.executable, "-c", _KILLED_CLIENT, f"127.0.0.1:{server.port}",
                               *map(str, _fake_prompt(3))], stdout=subprocess.PIPE, text=True)
    try:
        gate.allow(2)
        assert [client.stdout.readline(), client.stdout.readline()] == ["1\n", "1\n"]
    finally:
        client.kill()
        client.wait()
    wait_for(lambda: cancelled == ["killed"])
    gate.open()
    wait_for(lambda: pages_free(server))
    assert aborted == ["killed"] and server.engine.stats.num_steps == 2


def test_abort_by_id_ends_the_stream_with_abort(served):
    server, stub = served
    call = stub.Generate(_request(prompt_ids(3), _greedy(200), request_id="to-abort"), timeout=60)
    next(call)
    assert stub.Abort(pb.AbortRequest(request_id="to-abort")).aborted
    _, final = _collect(call)
    assert final.finish_reason == "abort"
    assert not stub.Abort(pb.AbortRequest(request_id="to-abort")).aborted
    wait_for(lambda: pages_free(server))


def test_a_passed_deadline_is_deadline_exceeded_and_stops_the_request(start):
    server, stub, gate = start(shut=True)
    aborted = record_aborts(server.loop)
    call = stub.Generate(_request(_fake_prompt(4), _greedy(200), request_id="late"), timeout=0.5)
    gate.allow(2)
    with pytest.raises(grpc.RpcError) as err:
        _collect(call)
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: aborted == ["late"])  # while no step can run: the deadline ended it
    gate.open()
    wait_for(lambda: pages_free(server))
    assert server.engine.stats.num_steps <= 2  # of 200


@pytest.mark.parametrize("request_,field", [
    (_request([5, 6], pb.SamplingParams(temperature=-1)), "temperature"),
    (_request([5, 6], pb.SamplingParams(max_tokens=0)), "max_tokens"),
    (_request([5, 6], pb.SamplingParams(top_p=2)), "top_p"),
    (_request([], pb.SamplingParams()), "empty"),
    (_request([5, 100000], pb.SamplingParams()), "outside the vocabulary"),
    (_request(list(range(2, 300)), pb.SamplingParams()), "max prompt length"),
    (pb.GenerateRequest(sampling=pb.SamplingParams()), "set one of text, token_ids or chat"),
    (pb.GenerateRequest(text="hello"), "no tokenizer"),
    (_request(prompt_ids(9), pb.SamplingParams(max_tokens=250)), "max_model_len"),
])
def test_bad_input_is_invalid_argument_naming_the_field(served, request_, field):
    _, stub = served
    with pytest.raises(grpc.RpcError) as err:
        _collect(stub.Generate(request_, timeout=30))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()


def test_an_engine_has_one_server(served, llm):
    with pytest.raises(ValueError, match="already served by another GenerationServer"):
        GenerationServer(llm.engine, ServerConfig(port=0)).start()


def test_server_info_health_and_reflection(served, llm):
    server, stub = served
    info = stub.GetServerInfo(pb.GetServerInfoRequest())
    assert (info.model, info.mesh, info.max_model_len) == ("tiny-llama", "data=1,stage=1,model=1",
                                                           256)
    assert info.version and info.vocab_size == 512
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert SERVICE_NAME in services and "grpc.health.v1.Health" in services
    channel.close()


def test_a_full_queue_is_resource_exhausted_at_once(start):
    """All 8 seats busy: one 15-token prompt waits, and the next one would take the queued
    prompt tokens past 20. A prompt that alone exceeds the bound can never run: it is invalid.
    The engine steps only while seating, so no seat frees before the end."""
    server, stub, gate = start(shut=True, max_queued_prompt_tokens=20)
    seated = []
    for i in range(8):  # one at a time, so the queue never holds two of them
        seated.append(stub.Generate(_request(_fake_prompt(i), _greedy(200)), timeout=60))
        gate.step_until(lambda: server.loop.load.num_running == i + 1)
    waiting = stub.Generate(_request(_fake_prompt(50, length=15), _greedy(2)), timeout=60)
    wait_for(lambda: server.loop.load.num_waiting == 1)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        _collect(stub.Generate(_request(_fake_prompt(51, length=15), _greedy(2)), timeout=30))
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_queued_prompt_tokens=20" in err.value.details()
    assert time.monotonic() - started < 5
    with pytest.raises(grpc.RpcError) as err:
        _collect(stub.Generate(_request(_fake_prompt(52, length=21), _greedy(2)), timeout=30))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "max prompt length of 20" in err.value.details()
    assert server.loop.load.num_running == 8  # no seat freed meanwhile
    for call in seated:
        call.cancel()
    gate.open()
    assert _collect(waiting)[1].finish_reason == "length"
    wait_for(lambda: pages_free(server))


def test_the_request_bound_refuses_the_excess_of_a_burst(start):
    """40 requests at once with room for 2 in the queue, and no step until the other 38 have
    their answer: exactly 2 are admitted, and they complete."""
    server, stub, gate = start(shut=True, max_queued_requests=2)

    def one(i):
        try:
            return _collect(stub.Generate(_request(_fake_prompt(i), _greedy(40)), timeout=60))[1]
        except grpc.RpcError as err:
            return err.code()

    with futures.ThreadPoolExecutor(40) as pool:
        calls = [pool.submit(one, i) for i in range(40)]
        wait_for(lambda: sum(call.done() for call in calls) == 38)
        gate.open()
        results = [call.result() for call in calls]
    refused = [r for r in results if r is grpc.StatusCode.RESOURCE_EXHAUSTED]
    done = [r for r in results if isinstance(r, pb.Final)]
    assert (len(refused), len(done)) == (38, 2)
    assert all(final.finish_reason == "length" for final in done)
    wait_for(lambda: pages_free(server))


def test_max_queue_time_fails_the_requests_left_waiting(start):
    """8 requests take the 8 seats (each seated by the step after it arrives), then no step
    runs: the 4 that come next wait past the max queue time and fail; the 8 then finish."""
    server, stub, gate = start(shut=True, max_queue_time=0.5)
    seated = []
    for i in range(8):
        seated.append(stub.Generate(_request(_fake_prompt(i), _greedy(120)), timeout=60))
        gate.step_until(lambda: server.loop.load.num_running == i + 1)
    late = [stub.Generate(_request(_fake_prompt(i), _greedy(120)), timeout=60)
            for i in range(8, 12)]
    for call in late:
        with pytest.raises(grpc.RpcError) as err:
            _collect(call)
        assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "max queue time of 0.5 s" in err.value.details()
    gate.open()
    assert [_collect(call)[1].finish_reason for call in seated] == ["length"] * 8
    wait_for(lambda: pages_free(server))


def test_an_api_key_is_required_on_generation_but_not_on_health(start, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    server, stub, _ = start(api_key_file=str(key_file))
    for metadata in (None, (("authorization", "Bearer wrong"),)):
        with pytest.raises(grpc.RpcError) as err:
            _collect(stub.Generate(_request([5, 6], _greedy(2)), metadata=metadata, timeout=30))
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=metadata)
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
    for scheme in ("Bearer", "bearer", "BEARER"):  # the scheme is case-insensitive
        good = (("authorization", f"{scheme} s3cret"),)
        assert _collect(stub.Generate(_request([5, 6], _greedy(2)), metadata=good,
                                      timeout=30))[1]
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == (
            health_pb2.HealthCheckResponse.SERVING)


def test_tls_serves_a_client_that_trusts_the_certificate_and_refuses_plaintext(start, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    server, _, _ = start(tls_cert=str(cert), tls_key=str(key))
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    with grpc.secure_channel(f"localhost:{server.port}", credentials) as secure:
        stub = pb_grpc.GenerationStub(secure)
        assert _collect(stub.Generate(_request([5, 6], _greedy(2)), timeout=30))[1]
    with grpc.insecure_channel(f"localhost:{server.port}") as plain:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.GenerationStub(plain).GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE


def test_an_engine_failure_flips_health_and_fails_streams_with_internal(start):
    server, stub, _ = start()
    step, calls = server.engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("device lost")
        return step()

    server.engine.step = failing_step
    statuses = []
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    health = health_pb2_grpc.HealthStub(channel)

    def watch():
        try:
            for response in health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                         timeout=30):
                statuses.append(response.status)
        except grpc.RpcError:
            pass  # the server went down after reporting NOT_SERVING

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with pytest.raises(grpc.RpcError) as err:
        _collect(stub.Generate(_request(_fake_prompt(6), _greedy(50)), timeout=30))
    assert err.value.code() is grpc.StatusCode.INTERNAL
    assert "device lost" in err.value.details()
    assert server.wait() is False
    watcher.join(timeout=10)
    assert statuses[-1] == health_pb2.HealthCheckResponse.NOT_SERVING
    channel.close()


def test_a_bounded_load_test_loses_nothing(start):
    """8 clients x 12 requests, some cancelled and some with tight deadlines, against small
    queue bounds: every request ends completed or with an explicit status, every cancelled one
    was aborted before its end (it asks for 400 tokens: 0.8 s of 2 ms steps), and the pages are
    all free at the end."""
    server, stub, _ = start(step_seconds=0.002, max_queued_requests=6)
    aborted = record_aborts(server.loop)
    rng = np.random.default_rng(7)
    outcomes, cancelled = [], []

    def client(c):
        for i in range(12):
            prompt = _fake_prompt(1000 + 12 * c + i, length=int(rng.integers(2, 60)))
            timeout = 0.2 if i % 5 == 4 else 60
            try:
                if i % 7 == 6:
                    call = stub.Generate(_request(prompt, _greedy(400), request_id=f"c{c}"),
                                         timeout=timeout)
                    next(call)
                    call.cancel()
                    cancelled.append(f"c{c}")
                    outcomes.append("cancelled")
                    continue
                call = stub.Generate(_request(prompt, _greedy(int(rng.integers(1, 30)))),
                                     timeout=timeout)
                outcomes.append(_collect(call)[1].finish_reason)
            except grpc.RpcError as err:
                outcomes.append(err.code().name)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(8)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert time.monotonic() - started < 120 and not any(t.is_alive() for t in threads)
    assert len(outcomes) == 96
    assert set(outcomes) <= {"length", "cancelled", "CANCELLED", "RESOURCE_EXHAUSTED",
                             "DEADLINE_EXCEEDED"}, set(outcomes)
    assert outcomes.count("length") > 0 and cancelled
    wait_for(lambda: pages_free(server))
    assert set(cancelled) <= set(aborted)
    assert not server._inflight


def test_metrics_are_scraped_over_http(start):
    import urllib.request

    server, stub, _ = start(metrics_port=0)
    _collect(stub.Generate(_request(_fake_prompt(11), _greedy(5)), timeout=30))
    with pytest.raises(grpc.RpcError):
        _collect(stub.Generate(_request([5], pb.SamplingParams(temperature=-1)), timeout=30))
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                  timeout=10).read().decode()
    model = 'model_name="fake-arithmetic"'
    assert f"meshserve:generation_tokens_total{{{model}}} 5.0" in text
    assert f"meshserve:time_to_first_token_seconds_count{{{model}}} 1.0" in text
    assert f'meshserve:requests_rejected_total{{{model},reason="invalid"}} 1.0' in text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_preemptions_total", "prompt_tokens_total", "e2e_request_latency_seconds",
                 "inter_token_latency_seconds", "prefill_padding_ratio", "recompiles_total",
                 "stage_utilisation"):
        assert f"meshserve:{name}" in text, name


def test_drain_refuses_new_requests_and_lets_in_flight_ones_finish(start):
    """No step runs between the first token and the drain's refusals, so the request is still
    in flight when the drain starts; it then runs to its end."""
    server, stub, gate = start(shut=True)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    health = health_pb2_grpc.HealthStub(channel)
    call = stub.Generate(_request(_fake_prompt(12), _greedy(240)), timeout=60)
    gate.allow(2)
    first = next(call)
    drainer = threading.Thread(target=server.drain, kwargs=dict(timeout=60))
    drainer.start()
    wait_for(lambda: health.Check(health_pb2.HealthCheckRequest()).status
             == health_pb2.HealthCheckResponse.NOT_SERVING)
    with pytest.raises(grpc.RpcError) as err:
        _collect(stub.Generate(_request([5, 6], _greedy(2)), timeout=30))
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
    assert server.engine.stats.num_steps <= 2
    gate.open()
    tokens, final = _collect(call)
    assert final.finish_reason == "length" and len(first.chunk.token_ids) + len(tokens) == 240
    drainer.join(timeout=60)
    assert server.wait() is True
    assert pages_free(server)
    channel.close()


@pytest.mark.slow
def test_smollm2_chat_stream_adds_up_to_llm_chat_with_a_stop_string():
    llm = LLM("smollm2-135m-instruct", **SMOL)
    messages = [{"role": "user", "content": "Count from one to ten in words."}]
    params = SamplingParams(max_tokens=40, temperature=0, stop=["5."])
    want = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    server, channel = _start(llm)
    try:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(
            chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in messages]),
            sampling=pb.SamplingParams(max_tokens=40, temperature=0, stop=["5."]))
        responses = list(stub.Generate(request, timeout=120))
        streamed = "".join(r.chunk.text for r in responses if r.HasField("chunk"))
        final = responses[-1].final
        assert streamed == final.text == want.text and "5." not in streamed
        assert (final.finish_reason, final.stop_reason) == ("stop", "5.")
    finally:
        channel.close()
        server.stop()


def test_prompt_logprobs_come_in_the_final_message(served, other_llm):
    _, stub = served
    prompt = prompt_ids(13, length=9)
    responses = list(stub.Generate(_request(prompt, _greedy(2, prompt_logprobs=3)), timeout=60))
    final = responses[-1].final
    assert [lp.chosen.token_id for lp in final.prompt_logprobs] == prompt[1:]
    assert all(len(lp.top) == 3 and [t.rank for t in lp.top] == [1, 2, 3]
               for lp in final.prompt_logprobs)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=3)
    want = other_llm.generate([prompt], params, use_tqdm=False)[0]
    np.testing.assert_allclose([lp.chosen.logprob for lp in final.prompt_logprobs],
                               [e[t].logprob for t, e in zip(prompt[1:], want.prompt_logprobs[1:])],
                               atol=1e-5)
