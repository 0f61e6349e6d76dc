"""The OpenAI HTTP API, strict: every request field honoured or refused before anything runs, every
answer on the port in OpenAI's error shape, limits answered with a status code and never a reset,
CORS, request ids, model names.

Two servers. A real `meshserve serve` process on SmolLM2, started from the command in
docs/server.md (with sizing flags added so it starts fast), driven by curl (the documented
example, as written) and the official `openai` client. And in-process servers on the arithmetic
runner (`tests/serving/fake_runner.py`, nothing compiled) for what needs the process's insides:
the log, the engine's step count, other flags.
"""

import http.client
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshserve.batching.sampling import SamplingParams
from meshserve.serving.grpc_api.client import Client
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.core import Engine
from meshserve.serving.http_api.render import Render
from meshserve.serving.openai_api.fields import FIELDS, markdown_table
from meshserve.serving.openai_api.request_model import parse_request
from meshserve.serving.engine.outputs import (CompletionOutput, Logprob, RequestMetrics,
                                              RequestOutput)
from meshserve.serving.grpc_api.server import GenerationServer, ServerConfig
from tests.serving.fake_runner import FakeModelRunner, reference_outputs
from tests.serving.served import wait_for

DOCS = Path(__file__).parents[2] / "docs" / "server.md"
FAKE = dict(num_pages=128, page_size=4, max_num_seqs=4, max_num_batched_tokens=32,
            prefill_chunk=16, max_model_len=96, max_logprobs=3, compilation_cache=False)
ORIGIN = "https://app.example"
TOKENS = re.compile(r"^meshserve:generation_tokens_total(?:\{[^}]*\})? (\S+)$", re.M)

# A realistic refused value for the refused fields clients send most; every other refused
# field is sent an object, which is no field's neutral value.
REFUSED_VALUES = {
    "n": 2, "best_of": 3, "echo": True, "suffix": "!", "logit_bias": {"5": 10}, "store": True,
    "metadata": {"run": "a"}, "service_tier": "flex", "modalities": ["text", "audio"],
    "reasoning_effort": "low", "functions": [{"name": "f"}], "use_beam_search": True,
    "include_stop_str_in_output": True, "truncate_prompt_tokens": 8, "add_special_tokens": False,
}


def _refused_cases():
    for field in FIELDS:
        if field.verdict == "refused":
            for endpoint in field.endpoints:
                yield field.name, endpoint, REFUSED_VALUES.get(field.name, {"unexpected": 1})


# -- talking HTTP ----------------------------------------------------------------------------------

def _request(port: int, method: str, path: str, body: bytes | None = None,
             headers: dict | None = None, timeout: float = 60):
    """(status, headers, body bytes) of one request on a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body, headers or {})
        response = conn.getresponse()
        return (response.status, {k.lower(): v for k, v in response.getheaders()},
                response.read())
    finally:
        conn.close()


def _post(port: int, path: str, body: dict, headers: dict | None = None):
    status, head, raw = _request(port, "POST", path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"} | (headers or {}))
    return status, head, json.loads(raw)


def _error(raw: bytes) -> dict:
    """The OpenAI error object of a body, checked for its shape."""
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


def _generation_tokens(port: int) -> float:
    status, _, raw = _request(port, "GET", "/metrics")
    assert status == 200
    return float(TOKENS.search(raw.decode()).group(1))


def _send_raw(port: int, data: bytes, timeout: float = 30) -> bytes:
    """Sends `data` whole, then reads the answer to the end; any reset fails the test."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(1 << 16):
            chunks.append(chunk)
    return b"".join(chunks)


def _status_and_body(answer: bytes) -> tuple[int, bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


# -- the real process ------------------------------------------------------------------------------

def _docs_example() -> tuple[str, str]:
    """The serve command and the curl lines of the HTTP API's example in docs/server.md."""
    section = DOCS.read_text().split("## The OpenAI-compatible HTTP API", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    serve, curls = block.split("\n", 1)
    assert serve.startswith("meshserve serve ") and curls.startswith("curl ")
    return serve, curls


# Sizing for a fast start. Without prefix caching, a prompt sent again runs the same step
# shapes, so the tests below send the example's own prompts and compile nothing after it.
SIZING = ["--no-warmup", "--no-compilation-cache", "--no-prefix-caching", "--max-model-len",
          "512", "--num-pages", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
          "--prefill-chunk", "32", "--max-logprobs", "5"]
CHAT = [{"role": "user", "content": "Hi!"}]  # the example's prompts
TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def served():
    """`meshserve serve` as docs/server.md starts it (ports 0, sizing flags added); its HTTP
    port."""
    serve, _ = _docs_example()
    argv = serve.replace("--port 50051", "--port 0").replace("--http-port 8000",
                                                             "--http-port 0").split()
    assert argv[:2] == ["meshserve", "serve"] and "0" in argv
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "meshserve"), *argv[1:], *SIZING],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        line = ""
        while "HTTP API" not in line:
            line = process.stdout.readline()
            assert line or process.poll() is None, "the server died before serving"
        yield int(line.split(" on ")[1].split(":")[1].split()[0])
    finally:
        process.kill()  # draining is tested elsewhere
        process.wait(timeout=60)


@pytest.fixture(scope="module")
def client(served):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=f"http://127.0.0.1:{served}/v1", api_key="none",
                       max_retries=0) as client:
        yield client


@pytest.mark.slow
def test_the_documented_curl_example_works_as_written(served):
    _, curls = _docs_example()
    done = subprocess.run(["bash", "-e", "-c", curls.replace("127.0.0.1:8000",
                                                             f"127.0.0.1:{served}")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    models, end = json.JSONDecoder().raw_decode(done.stdout)
    assert [m["id"] for m in models["data"]] == ["smollm2-135m-instruct"]
    stream, _, rest = done.stdout[end:].partition("data: [DONE]\n\n")
    events = [json.loads(line[len("data: "):]) for line in stream.splitlines() if line]
    assert all("error" not in e for e in events) and events[-1]["usage"]["completion_tokens"] > 0
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    completion = json.loads(rest)
    assert completion["object"] == "text_completion" and completion["usage"]["completion_tokens"]
    assert len(completion["choices"][0]["logprobs"]["top_logprobs"][0]) == 2


@pytest.mark.slow
def test_models_list_and_retrieve_by_the_name_given(client):
    openai = pytest.importorskip("openai")
    assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]
    model = client.models.retrieve("smollm2-135m-instruct")
    assert model.id == "smollm2-135m-instruct" and model.max_model_len == 512
    assert model.root != model.id  # the GGUF's own name, kept apart
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("Smollm2 135M")
    assert err.value.body["code"] == "model_not_found"


@pytest.mark.slow
def test_every_refused_field_raises_bad_request_naming_it(client):
    openai = pytest.importorskip("openai")
    common = dict(model="smollm2-135m-instruct", max_tokens=3)
    for name, endpoint, value in _refused_cases():
        with pytest.raises(openai.BadRequestError) as err:
            if endpoint == "chat":
                client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}],
                                               extra_body={name: value}, **common)
            else:
                client.completions.create(prompt="Hi", extra_body={name: value}, **common)
        assert (err.value.body["param"], err.value.body["code"]) == (
            name, "unsupported_parameter"), (name, endpoint)


@pytest.mark.slow
def test_neutral_values_of_refused_fields_pass(client):
    def neutral(endpoint: str) -> dict:
        return {f.name: f.neutral[0] for f in FIELDS
                if f.verdict == "refused" and f.neutral and endpoint in f.endpoints}

    done = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=CHAT, max_tokens=2, temperature=0,
        extra_body=neutral("chat") | {"ignore_eos": True}, user="u1", prompt_cache_key="k")
    assert done.usage.completion_tokens == 2 and done.system_fingerprint.startswith("fp_")
    done = client.completions.create(model="smollm2-135m-instruct", prompt=TEXT, max_tokens=2,
                                     extra_body=neutral("completions"))
    assert done.usage.completion_tokens == 2


@pytest.mark.slow
def test_a_refused_request_leaves_the_generation_counter_unchanged(served):
    """300 tokens asked for, and `stream` (or another field) of the wrong kind. The request after
    it finishes only after any earlier request started, so the counter would show it."""
    before = _generation_tokens(served)
    for bad in ({"stream": "yes"}, {"return_token_ids": "yes"}, {"use_beam_search": True}):
        status, _, answer = _post(served, "/v1/completions", {
            "prompt": TEXT, "max_tokens": 300, "ignore_eos": True} | bad)
        assert status == 400 and answer["error"]["param"] == next(iter(bad))
    status, _, answer = _post(served, "/v1/completions", {"prompt": TEXT, "max_tokens": 2,
                                                          "ignore_eos": True})
    assert status == 200 and answer["usage"]["completion_tokens"] == 2
    assert _generation_tokens(served) == before + 2


@pytest.mark.slow
def test_oversized_and_nested_input_get_their_4xx_every_time(served, client):
    openai = pytest.importorskip("openai")
    nested = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for _ in range(5):
        status, _, raw = _request(served, "POST", "/v1/completions", nested,
                                  {"Content-Type": "application/json"})
        assert status == 400 and "nests deeper" in _error(raw)["message"]
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model="smollm2-135m-instruct", prompt="x" * (20 << 20))
        assert err.value.status_code == 413 and err.value.body["code"] == "body_too_large"
        with pytest.raises(openai.APIStatusError) as err:
            client.models.list(extra_headers={"X-Big": "a" * (8 << 20)})
        assert err.value.status_code == 431 and err.value.body["code"] == "header_too_large"


@pytest.mark.slow
def test_cors_is_off_by_default(served):
    status, headers, raw = _request(served, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert status == 403 and "--allowed-origins" in _error(raw)["message"]
    assert "access-control-allow-origin" not in headers


# -- in process, on the arithmetic runner ----------------------------------------------------------

def _fake_server(**config) -> GenerationServer:
    engine_config = EngineConfig(**FAKE)
    engine = Engine(FakeModelRunner(engine_config), None, engine_config)
    server = GenerationServer(engine, ServerConfig(port=0, http_port=0, **config))
    server.start()
    return server


@pytest.fixture(scope="module")
def fake():
    server = _fake_server(allowed_origins=(ORIGIN,), served_model_name=("arith", "arith-2"))
    yield server
    server.stop()


def test_the_field_table_in_the_docs_is_the_code_s():
    docs = DOCS.read_text()
    table = docs.split("<!-- fields:begin -->\n", 1)[1].split("<!-- fields:end -->", 1)[0]
    assert table.strip() == markdown_table(), (
        "docs/server.md's field table is stale: paste `python -m "
        "meshserve.serving.openai_api.fields` between its fields markers")


def test_refused_fields_run_nothing_on_either_endpoint(fake):
    runs = fake.engine.runner.num_executed
    for name, endpoint, value in _refused_cases():
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        prompt = ({"messages": [{"role": "user", "content": "Hi"}]} if endpoint == "chat"
                  else {"prompt": [1, 2]})
        status, _, answer = _post(fake.http_port, path, prompt | {name: value})
        assert status == 400 and answer["error"]["param"] == name, (name, answer)
    assert fake.engine.runner.num_executed == runs


def test_every_honoured_completions_field_is_served(fake, monkeypatch):
    """All at once. The arithmetic runner samples greedily by its rule whatever the sampling
    fields, so the tokens are known; that each sampling field and the priority reach the engine
    is checked on the request its scheduler is given. Stop strings and structured output need a
    tokenizer, which it has not (and a request takes one structured-output field:
    tests/serving/test_structured_openai.py)."""
    prompt = [2, 7, 1, 8]
    body = {"model": "arith-2", "prompt": prompt, "max_tokens": 6, "temperature": 0.5,
            "top_p": 0.9, "presence_penalty": 0.1, "frequency_penalty": 0.1, "seed": 3,
            "logprobs": 1, "stream": False, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
            "stop_token_ids": [0], "ignore_eos": True, "min_tokens": 1, "prompt_logprobs": 1,
            "return_token_ids": True, "return_tokens_as_token_ids": True, "priority": -1,
            "request_id": "all", "user": "u", "guided_decoding_backend": "auto",
            "speculate": False}
    served = {f.name for f in FIELDS if f.verdict != "refused" and "completions" in f.endpoints}
    assert served - set(body) == {"stop", "stream_options", "response_format",
                                  "structured_outputs", "guided_json", "guided_regex",
                                  "guided_choice", "guided_grammar", "structured_bounds"}
    scheduled = _record_scheduled(fake, monkeypatch)
    status, _, answer = _post(fake.http_port, "/v1/completions", body)
    assert status == 200, answer
    choice = answer["choices"][0]
    assert choice["token_ids"] == reference_outputs(prompt, 6) and answer["id"] == "cmpl-all"
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    (request,) = scheduled
    sampling = {f.sampling: body[f.name] for f in FIELDS if f.sampling and f.name in body}
    assert {f.sampling for f in FIELDS if f.sampling} - set(sampling) == {"stop"}
    defaults = SamplingParams()
    for name, value in sampling.items():  # each a value the engine would not have by default
        assert getattr(defaults, name) != getattr(SamplingParams(**{name: value}), name), name
    assert request.params == SamplingParams(**sampling, max_tokens=6, logprobs=1)
    assert request.priority == 1  # vLLM's lower-first, as the scheduler's higher-first


def _record_scheduled(server: GenerationServer, monkeypatch) -> list:
    """The engine requests `server`'s scheduler is given from now on, until the test ends."""
    scheduler, scheduled = server.engine.scheduler, []
    add = scheduler.add

    def recorded(request) -> None:
        scheduled.append(request)
        add(request)

    monkeypatch.setattr(scheduler, "add", recorded)
    return scheduled


@pytest.mark.parametrize("body,param,code", [
    ({"prompt": [1], "colour": "red"}, "colour", "unknown_parameter"),
    ({"prompt": [1], "messages": []}, "messages", "unknown_parameter"),
    ({"prompt": [1], "stream": "yes"}, "stream", "invalid_value"),
    ({"prompt": [1], "temperature": True}, "temperature", "invalid_value"),
    ({"prompt": [1], "stream_options": {"include_usage": True}}, "stream_options",
     "invalid_value"),
    ({"prompt": [1], "stream": True, "stream_options": {"usage": True}},
     "stream_options.usage", "unknown_parameter"),
    ({"prompt": [1], "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "invalid_value"),
    ({"prompt": [1], "max_tokens": 4, "min_tokens": 5}, "min_tokens", "invalid_value"),
    ({"prompt": [1], "top_k": 2**40}, "top_k", "invalid_value"),  # once took the engine down
    ({"prompt": [1], "temperature": 1e300}, "temperature", "invalid_value"),  # inf in float32
    ({"prompt": [1], "frequency_penalty": -1e39}, "frequency_penalty", "invalid_value"),
    ({"prompt": [1], "repetition_penalty": 3.5e38}, "repetition_penalty", "invalid_value"),
    ({"prompt": [1], "request_id": "a\nb"}, "request_id", "invalid_value"),
    ({"prompt": [1], "model": "gpt-4"}, "model", "model_not_found"),
])
def test_each_bad_field_is_named(fake, body, param, code):
    status, _, answer = _post(fake.http_port, "/v1/completions", body)
    assert status in (400, 404) and (answer["error"]["param"], answer["error"]["code"]) == (
        param, code), answer


def test_a_number_that_parses_to_infinity_is_named(fake):
    status, _, raw = _request(fake.http_port, "POST", "/v1/completions",
                              b'{"prompt": [1], "temperature": 1e400}')
    assert status == 400 and _error(raw)["param"] == "temperature"


def test_chat_messages_keep_to_role_text_and_name(fake):
    for messages, param in [
            ([{"role": "user", "content": "hi", "name": 7}], "messages[0].name"),
            ([{"role": "user", "content": "hi", "name": "a" * 65}], "messages[0].name"),
            ([{"role": "user", "content": "hi", "function_call": {"name": "f"}}],
             "messages[0].function_call"),
            ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
             "messages[0].content[0]"),
            ([{"role": "user", "content": None}], "messages[0].content")]:
        status, _, answer = _post(fake.http_port, "/v1/chat/completions",
                                  {"messages": messages})
        assert status == 400 and answer["error"]["param"] == param, answer


def test_errors_outside_the_handlers_are_openai_json(fake):
    port = fake.http_port
    status, _, raw = _request(port, "GET", "/v2/nothing")
    assert status == 404 and _error(raw)["code"] == "not_found"
    status, headers, raw = _request(port, "GET", "/v1/completions")
    assert status == 405 and "POST" in headers["allow"] and _error(raw)
    for body in (b"{not json", b"[1, 2]", b'{"prompt": [1], "temperature": NaN}',
                 b'{"prompt": ' + b"[" * 70 + b"1" + b"]" * 70 + b"}"):
        status, _, raw = _request(port, "POST", "/v1/completions", body)
        assert status == 400 and _error(raw)["param"] is None, body[:20]


def test_a_client_still_sending_when_refused_reads_its_answer(fake):
    """Raw sockets that send their whole request before reading, on connections asked to close:
    a 413 (counted as it arrives, chunked) and a 431; neither ever resets the client."""
    big = json.dumps({"prompt": "x" * (6 << 20)}).encode()
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(big[i:i + 65536]), big[i:i + 65536])
                       for i in range(0, len(big), 65536)) + b"0\r\n\r\n"
    for _ in range(5):
        answer = _send_raw(fake.http_port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                           b"Connection: close\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked)
        status, body = _status_and_body(answer)
        assert status == 413 and _error(body)["code"] == "body_too_large"
        for size in (8 << 20, 100 << 10):  # past the 64 KiB limit; the second arrives whole
            answer = _send_raw(fake.http_port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: "
                               + b"a" * size + b"\r\n\r\n")
            status, body = _status_and_body(answer)
            assert status == 431 and _error(body)["code"] == "header_too_large", size


def test_a_client_gone_or_a_malformed_head_is_one_info_line_naming_it(fake):
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    names = ("meshserve.serving.http_api.app", "meshserve.serving.http_api.edge", "uvicorn.error")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    try:
        for _ in range(8):
            with socket.create_connection(("127.0.0.1", fake.http_port)) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Length: 1000\r\n\r\n" + b'{"prompt": [1, ')
                time.sleep(0.05)  # the app is reading the body when the client leaves
        wait_for(lambda: len(records) >= 8)
        for head in (b"NOT HTTP\r\n\r\n", b"GET /health HTTP/1.1\r\nX: " + b"a" * (1 << 20)):
            status, body = _status_and_body(_send_raw(fake.http_port, head))
            assert status in (400, 431) and _error(body)
        wait_for(lambda: len(records) >= 10)
        time.sleep(0.2)
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)
    assert [(r.name, r.levelno) for r in records] == [
        ("meshserve.serving.http_api.app", logging.INFO)] * 8 + [
        ("meshserve.serving.http_api.edge", logging.INFO)] * 2
    assert all(r.exc_info is None for r in records)
    assert "went away while sending its body" in records[0].getMessage()
    assert [r.getMessage().split(": answered ")[1][:3] for r in records[8:]] == ["400", "431"]
    assert all(re.search(r"127\.0\.0\.1:\d+", r.getMessage()) for r in records)


def test_cors_preflight_allowed_and_refused(fake):
    port = fake.http_port
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type, authorization"}
    status, headers, _ = _request(port, "OPTIONS", "/v1/chat/completions",
                                  headers=preflight | {"Origin": ORIGIN})
    assert status == 204 and headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in headers["access-control-allow-methods"]
    assert "authorization" in headers["access-control-allow-headers"]
    status, headers, raw = _request(port, "OPTIONS", "/v1/chat/completions",
                                    headers=preflight | {"Origin": "https://evil.example"})
    assert status == 403 and "access-control-allow-origin" not in headers
    assert _error(raw)["code"] == "cors_refused"
    status, headers, _ = _post(port, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2},
                               {"Origin": ORIGIN})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN


def test_served_model_names_and_the_response_s_ids(fake):
    port = fake.http_port
    status, _, raw = _request(port, "GET", "/v1/models")
    assert [m["id"] for m in json.loads(raw)["data"]] == ["arith", "arith-2"]
    assert json.loads(_request(port, "GET", "/v1/models/arith-2")[2])["root"] == (
        "fake-arithmetic")
    with Client(f"127.0.0.1:{fake.port}", timeout=30) as client:  # gRPC names them alike
        info = client.server_info()
    assert (info.model, info.served_model_names, info.root) == (
        "arith", ("arith", "arith-2"), "fake-arithmetic")
    prompt = [3, 1, 4]
    status, headers, answer = _post(port, "/v1/completions", {
        "model": "arith-2", "prompt": prompt, "max_tokens": 3}, {"X-Request-Id": "trace-7"})
    assert status == 200 and answer["model"] == "arith-2" and answer["id"] == "cmpl-trace-7"
    assert headers["x-request-id"] == "trace-7"
    assert answer["system_fingerprint"].startswith("fp_")
    assert answer["usage"]["completion_tokens"] == 3
    status, headers, answer = _post(port, "/v1/completions", {"prompt": prompt, "max_tokens": 1,
                                                              "request_id": "mine"})
    assert answer["model"] == "arith" and answer["id"] == "cmpl-mine"
    assert headers["x-request-id"] == "mine"
    status, headers, answer = _post(port, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert headers["x-request-id"] == answer["id"] and answer["id"].startswith("cmpl-")


def test_streams_carry_usage_in_every_chunk_and_token_ids(fake):
    prompt = [7, 8, 9, 10]
    status, _, raw = _request(fake.http_port, "POST", "/v1/completions", json.dumps({
        "prompt": prompt, "max_tokens": 5, "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).encode())
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: {")]
    assert status == 200 and events[0]["prompt_token_ids"] == prompt
    tokens = [t for e in events if e["choices"] for t in e["choices"][0].get("token_ids", [])]
    assert tokens == reference_outputs(prompt, 5)
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 5


def test_lower_case_bearer_is_the_same_key(tmp_path):
    key = tmp_path / "key"
    key.write_text("s3cret")
    server = _fake_server(api_key_file=str(key))
    try:
        body = {"prompt": [1, 2], "max_tokens": 1}
        for scheme in ("Bearer", "bearer", "BEARER"):
            status, _, _ = _post(server.http_port, "/v1/completions", body,
                                 {"Authorization": f"{scheme} s3cret"})
            assert status == 200, scheme
        status, headers, answer = _post(server.http_port, "/v1/models/x", {},
                                        {"Authorization": "Basic s3cret"})
        assert status == 401 and answer["error"]["code"] == "invalid_api_key"
        status, _, _ = _request(server.http_port, "OPTIONS", "/v1/models", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "GET"})
        assert status == 403  # a preflight never needs the key, and CORS is off here
    finally:
        server.stop()


def test_connections_past_the_cap_get_503_with_retry_after():
    server = _fake_server(max_concurrent_streams=2)
    try:
        held = [socket.create_connection(("127.0.0.1", server.http_port)) for _ in range(2)]
        time.sleep(0.1)
        status, body = _status_and_body(_send_raw(
            server.http_port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"))
        assert status == 503 and _error(body)["code"] == "too_many_connections"
        for sock in held:
            sock.close()
        wait_for(lambda: _request(server.http_port, "GET", "/health")[0] == 200)
    finally:
        server.stop()


def test_prompt_logprobs_and_ids_are_rendered_as_vllm_gives_them():
    """`Render` on a finished output holding prompt logprobs (the engine's own shape)."""
    request = parse_request({"prompt": [1, 5, 6], "prompt_logprobs": 1, "logprobs": 1,
                             "return_token_ids": True, "return_tokens_as_token_ids": True},
                            "completions")
    entry = {5: Logprob(-0.5, 1, "a"), 7: Logprob(-1.5, 2, "b")}
    output = RequestOutput(
        request_id="r", prompt=None, prompt_token_ids=[1, 5, 6],
        prompt_logprobs=[None, entry, {6: Logprob(-2.0, 3, "c")}], finished=True,
        metrics=RequestMetrics(), outputs=[CompletionOutput(
            index=0, text="x", token_ids=[9], logprobs=[{9: Logprob(-0.1, 1, "x")}],
            finish_reason="length")])
    choice = Render("cmpl-r", "m", "fp_x", request).whole(output)["choices"][0]
    assert choice["prompt_token_ids"] == [1, 5, 6] and choice["token_ids"] == [9]
    assert choice["prompt_logprobs"][:2] == [None, {
        "5": {"logprob": -0.5, "rank": 1, "decoded_token": "a"},
        "7": {"logprob": -1.5, "rank": 2, "decoded_token": "b"}}]
    assert choice["logprobs"]["tokens"] == ["token_id:9"]
