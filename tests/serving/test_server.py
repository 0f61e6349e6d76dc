"""The gRPC server for real: a server on 127.0.0.1 (port 0) in this process, real gRPC clients.

Most tests share one server on the tiny random Llama (token-id prompts). Servers with other
settings (small queues, an api key, TLS, an engine that fails) are started per test. The drain
test runs `meshserve serve` in a subprocess and sends it SIGTERM.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)

from meshserve.batching.sampling import SamplingParams
from meshserve.serving.api import generation_pb2 as pb
from meshserve.serving.api import generation_pb2_grpc as pb_grpc
from meshserve.serving.llm import LLM
from meshserve.serving.server import SERVICE_NAME, GenerationServer, ServerConfig
from tests.serving.served import ENGINE, pages_free, prompt_ids, wait_for



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
def start(spare_llm):
    """Starts servers with other settings on a second engine (an engine has one server at a
    time) and stops them afterwards, whatever the test did."""
    started = []

    def start_server(**config):
        server, channel = _start(spare_llm, **config)
        started.append((server, channel))
        return server, channel

    yield start_server
    for server, channel in started:
        channel.close()
        server.stop()



@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", **ENGINE)


@pytest.fixture(scope="module")
def spare_llm():
    return LLM("tiny-llama", **ENGINE)


@pytest.fixture(scope="module")
def served(llm):
    server, channel = _start(llm)
    yield server, pb_grpc.GenerationStub(channel)
    channel.close()
    server.stop()


@pytest.fixture(scope="module")
def reference():
    """Tokens that `LLM.generate` gives, from a separate LLM with the same weights."""
    other = LLM("tiny-llama", **ENGINE)

    def tokens(prompts, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        outputs = other.generate(prompts, params, use_tqdm=False)
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


def test_a_cancel_mid_stream_frees_the_pages(served):
    server, stub = served
    call = stub.Generate(_request(prompt_ids(2), _greedy(200)), timeout=60)
    next(call), next(call)  # streaming
    assert server.engine.scheduler.kv_usage().num_used_pages > 0
    call.cancel()
    wait_for(lambda: pages_free(server))


def test_abort_by_id_ends_the_stream_with_abort(served):
    server, stub = served
    call = stub.Generate(_request(prompt_ids(3), _greedy(200), request_id="to-abort"), timeout=60)
    next(call)
    assert stub.Abort(pb.AbortRequest(request_id="to-abort")).aborted
    _, final = _collect(call)
    assert final.finish_reason == "abort"
    assert not stub.Abort(pb.AbortRequest(request_id="to-abort")).aborted
    wait_for(lambda: pages_free(server))


def test_a_passed_deadline_is_deadline_exceeded_and_frees_pages(served):
    server, stub = served
    with pytest.raises(grpc.RpcError) as err:
        _collect(stub.Generate(_request(prompt_ids(4), _greedy(240)), timeout=0.3))
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: pages_free(server))


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
    prompt tokens past 20. A prompt that alone exceeds the bound can never run: it is invalid."""
    server, channel = start(max_queued_prompt_tokens=20)
    stub = pb_grpc.GenerationStub(channel)
    seated = []
    for i in range(8):  # one at a time, so the queue never holds two of them
        seated.append(stub.Generate(_request(prompt_ids(i), _greedy(200)), timeout=60))
        next(seated[-1])
    waiting = stub.Generate(_request(prompt_ids(50, length=15), _greedy(2)), timeout=60)
    wait_for(lambda: server.engine.scheduler.num_waiting == 1)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        _collect(stub.Generate(_request(prompt_ids(51, length=15), _greedy(2)), timeout=30))
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_queued_prompt_tokens=20" in err.value.details()
    assert time.monotonic() - started < 5
    with pytest.raises(grpc.RpcError) as err:
        _collect(stub.Generate(_request(prompt_ids(52, length=21), _greedy(2)), timeout=30))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "max prompt length of 20" in err.value.details()
    for call in seated:
        call.cancel()
    assert _collect(waiting)[1].finish_reason == "length"
    wait_for(lambda: pages_free(server))


def test_the_request_bound_refuses_the_excess_of_a_burst(start):
    server, channel = start(max_queued_requests=2)
    stub = pb_grpc.GenerationStub(channel)

    def one(i):
        try:
            return _collect(stub.Generate(_request(prompt_ids(i), _greedy(40)), timeout=60))[1]
        except grpc.RpcError as err:
            return err.code()

    with futures.ThreadPoolExecutor(40) as pool:
        results = list(pool.map(one, range(40)))
    refused = [r for r in results if r is grpc.StatusCode.RESOURCE_EXHAUSTED]
    done = [r for r in results if isinstance(r, pb.Final)]
    assert refused and done and len(refused) + len(done) == 40
    wait_for(lambda: pages_free(server))


def test_max_queue_time_fails_a_waiting_request(start):
    server, channel = start(max_queue_time=0.2)
    stub = pb_grpc.GenerationStub(channel)
    calls = [stub.Generate(_request(prompt_ids(i), _greedy(120)), timeout=60) for i in range(12)]
    codes = []
    for call in calls:  # 8 seats: the last 4 wait far longer than 0.2 s
        try:
            _collect(call)
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as err:
            codes.append(err.code())
    assert grpc.StatusCode.DEADLINE_EXCEEDED in codes and grpc.StatusCode.OK in codes
    wait_for(lambda: pages_free(server))


def test_an_api_key_is_required_on_generation_but_not_on_health(start, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    server, channel = start(api_key_file=str(key_file))
    stub = pb_grpc.GenerationStub(channel)
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
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest()).status == (
        health_pb2.HealthCheckResponse.SERVING)


def test_tls_serves_a_client_that_trusts_the_certificate_and_refuses_plaintext(spare_llm,
                                                                               tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    server = GenerationServer(spare_llm.engine, ServerConfig(port=0, tls_cert=str(cert),
                                                             tls_key=str(key)))
    port = server.start()
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(f"localhost:{port}", credentials) as secure:
            stub = pb_grpc.GenerationStub(secure)
            assert _collect(stub.Generate(_request([5, 6], _greedy(2)), timeout=30))[1]
        with grpc.insecure_channel(f"localhost:{port}") as plain:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.GenerationStub(plain).GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_an_engine_failure_flips_health_and_fails_streams_with_internal():
    llm = LLM("tiny-llama", **ENGINE)
    server, channel = _start(llm)
    stub = pb_grpc.GenerationStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    step, calls = llm.engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("device lost")
        return step()

    llm.engine.step = failing_step
    statuses = []

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
        _collect(stub.Generate(_request(prompt_ids(6), _greedy(50)), timeout=30))
    assert err.value.code() is grpc.StatusCode.INTERNAL
    assert "device lost" in err.value.details()
    assert server.wait() is False
    watcher.join(timeout=10)
    assert statuses[-1] == health_pb2.HealthCheckResponse.NOT_SERVING
    channel.close()


def test_a_bounded_load_test_loses_nothing(start):
    """8 clients x 12 requests, some cancelled and some with tight deadlines, against small
    queue bounds: every request ends completed or with an explicit status, and the pages are all
    free at the end."""
    server, channel = start(max_queued_requests=6)
    stub = pb_grpc.GenerationStub(channel)
    rng = np.random.default_rng(7)
    outcomes = []

    def client(c):
        for i in range(12):
            prompt = prompt_ids(1000 + 12 * c + i, length=int(rng.integers(2, 60)))
            timeout = 0.2 if i % 5 == 4 else 60
            try:
                call = stub.Generate(_request(prompt, _greedy(int(rng.integers(1, 30)))),
                                     timeout=timeout)
                if i % 7 == 6:
                    next(call)
                    call.cancel()
                    outcomes.append("cancelled")
                    continue
                final = _collect(call)[1]
                outcomes.append(final.finish_reason)
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
    assert outcomes.count("length") > 0
    wait_for(lambda: pages_free(server))
    assert not server._inflight


@pytest.mark.slow
def test_sigterm_drains_in_flight_streams_then_exits_zero(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "meshserve"), "serve", "--model", "tiny-llama",
         "--port", "0", "--no-compilation-cache", "--no-warmup", "--max-model-len", "256",
         "--num-pages", "64"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env)
    try:
        line = ""
        while "serving" not in line:
            line = process.stdout.readline()
            assert line or process.poll() is None, "the server died before serving"
        port = int(line.split(":")[-1].split()[0])
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.GenerationStub(channel)
        call = stub.Generate(_request(prompt_ids(8), _greedy(120)), timeout=60)
        first = next(call)
        process.send_signal(signal.SIGTERM)
        tokens, final = _collect(call)
        assert final.finish_reason == "length" and len(first.chunk.token_ids) + len(tokens) == 120
        assert process.wait(timeout=60) == 0
        assert "drained" in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()


def test_metrics_are_scraped_over_http(start):
    import urllib.request

    server, channel = start(metrics_port=0)
    stub = pb_grpc.GenerationStub(channel)
    _collect(stub.Generate(_request(prompt_ids(11), _greedy(5)), timeout=30))
    with pytest.raises(grpc.RpcError):
        _collect(stub.Generate(_request([5], pb.SamplingParams(temperature=-1)), timeout=30))
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                  timeout=10).read().decode()
    assert 'meshserve:generation_tokens_total{model_name="tiny-llama"} 5.0' in text
    assert 'meshserve:time_to_first_token_seconds_count{model_name="tiny-llama"} 1.0' in text
    assert 'meshserve:requests_rejected_total{model_name="tiny-llama",reason="invalid"} 1.0' in text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_preemptions_total", "prompt_tokens_total", "e2e_request_latency_seconds",
                 "inter_token_latency_seconds", "prefill_padding_ratio", "recompiles_total",
                 "stage_utilisation"):
        assert f"meshserve:{name}" in text, name


def test_drain_refuses_new_requests_and_lets_in_flight_ones_finish(start):
    server, channel = start()
    stub = pb_grpc.GenerationStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    call = stub.Generate(_request(prompt_ids(12), _greedy(240)), timeout=60)
    first = next(call)
    drainer = threading.Thread(target=server.drain, kwargs=dict(timeout=60))
    drainer.start()
    wait_for(lambda: health.Check(health_pb2.HealthCheckRequest()).status
              == health_pb2.HealthCheckResponse.NOT_SERVING)
    with pytest.raises(grpc.RpcError) as err:
        _collect(stub.Generate(_request([5, 6], _greedy(2)), timeout=30))
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
    tokens, final = _collect(call)
    assert final.finish_reason == "length" and len(first.chunk.token_ids) + len(tokens) == 240
    drainer.join(timeout=60)
    assert server.wait() is True
    assert pages_free(server)


@pytest.mark.slow
def test_smollm2_chat_stream_adds_up_to_llm_chat_with_a_stop_string():
    llm = LLM("smollm2-135m-instruct", **ENGINE)
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


def test_prompt_logprobs_come_in_the_final_message(served, llm):
    _, stub = served
    prompt = prompt_ids(13, length=9)
    responses = list(stub.Generate(_request(prompt, _greedy(2, prompt_logprobs=3)), timeout=60))
    final = responses[-1].final
    assert [lp.chosen.token_id for lp in final.prompt_logprobs] == prompt[1:]
    assert all(len(lp.top) == 3 and [t.rank for t in lp.top] == [1, 2, 3]
               for lp in final.prompt_logprobs)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=3)
    want = LLM("tiny-llama", **ENGINE).generate([prompt], params, use_tqdm=False)[0]
    np.testing.assert_allclose([lp.chosen.logprob for lp in final.prompt_logprobs],
                               [e[t].logprob for t, e in zip(prompt[1:], want.prompt_logprobs[1:])],
                               atol=1e-5)
