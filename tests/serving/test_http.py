"""The OpenAI-compatible HTTP front end (`meshserve.serving.http_api.app`) for real: uvicorn on
127.0.0.1 (port 0) beside the gRPC server, on one engine loop.

On the arithmetic runner (`tests/serving/fake_runner.py`, nothing compiled): exact streamed tokens,
64 concurrent streaming clients with random disconnects, every error status, the drain. Tests of
disconnects and a full queue hold the engine behind a `StepGate`, which runs only the steps the
test allows: a request that a disconnect should stop cannot pass by finishing on its own, and busy
seats stay busy however fast or loaded the machine. On SmolLM2: the official `openai` client,
plain and streamed, against `LLM.generate` and `LLM.chat`.
"""

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import numpy as np
import pytest

from meshserve.batching.sampling import SamplingParams
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.core import Engine
from meshserve.serving.python_api.llm import LLM
from meshserve.serving.grpc_api.server import GenerationServer, ServerConfig
from tests.serving.fake_runner import VOCAB, FakeModelRunner, reference_outputs
from tests.serving.served import SMOL, StepGate, record_aborts, record_cancels, wait_for

FAKE = dict(num_pages=256, page_size=4, max_num_seqs=8, max_num_batched_tokens=32,
            prefill_chunk=16, max_model_len=96, max_logprobs=3, compilation_cache=False)


def _fake_server(step_seconds: float = 0.0, **config) -> GenerationServer:
    engine_config = EngineConfig(**FAKE)
    engine = Engine(FakeModelRunner(engine_config), None, engine_config)
    if step_seconds:
        step = engine.step
        engine.step = lambda: (time.sleep(step_seconds), step())[1]
    server = GenerationServer(engine, ServerConfig(port=0, http_port=0, **config))
    server.start()
    return server


@pytest.fixture
def gated():
    """A server on the arithmetic runner whose engine steps only as its `StepGate` allows (shut
    at first); stopped afterwards, gate opened first."""
    engine_config = EngineConfig(**FAKE)
    engine = Engine(FakeModelRunner(engine_config), None, engine_config)
    gate = StepGate(engine, shut=True)
    server = GenerationServer(engine, ServerConfig(port=0, http_port=0, max_queued_requests=1))
    server.start()
    yield server, gate
    gate.open()
    server.stop()


def _prompt(seed: int, length: int = 8) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, size=length).tolist()


def _post(server, path: str, body: dict, headers: dict | None = None, timeout: float = 30):
    """(status, headers, parsed JSON) of one request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body),
                     {"Content-Type": "application/json"} | (headers or {}))
        response = conn.getresponse()
        return (response.status, {k.lower(): v for k, v in response.getheaders()},
                json.loads(response.read()))
    finally:
        conn.close()


def _get(server, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _open_stream(server, body: dict):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body | {"stream": True}),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    return conn, response


def _events(response):
    """The SSE events' JSON bodies, up to `data: [DONE]` (which ends the iteration)."""
    for raw in response:
        line = raw.decode().strip()
        if not line:
            continue
        assert line.startswith("data: "), line
        if line == "data: [DONE]":
            return
        yield json.loads(line[len("data: "):])


def _streamed_tokens(events) -> tuple[list[int], str | None]:
    tokens, finish = [], None
    for event in events:
        assert "error" not in event, event
        for choice in event["choices"]:
            if choice["logprobs"]:
                tokens += [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
            finish = choice["finish_reason"] or finish
    return tokens, finish


def _pages_free(server) -> bool:
    scheduler = server.engine.scheduler
    return (not scheduler.has_unfinished() and scheduler.kv_usage().num_used_pages == 0
            and server.loop.num_inflight() == 0)


@pytest.fixture(scope="module")
def fake():
    server = _fake_server(step_seconds=0.002)
    yield server
    server.stop()


def test_a_stream_carries_the_exact_tokens_and_usage(fake):
    prompt = _prompt(1)
    conn, response = _open_stream(fake, {"prompt": prompt, "max_tokens": 12, "logprobs": 1,
                                         "stream_options": {"include_usage": True}})
    events = list(_events(response))
    conn.close()
    tokens, finish = _streamed_tokens(events[:-1])
    assert tokens == reference_outputs(prompt, 12) and finish == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12
    assert events[-1]["usage"]["prompt_tokens"] == 8 and len(events) > 3


def test_a_whole_completion_and_the_models_and_health(fake):
    prompt = _prompt(2)
    status, _, body = _post(fake, "/v1/completions", {"model": "fake-arithmetic",
                                                      "prompt": prompt, "max_tokens": 5,
                                                      "logprobs": 2})
    assert status == 200 and body["object"] == "text_completion"
    choice = body["choices"][0]
    assert [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]] == (
        reference_outputs(prompt, 5))
    assert all(len(top) == 2 for top in choice["logprobs"]["top_logprobs"])
    assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 5, "total_tokens": 13,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    status, models = _get(fake, "/v1/models")
    assert status == 200 and json.loads(models)["data"][0]["id"] == "fake-arithmetic"
    assert _get(fake, "/health") == (200, b'{"status":"serving"}')
    status, metrics = _get(fake, "/metrics")
    assert status == 200 and b"meshserve:generation_tokens_total" in metrics


def test_64_concurrent_streams_with_random_disconnects_lose_nothing(fake, monkeypatch):
    """Every stream ends with its exact tokens, or was dropped by its client, and then aborted
    before its end (a dropped stream asks for every token its length allows: at least 66, so
    over 130 ms of 2 ms steps); the engine then holds no request and no page."""
    rng = np.random.default_rng(3)
    plans = []
    for i in range(64):
        prompt = _prompt(100 + i, int(rng.integers(1, 30)))
        drop_after = int(rng.integers(1, 6)) if rng.random() < 0.4 else None
        max_tokens = int(rng.integers(4, 50)) if drop_after is None else 95 - len(prompt)
        plans.append((prompt, max_tokens, drop_after))
    aborted = record_aborts(fake.loop, monkeypatch)

    def client(plan):
        prompt, max_tokens, drop_after = plan
        conn, response = _open_stream(fake, {"prompt": prompt, "max_tokens": max_tokens,
                                             "logprobs": 0})
        events = _events(response)
        if drop_after is not None:
            request_id = [event["id"] for _, event in zip(range(drop_after), events)][0]
            conn.sock.shutdown(2)  # gone mid-stream
            conn.close()
            return request_id
        tokens, finish = _streamed_tokens(events)
        conn.close()
        assert tokens == reference_outputs(prompt, max_tokens) and finish == "length"
        return "completed"

    with futures.ThreadPoolExecutor(64) as pool:
        outcomes = list(pool.map(client, plans))
    dropped = {o for o in outcomes if o != "completed"}
    assert outcomes.count("completed") == sum(p[2] is None for p in plans) > 0
    assert len(dropped) == sum(p[2] is not None for p in plans) > 0
    wait_for(lambda: _pages_free(fake), timeout=30)
    assert set(aborted) == dropped


def test_the_load_generator_drives_the_http_front_end(fake):
    from meshserve.serving.bench.workloads import BenchRequest
    from meshserve.serving.bench.loadgen import run_online

    requests = [BenchRequest(prompt_token_ids=_prompt(200 + i, 3 + i), num_output_tokens=4 + i)
                for i in range(12)]
    timings, wall = run_online(f"127.0.0.1:{fake.http_port}", requests, rate=100.0, seed=1,
                               timeout=60, frontend="http")
    assert [t.error for t in timings] == [None] * 12 and wall > 0
    assert [sum(t.chunk_tokens) for t in timings] == [r.num_output_tokens for r in requests]
    bad = BenchRequest(prompt_token_ids=[VOCAB + 3], num_output_tokens=2)
    timings, _ = run_online(f"127.0.0.1:{fake.http_port}", [bad], timeout=60, frontend="http")
    assert timings[0].error == "INVALID_ARGUMENT"


def test_a_client_that_disconnects_mid_stream_has_its_request_stopped(gated):
    server, gate = gated
    cancelled, aborted = record_cancels(server.loop), record_aborts(server.loop)
    conn, response = _open_stream(server, {"prompt": _prompt(4), "max_tokens": 80,
                                           "logprobs": 0})
    gate.allow(2)  # the prompt's step and one decode: 2 tokens of 80
    events = _events(response)
    request_id = next(events)["id"]
    next(events)
    assert server.engine.scheduler.kv_usage().num_used_pages > 0
    conn.sock.shutdown(2)
    conn.close()
    wait_for(lambda: cancelled == [request_id])  # the disconnect reached the engine loop
    gate.open()
    wait_for(lambda: _pages_free(server))
    assert aborted == [request_id] and server.engine.stats.num_steps == 2  # not its 80 tokens


def test_a_client_that_disconnects_before_a_whole_completion_has_its_request_stopped(gated):
    """Not streamed: the server notices the disconnect while it waits for the whole answer."""
    server, gate = gated
    cancelled, aborted = record_cancels(server.loop), record_aborts(server.loop)
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": _prompt(5), "max_tokens": 80}),
                 {"Content-Type": "application/json"})
    gate.allow(2)
    wait_for(lambda: server.engine.stats.num_steps == 2)
    conn.sock.shutdown(2)
    conn.close()
    wait_for(lambda: len(cancelled) == 1)
    gate.open()
    wait_for(lambda: _pages_free(server))
    assert aborted == cancelled and server.engine.stats.num_steps == 2


@pytest.mark.parametrize("body,param,words", [
    ({"prompt": [1, 2], "temperature": -1}, "temperature", "temperature must be >= 0"),
    ({"prompt": [1, 2], "top_p": 2}, "top_p", "top_p"),
    ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": "many"}, "max_tokens", "must be an integer"),
    ({"prompt": [1, 2], "max_tokens": 95}, "max_tokens", "nothing is truncated"),
    ({"prompt": [1] * 120}, "prompt", "never truncated"),
    ({"prompt": [1, VOCAB + 5]}, "prompt", "outside the vocabulary"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [[1], [2]]}, "prompt", "one request per prompt"),
    ({}, "prompt", "required"),
    ({"prompt": [1, 2], "n": 2}, "n", "n must be 1"),
    ({"prompt": [1, 2], "logprobs": 9}, "logprobs", "max_logprobs=3"),
    ({"prompt": [1, 2], "stop": [3]}, "stop", "stop must be"),
    ({"prompt": [1, 2], "seed": -3}, "seed", "seed"),
    ({"prompt": [1, 2], "stop_token_ids": [VOCAB + 1]}, "stop_token_ids", "vocabulary"),
    ({"prompt": "some text"}, "prompt", "no tokenizer"),
])
def test_bad_input_is_400_naming_the_field(fake, body, param, words):
    status, _, answer = _post(fake, "/v1/completions", body)
    assert status == 400, answer
    error = answer["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert words in error["message"]


def test_chat_errors_name_their_fields(fake):
    for body, param in [({"messages": []}, "messages"),
                        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
                        ({"messages": [{"role": "user", "content": "hi"}]}, "messages")]:
        status, _, answer = _post(fake, "/v1/chat/completions", body)
        assert status == 400 and answer["error"]["param"] == param, answer
    status, _, answer = _post(fake, "/v1/completions", {"model": "gpt-4", "prompt": [1]})
    assert status == 404 and answer["error"]["code"] == "model_not_found"
    conn = http.client.HTTPConnection("127.0.0.1", fake.http_port, timeout=10)
    conn.request("POST", "/v1/completions", b"{not json", {"Content-Type": "application/json"})
    assert conn.getresponse().status == 400
    conn.close()
    status, _, answer = _post(fake, "/v1/completions", {"prompt": "x" * (5 << 20)})
    assert status == 413 and "--max-message-bytes" in answer["error"]["message"]


def test_an_api_key_is_required_as_a_bearer_token_on_v1_only(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    server = _fake_server(api_key_file=str(key_file))
    try:
        body = {"prompt": [1, 2], "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            status, _, answer = _post(server, "/v1/completions", body, headers)
            assert status == 401 and answer["error"]["code"] == "invalid_api_key"
        status, _, answer = _post(server, "/v1/completions", body,
                                  {"Authorization": "Bearer s3cret"})
        assert status == 200 and answer["usage"]["completion_tokens"] == 2
        assert _get(server, "/v1/models")[0] == 401
        assert _get(server, "/health")[0] == 200
    finally:
        server.stop()


def test_a_full_queue_is_429_with_retry_after_at_once(gated):
    """8 seats taken by long streams, one request waiting: the next is refused at once. The
    engine steps only while seating, so no seat frees before the end."""
    server, gate = gated  # max_queued_requests=1
    seated = []
    for i in range(8):  # one at a time, so the queue never holds two of them
        seated.append(_open_stream(server, {"prompt": _prompt(10 + i), "max_tokens": 80,
                                            "logprobs": 0}))
        gate.step_until(lambda: server.loop.load.num_running == i + 1)
    waiting = _open_stream(server, {"prompt": _prompt(20), "max_tokens": 2})
    wait_for(lambda: server.loop.load.num_waiting == 1)
    started = time.monotonic()
    status, headers, answer = _post(server, "/v1/completions",
                                    {"prompt": _prompt(21), "max_tokens": 2})
    assert status == 429 and headers["retry-after"] == "1"
    assert "max_queued_requests=1" in answer["error"]["message"]
    assert time.monotonic() - started < 5
    assert server.loop.load.num_running == 8  # no seat freed meanwhile
    for conn, _ in seated:
        conn.sock.shutdown(2)
        conn.close()
    gate.open()
    assert _streamed_tokens(_events(waiting[1]))[1] == "length"
    waiting[0].close()
    wait_for(lambda: _pages_free(server))


def test_priority_orders_the_waiting_requests_lower_first():
    """vLLM's `priority`, lower first: with one seat, requests queued while the engine is held
    run by priority, and in arrival order within one; without the field they would run in
    arrival order, and with its sign lost, backwards."""
    engine_config = EngineConfig(**(FAKE | {"max_num_seqs": 1}))
    engine = Engine(FakeModelRunner(engine_config), None, engine_config)
    gate = StepGate(engine, shut=True)
    finished = []  # each finished request's first prompt token: its place in arrival order
    step = engine.step

    def recorded_step():
        outputs = step()
        finished.extend(out.prompt_token_ids[0] for out in outputs if out.finished)
        return outputs

    engine.step = recorded_step
    server = GenerationServer(engine, ServerConfig(port=0, http_port=0))
    server.start()
    try:
        priorities = [0, 5, -5, 0, -1]  # in arrival order
        with futures.ThreadPoolExecutor(len(priorities)) as pool:
            answers = []
            for i, priority in enumerate(priorities):
                answers.append(pool.submit(_post, server, "/v1/completions", {
                    "prompt": [i] + _prompt(i, 3), "max_tokens": 2, "priority": priority}))
                wait_for(lambda: server.loop.load.num_waiting == i + 1)
            gate.open()
            assert [answer.result()[0] for answer in answers] == [200] * len(priorities)
        assert finished == [2, 4, 0, 3, 1]
    finally:
        gate.open()
        server.stop()


def test_drain_is_503_on_health_and_new_requests_and_lets_streams_finish():
    server = _fake_server(step_seconds=0.005)
    conn, response = _open_stream(server, {"prompt": _prompt(30), "max_tokens": 80,
                                           "logprobs": 0})
    events = _events(response)
    next(events)
    drainer = threading.Thread(target=server.drain, kwargs=dict(timeout=60))
    drainer.start()
    wait_for(lambda: _get(server, "/health")[0] == 503)
    status, _, answer = _post(server, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
    assert status == 503 and "draining" in answer["error"]["message"]
    tokens, finish = _streamed_tokens(events)
    assert finish == "length" and len(tokens) == 80 - 1
    conn.close()
    drainer.join(timeout=60)
    assert server.wait() is True and _pages_free(server)


def test_an_engine_failure_is_500_and_takes_the_server_down():
    server = _fake_server()
    step, calls = server.engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("device lost")
        return step()

    server.engine.step = failing_step
    status, _, answer = _post(server, "/v1/completions", {"prompt": [1, 2], "max_tokens": 50})
    assert status == 500 and "device lost" in answer["error"]["message"]
    assert server.wait() is False and server.loop.state == "failed"


def test_tls_serves_https_from_the_same_cert_flags(tmp_path):
    import ssl

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    server = _fake_server(tls_cert=str(cert), tls_key=str(key))
    try:
        context = ssl.create_default_context(cafile=str(cert))
        conn = http.client.HTTPSConnection("localhost", server.http_port, context=context,
                                           timeout=10)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            _get(server, "/health")  # plain HTTP to a TLS port
    finally:
        server.stop()


@pytest.mark.slow
def test_sigterm_drains_both_front_ends_then_exits_zero():
    """`meshserve serve` in a subprocess (the only one of the server tests): a gRPC stream and an
    HTTP stream in flight when SIGTERM arrives both run to their end, then the process exits 0."""
    import grpc

    from meshserve.serving.grpc_api.stubs import generation_pb2 as pb
    from meshserve.serving.grpc_api.stubs import generation_pb2_grpc as pb_grpc

    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "meshserve"), "serve", "--model", "tiny-llama",
         "--port", "0", "--http-port", "0", "--no-compilation-cache", "--no-warmup",
         "--max-model-len", "256", "--num-pages", "64"], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        lines = [""]
        while "HTTP API" not in lines[-1]:
            lines.append(process.stdout.readline())
            assert lines[-1] or process.poll() is None, "the server died before serving"
        (serving,) = [line for line in lines if "meshserve: serving" in line]
        grpc_port = int(serving.split(" on ")[1].split(":")[1].split()[0])
        port = int(lines[-1].split(" on ")[1].split(":")[1].split()[0])

        class Server:
            http_port = port

        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        call = pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[8, 9, 10, 11]), sampling=pb.SamplingParams(
                max_tokens=120, temperature=0, ignore_eos=True)), timeout=60)
        first = next(call)
        conn, response = _open_stream(Server, {"prompt": [5, 6, 7], "max_tokens": 100,
                                               "temperature": 0, "ignore_eos": True,
                                               "logprobs": 0})
        events = _events(response)
        next(events)
        process.send_signal(signal.SIGTERM)
        tokens, finish = _streamed_tokens(events)
        assert finish == "length" and len(tokens) == 99
        grpc_tokens, final = list(first.chunk.token_ids), None
        for item in call:
            if item.HasField("chunk"):
                grpc_tokens += list(item.chunk.token_ids)
            else:
                final = item.final
        assert final.finish_reason == "length" and len(grpc_tokens) == 120
        channel.close()
        assert process.wait(timeout=60) == 0
        assert "drained" in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()


# -- SmolLM2 and the official openai client --------------------------------------------------------

TEXT = ("Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital "
        "of Italy. Madrid is the capital of Spain. Vienna is the capital of Austria. The capital "
        "of Portugal is")  # over two 16-token pages, so a repeat finds one cached
MESSAGES = [{"role": "user", "content": "Name three fruits."}]


@pytest.fixture(scope="module")
def smol_served(smollm2_files):
    """A served SmolLM2 and what `LLM.generate` and `LLM.chat` give (taken before serving: an
    engine has one owner at a time)."""
    llm = LLM(str(smollm2_files.path), **SMOL)
    greedy = SamplingParams(max_tokens=12, temperature=0)
    with_logprobs = SamplingParams(max_tokens=12, temperature=0, logprobs=2)
    want = {"text": llm.generate([TEXT], greedy, use_tqdm=False)[0].outputs[0],
            "chat": llm.chat(MESSAGES, with_logprobs, use_tqdm=False)[0].outputs[0]}
    server = GenerationServer(llm.engine, ServerConfig(port=0, http_port=0))
    server.start()
    yield server, llm, want
    server.stop()


@pytest.fixture(scope="module")
def client(smol_served):
    openai = pytest.importorskip("openai")
    server, _, _ = smol_served
    with openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none",
                       max_retries=0) as client:
        yield client


def test_openai_completions_equal_llm_generate_plain_and_streamed(smol_served, client):
    _, llm, want = smol_served
    model = client.models.list().data[0].id
    done = client.completions.create(model=model, prompt=TEXT, max_tokens=12, temperature=0)
    assert done.choices[0].text == want["text"].text
    assert done.usage.completion_tokens == len(want["text"].token_ids)
    assert done.usage.prompt_tokens == len(llm.tokenizer.encode(TEXT, add_special_tokens=True))
    chunks = list(client.completions.create(model=model, prompt=TEXT, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want["text"].text
    assert len(chunks) > 3 and chunks[-1].usage.completion_tokens == len(want["text"].token_ids)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again
    tokens = client.completions.create(model=model, prompt=llm.tokenizer.encode(TEXT),
                                       max_tokens=12, temperature=0)
    assert tokens.choices[0].text == want["text"].text


def test_openai_chat_equals_llm_chat_plain_and_streamed(smol_served, client):
    _, _, want = smol_served
    model = client.models.list().data[0].id
    done = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12,
                                          temperature=0, logprobs=True, top_logprobs=2)
    assert done.choices[0].message.content == want["chat"].text
    assert done.choices[0].finish_reason == want["chat"].finish_reason
    content = done.choices[0].logprobs.content
    assert len(content) == len(want["chat"].token_ids)
    for got, token, entry in zip(content, want["chat"].token_ids, want["chat"].logprobs):
        top = sorted((lp for lp in entry.values() if lp.rank <= 2), key=lambda lp: lp.rank)
        assert got.token == entry[token].decoded_token
        assert bytes(got.bytes).decode() == got.token
        assert [t.token for t in got.top_logprobs] == [lp.decoded_token for lp in top]
        np.testing.assert_allclose([got.logprob] + [t.logprob for t in got.top_logprobs],
                                   [entry[token].logprob] + [lp.logprob for lp in top],
                                   atol=1e-4)
    stream = client.chat.completions.create(model=model, messages=MESSAGES,
                                            max_completion_tokens=12, temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == want["chat"].text


def test_openai_errors_come_back_as_the_client_s_exceptions(smol_served, client):
    openai = pytest.importorskip("openai")
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=MESSAGES, n=2)
    assert err.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=[{"role": "wizard", "content": "x"}])
    assert err.value.body["param"] == "messages" and "wizard" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=MESSAGES, top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="word " * 2000, max_tokens=4)
    assert "never truncated" in err.value.body["message"]


def test_a_slow_admission_does_not_hold_another_requests_stream():
    """Parsing, templating, tokenizing and grammar compiles run off the event loop: while one
    request's admission is held (a gate standing in for a long grammar compile), another request
    is admitted and streams to its end; then the held one finishes too. Were the admission on
    the event loop, the second request could not even be read, and the test would time out."""
    server = _fake_server()
    held, entered = threading.Event(), threading.Event()
    admit = server.loop.admission.admit

    def gated_admit(prompt, *args, **kwargs):
        if list(prompt.value)[:2] == [7, 7]:  # the held request
            entered.set()
            assert held.wait(60), "never released"
        return admit(prompt, *args, **kwargs)

    server.loop.admission.admit = gated_admit
    try:
        with futures.ThreadPoolExecutor(1) as pool:
            slow = pool.submit(_post, server, "/v1/completions",
                               {"prompt": [7, 7, 1, 2], "max_tokens": 3}, timeout=90)
            assert entered.wait(30)
            conn, response = _open_stream(server, {"prompt": _prompt(3), "max_tokens": 5,
                                                   "logprobs": 1})
            tokens, finish = _streamed_tokens(_events(response))
            conn.close()
            assert len(tokens) == 5 and finish == "length"
            assert not slow.done()  # still held while the other streamed
            held.set()
            status, _, body = slow.result(timeout=60)
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    finally:
        held.set()
        server.stop()
