"""The Python clients and `meshserve client`, against a real GenerationServer on 127.0.0.1.

One server per module runs on its own tiny random Llama (token-id prompts; it has no
tokenizer). The outputs `LLM.generate` gives are computed on that engine before the server
takes it over; a `StepGate` holds it where a cancel or a deadline must be seen to stop a request.
Servers with an api key or TLS run on a second engine, on the arithmetic runner, one at a time.
The slow test serves the real SmolLM2 and checks `meshserve client` against `LLM.chat`.
"""

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from meshserve.batching.sampling import SamplingParams
from meshserve.serving.cli import main as cli
from meshserve.serving.grpc_api.stubs import generation_pb2 as pb
from meshserve.serving.grpc_api.client import (AsyncClient, Client, ClientError, Completion,
                                               StreamChunk, sampling_message)
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.engine.core import Engine
from meshserve.serving.python_api.llm import LLM
from meshserve.serving.grpc_api.server import (SERVICE_NAME, GenerationServer, ServerConfig,
                                               _sampling_params)
from tests.serving.fake_runner import FakeModelRunner
from tests.serving.served import (ENGINE, SMOL, StepGate, pages_free, prompt_ids, record_aborts,
                                  wait_for)



def _greedy(max_tokens: int, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **fields)


PROMPT = prompt_ids(0)
LOGPROBS_PROMPT = prompt_ids(1)
BURST = [prompt_ids(100 + i, length=4 + i % 10) for i in range(16)]


@contextlib.contextmanager
def _serving(llm: LLM, **config):
    server = GenerationServer(llm.engine, ServerConfig(port=0, **config))
    port = server.start()
    try:
        yield server, port
    finally:
        server.stop()




@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", **ENGINE)


@pytest.fixture(scope="module")
def spare_llm():
    """For servers with an api key or TLS: an LLM on the arithmetic runner (nothing compiled;
    `tests/serving/fake_runner.py`), one server at a time."""
    config = EngineConfig(num_pages=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                          prefill_chunk=8, max_model_len=64, compilation_cache=False)
    spare = LLM.__new__(LLM)
    spare.engine, spare.cluster, spare.tokenizer = (
        Engine(FakeModelRunner(config), None, config), None, None)
    return spare


@pytest.fixture(scope="module")
def reference(llm):
    """`LLM.generate`'s outputs for the prompts these tests send, from the served engine."""
    prompts = [PROMPT, LOGPROBS_PROMPT, *BURST]
    params = [_greedy(12), _greedy(3, logprobs=2), *[_greedy(6)] * len(BURST)]
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    return {"prompt": outputs[0], "logprobs": outputs[1],
            "burst": [o.token_ids for o in outputs[2:]]}


@pytest.fixture(scope="module")
def served(llm, reference):
    with _serving(llm) as (server, port):
        yield server, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def gate(served):
    """Holds the served engine between steps where a test says (open otherwise), so a request
    that should stop early cannot pass by finishing on its own."""
    gate = StepGate(served[0].engine)
    yield gate
    gate.open()


@pytest.fixture(scope="module")
def client(served):
    with Client(served[1], timeout=60) as client:
        yield client


def test_sampling_params_cross_the_wire_unchanged():
    assert ({f.name for f in pb.SamplingParams.DESCRIPTOR.fields}
            == set(SamplingParams.__dataclass_fields__))
    params = SamplingParams(max_tokens=40, min_tokens=2, temperature=0.5, top_k=7, top_p=0.75,
                            min_p=0.125, repetition_penalty=1.25, presence_penalty=0.5,
                            frequency_penalty=-0.5, stop=("a", "bc"), stop_token_ids=(3, 4),
                            ignore_eos=True, seed=2**32 - 1, logprobs=3, prompt_logprobs=0,
                            speculate=False)
    for p in (params, SamplingParams()):
        message = sampling_message(p)
        assert all(message.HasField(name) for name, value in vars(p).items()
                   if value is not None and not isinstance(value, tuple))
        assert _sampling_params(message) == p


def test_generate_equals_llm_generate(client, reference):
    completion = client.generate(PROMPT, _greedy(12), request_id="sync-1")
    want = reference["prompt"]
    assert isinstance(completion, Completion)
    assert completion.token_ids == want.token_ids
    assert (completion.request_id, completion.finish_reason, completion.stop_reason) == (
        "sync-1", "length", None)
    assert (completion.prompt_tokens, completion.completion_tokens) == (12, 12)
    assert completion.text == "" and completion.logprobs is None


def test_stream_yields_chunks_then_the_completion(client, reference):
    items = list(client.stream(PROMPT, {"max_tokens": 12, "temperature": 0,
                                        "ignore_eos": True}))
    *chunks, completion = items
    assert isinstance(completion, Completion)
    assert len(chunks) > 2 and all(isinstance(c, StreamChunk) for c in chunks)
    assert [t for c in chunks for t in c.token_ids] == completion.token_ids == (
        reference["prompt"].token_ids)
    assert len({item.request_id for item in items}) == 1 and completion.request_id


def test_logprobs_come_back_in_the_offline_shape(client, reference):
    completion = client.generate(LOGPROBS_PROMPT, _greedy(3, logprobs=2))
    want = reference["logprobs"]
    assert completion.token_ids == want.token_ids
    assert len(completion.logprobs) == 3
    for got, expected in zip(completion.logprobs, want.logprobs):
        assert list(got) == list(expected)  # the chosen token, then the top ones by rank
        for token, lp in got.items():
            assert lp.rank == expected[token].rank and lp.decoded_token is None
            assert lp.logprob == pytest.approx(expected[token].logprob, abs=1e-4)


def test_prompt_logprobs_come_back_in_the_offline_shape(client):
    prompt = prompt_ids(77, length=6)
    completion = client.generate(prompt, _greedy(1, prompt_logprobs=2))
    assert completion.prompt_logprobs[0] is None and len(completion.prompt_logprobs) == 6
    for token, entry in zip(prompt[1:], completion.prompt_logprobs[1:]):
        assert token in entry and len(entry) in (2, 3)  # the prompt token, and the top 2
    assert client.generate(prompt, _greedy(1)).prompt_logprobs is None


def test_a_stop_token_ends_with_its_id_as_the_stop_reason(client, reference):
    tokens = reference["prompt"].token_ids
    stop = tokens[5]
    completion = client.generate(PROMPT, _greedy(12, stop_token_ids=[stop]))
    assert completion.token_ids == tokens[:tokens.index(stop) + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)


def test_abort_from_another_thread_ends_the_stream_with_abort(client, served):
    server, _ = served
    stream = client.stream(prompt_ids(3), _greedy(200))
    first = next(stream)
    aborted = []
    thread = threading.Thread(target=lambda: aborted.append(client.abort(stream.request_id)))
    thread.start()
    thread.join(timeout=30)
    *rest, completion = [first, *stream]
    assert aborted == [True]
    assert completion.finish_reason == "abort" and completion.stop_reason is None
    assert [t for c in rest for t in c.token_ids] == completion.token_ids
    assert 0 < len(completion.token_ids) == completion.completion_tokens < 200
    assert client.abort(stream.request_id) is False
    wait_for(lambda: pages_free(server))

    results = []
    worker = threading.Thread(target=lambda: results.append(
        client.generate(prompt_ids(4), _greedy(200), request_id="blocking")))
    worker.start()
    wait_for(lambda: server.is_inflight("blocking"))
    assert client.abort("blocking") is True
    worker.join(timeout=30)
    assert results[0].finish_reason == "abort" and results[0].request_id == "blocking"
    wait_for(lambda: pages_free(server))


def test_cancel_ends_the_call_and_stops_the_request(client, served, gate, monkeypatch):
    server, _ = served
    aborted = record_aborts(server.loop, monkeypatch)
    gate.shut()
    try:
        with client.stream(prompt_ids(5), _greedy(200)) as stream:
            gate.allow(2)  # 2 tokens of 200, then no step until the end
            next(stream), next(stream)
            stream.cancel()
            with pytest.raises(ClientError) as err:
                list(stream)
        wait_for(lambda: aborted == [stream.request_id])
    finally:
        gate.open()
    assert err.value.code is grpc.StatusCode.CANCELLED
    wait_for(lambda: pages_free(server))


def test_the_client_timeout_is_the_deadline(served, gate, monkeypatch):
    server, target = served
    aborted = record_aborts(server.loop, monkeypatch)
    gate.shut()
    try:
        with Client(target, timeout=0.3) as short:
            gate.allow(2)  # 2 tokens of 240, then no step: only the deadline can end it
            with pytest.raises(ClientError) as err:
                short.generate(prompt_ids(6), _greedy(240), request_id="short")
        wait_for(lambda: aborted == ["short"])
    finally:
        gate.open()
    assert err.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: pages_free(server))


def test_async_client_runs_16_concurrent_requests(served, reference):
    _, target = served

    async def run():
        async with AsyncClient(target, timeout=60) as client:
            completions = await asyncio.gather(*(client.generate(p, _greedy(6)) for p in BURST))
            items = [item async for item in client.stream(BURST[0], _greedy(6))]
            with pytest.raises(ClientError) as err:
                await client.generate("hello", _greedy(2))
            return (completions, items, err.value, await client.server_info(),
                    await client.health(), await client.abort("no-such-request"))

    completions, items, error, info, health, aborted = asyncio.run(run())
    assert [c.token_ids for c in completions] == reference["burst"]
    assert len({c.request_id for c in completions}) == 16
    assert isinstance(items[-1], Completion) and items[-1].token_ids == reference["burst"][0]
    assert len(items) > 2 and all(isinstance(c, StreamChunk) for c in items[:-1])
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert (info.model, health, aborted) == ("tiny-llama", "SERVING", False)


def test_async_stream_cancel_raises_cancelled_and_stops_the_request(served, gate, monkeypatch):
    server, target = served
    aborted = record_aborts(server.loop, monkeypatch)

    async def run():
        async with AsyncClient(target, timeout=60) as client:
            stream = client.stream(prompt_ids(7), _greedy(200), request_id="async-cancel")
            async with stream:
                await stream.__anext__()
                stream.cancel()
                with pytest.raises(ClientError) as err:
                    await stream.__anext__()
            return err.value.code

    gate.shut()
    gate.allow(2)
    try:
        assert asyncio.run(run()) is grpc.StatusCode.CANCELLED
        wait_for(lambda: aborted == ["async-cancel"])
    finally:
        gate.open()
    wait_for(lambda: pages_free(server))


def test_server_info_and_health(client):
    info = client.server_info()
    assert (info.model, info.mesh, info.max_model_len, info.vocab_size) == (
        "tiny-llama", "data=1,stage=1,model=1", 256, 512)
    assert info.version and 0 <= info.load.kv_cache_usage <= 1
    assert info.as_dict()["load"]["num_waiting"] == info.load.num_waiting
    assert client.health() == client.health(SERVICE_NAME) == "SERVING"
    with pytest.raises(ClientError) as err:
        client.health("no.such.Service")
    assert err.value.code is grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("prompt,kind", [("hello", "text"),
                                         ([{"role": "user", "content": "hi"}], "chat")])
def test_a_text_or_chat_prompt_without_a_tokenizer_is_invalid_argument(client, prompt, kind):
    with pytest.raises(ClientError) as err:
        client.generate(prompt, _greedy(2))
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert f"prompt.{kind}: this model has no tokenizer" in err.value.message
    assert str(err.value).startswith("INVALID_ARGUMENT: ")


def test_server_side_checks_keep_their_codes(client, served):
    for prompt, params, words in (([], None, "the prompt is empty"),
                                  ([5, 100000], None, "outside the vocabulary"),
                                  (prompt_ids(9), _greedy(2, logprobs=6), "max_logprobs")):
        with pytest.raises(ClientError) as err:
            client.generate(prompt, params)
        assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT and words in err.value.message
    with client.stream(prompt_ids(10), _greedy(200), request_id="twice") as first:
        next(first)
        with pytest.raises(ClientError) as err:
            client.generate(prompt_ids(10), _greedy(2), request_id="twice")
        assert err.value.code is grpc.StatusCode.ALREADY_EXISTS
    wait_for(lambda: pages_free(served[0]))


@pytest.mark.parametrize("params,message", [
    ({"temperature": -1}, "temperature must be >= 0, got -1.0"),
    ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"top_p": 2}, "top_p must be in (0, 1], got 2.0"),
    ({"seed": 2**32}, "seed must be in [0, 4294967295], got 4294967296"),
    ({"temprature": 0.5}, "unknown SamplingParams fields ['temprature']"),
])
def test_bad_sampling_params_raise_value_error_before_any_rpc(params, message):
    with Client("127.0.0.1:1") as nowhere:  # nothing listens: an RPC would be UNAVAILABLE
        with pytest.raises(ValueError) as err:
            nowhere.generate([5, 6], params)
        assert message in str(err.value)
        with pytest.raises(ValueError):
            nowhere.stream([5, 6], params)
    with pytest.raises(ValueError):
        AsyncClient("127.0.0.1:1").stream([5, 6], params)


def test_a_prompt_of_no_known_form_is_refused_before_any_rpc():
    with Client("127.0.0.1:1") as nowhere:
        with pytest.raises(ValueError, match="only token ids"):
            nowhere.generate([5, "6"])
        with pytest.raises(ValueError, match="exactly the keys"):
            nowhere.generate([{"role": "user", "text": "hi"}])
        with pytest.raises(TypeError, match="prompt must be"):
            nowhere.generate(b"bytes")


def test_an_api_key_is_required_and_its_code_surfaces(spare_llm, tmp_path):
    with _serving(spare_llm, api_key="s3cret") as (_, port):
        target = f"127.0.0.1:{port}"
        for key in (None, "wrong"):
            with Client(target, api_key=key, timeout=30) as denied:
                with pytest.raises(ClientError) as err:
                    denied.generate([5, 6], _greedy(2))
                assert err.value.code is grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(ClientError) as err:
                    denied.server_info()
                assert err.value.code is grpc.StatusCode.UNAUTHENTICATED
                assert denied.health() == "SERVING"  # health stays open
        with Client(target, api_key="s3cret", timeout=30) as allowed:
            assert allowed.generate([5, 6], _greedy(2)).completion_tokens == 2
        key_file = tmp_path / "key"
        key_file.write_text("s3cret\n")
        assert cli.main(["client", "--target", target, "--api-key-file", str(key_file),
                         "--info"]) == 0
        assert cli.main(["client", "--target", target, "--api-key", "wrong", "--info"]) == 2


def test_tls_with_a_root_certificate_as_path_or_bytes(spare_llm, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    with _serving(spare_llm, tls_cert=str(cert), tls_key=str(key)) as (_, port):
        for root in (str(cert), cert.read_bytes()):
            with Client(f"localhost:{port}", tls_root_cert=root, timeout=30) as secure:
                assert secure.generate([5, 6], _greedy(2)).finish_reason == "length"
        with Client(f"localhost:{port}", timeout=10) as plain:
            with pytest.raises(ClientError) as err:
                plain.server_info()
        assert err.value.code is grpc.StatusCode.UNAVAILABLE


def test_cli_info_prints_server_info_as_json(served, capsys):
    _, target = served
    assert cli.main(["client", "--target", target, "--info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["model"], info["vocab_size"], set(info["load"])) == (
        "tiny-llama", 512, {"num_running", "num_waiting", "kv_cache_usage"})


def test_cli_errors_name_the_status_code_and_exit_2(served, capsys):
    _, target = served
    assert cli.main(["client", "--target", target, "--prompt", "hi", "--raw"]) == 2
    assert capsys.readouterr().err.strip() == (
        "meshserve: error: INVALID_ARGUMENT: prompt.text: this model has no tokenizer; send "
        "token_ids")
    assert cli.main(["client", "--target", target, "--prompt", "hi", "--temperature", "-1"]) == 2
    assert "meshserve: error: temperature must be >= 0" in capsys.readouterr().err
    assert cli.main(["client", "--target", target]) == 2
    assert "give --prompt" in capsys.readouterr().err


def test_the_client_module_imports_no_jax():
    code = ("import sys, meshserve.serving.grpc_api.client\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.slow
def test_cli_client_streams_the_same_answer_as_llm_chat(smollm2_files, capsys):
    smol = LLM(str(smollm2_files.path), **SMOL)
    question = "What is 2+2?"
    greedy = SamplingParams(temperature=0, max_tokens=8)
    (chat,) = smol.chat([{"role": "user", "content": question}], greedy, use_tqdm=False)
    (plain,) = smol.generate("The capital of France is", greedy, use_tqdm=False)
    with _serving(smol) as (_, port):
        target = f"127.0.0.1:{port}"
        code = cli.main(["client", "--target", target, "--prompt", question, "--max-tokens", "8",
                         "--temperature", "0"])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        assert captured.out == chat.outputs[0].text + "\n"
        assert f"[{chat.outputs[0].finish_reason}" in captured.err
        with Client(target, timeout=60) as client:
            completion = client.generate("The capital of France is", greedy)
            assert completion.text == plain.outputs[0].text
            assert completion.token_ids == plain.outputs[0].token_ids
            chunks = [c for c in client.stream("The capital of France is", greedy)
                      if isinstance(c, StreamChunk)]
            assert "".join(c.text for c in chunks) == plain.outputs[0].text
            stream = client.stream("Tell me a long story.", {"max_tokens": 100, "temperature": 0,
                                                              "ignore_eos": True})
            items = [next(stream) for _ in range(4)]
            assert client.abort(stream.request_id)
            *rest, aborted = [*items, *stream]
            assert aborted.finish_reason == "abort"
            assert "".join(c.text for c in rest) == aborted.text != ""
