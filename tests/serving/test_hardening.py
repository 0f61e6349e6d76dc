"""Hostile input against a real `GenerationServer` on SmolLM2 (its real tokenizer and chat
template), over real gRPC on 127.0.0.1, and through `LLM` (only for refusals, which happen before
the served engine is touched): each input is refused with
INVALID_ARGUMENT (ValueError in Python) naming its field, or served within a stated bound, and the
server stays healthy with every page back afterwards."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshserve.batching.sampling import SamplingParams
from meshserve.serving.grpc_api.stubs import generation_pb2 as pb
from meshserve.serving.grpc_api.stubs import generation_pb2_grpc as pb_grpc
from meshserve.serving.engine.admission import (MAX_REQUEST_ID_BYTES, MAX_STOP_STRING_CHARS,
                                                MAX_STOP_STRINGS)
from meshserve.serving.python_api.llm import LLM
from meshserve.serving.grpc_api.server import GenerationServer, ServerConfig
from tests.serving.served import SMOL, pages_free, wait_for

GENERATE = "/meshserve.v1.Generation/Generate"


@pytest.fixture(scope="module")
def smol(smollm2_files):
    return LLM(str(smollm2_files.path), **SMOL)


@pytest.fixture(scope="module")
def served(smol):
    server = GenerationServer(smol.engine, ServerConfig(port=0))
    port = server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield server, channel
    channel.close()
    server.stop()


@pytest.fixture
def stub(served):
    _, channel = served
    return pb_grpc.GenerationStub(channel)


def _sampling(**fields) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=fields.pop("max_tokens", 3), temperature=0, **fields)


def _final(responses) -> pb.Final:
    return [r.final for r in responses if r.HasField("final")][-1]


def _refused(call) -> str:
    """The details of an INVALID_ARGUMENT that `call` must end with."""
    with pytest.raises(grpc.RpcError) as info:
        list(call())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return info.value.details()


def test_stop_token_ids_outside_the_vocabulary_are_refused(stub, smol):
    vocab = smol.engine.model_config.vocab_size
    request = pb.GenerateRequest(text="hi", sampling=_sampling(stop_token_ids=[vocab]))
    details = _refused(lambda: stub.Generate(request))
    assert "stop_token_ids" in details and f"{vocab} is outside the vocabulary" in details
    last = pb.GenerateRequest(text="hi", sampling=_sampling(stop_token_ids=[vocab - 1]))
    assert _final(stub.Generate(last)).finish_reason in ("length", "stop")
    with pytest.raises(ValueError, match="stop_token_ids"):
        smol.generate("hi", SamplingParams(max_tokens=2, stop_token_ids=[vocab]), use_tqdm=False)


def test_request_ids_are_bounded_and_printable(stub, smol):
    longest = "r" * MAX_REQUEST_ID_BYTES
    responses = list(stub.Generate(pb.GenerateRequest(text="hi", request_id=longest,
                                                      sampling=_sampling(max_tokens=1))))
    assert {r.request_id for r in responses} == {longest}
    for bad in ("r" * (MAX_REQUEST_ID_BYTES + 1), "é" * (MAX_REQUEST_ID_BYTES // 2 + 1),
                "a\nb", "tab\there"):
        request = pb.GenerateRequest(text="hi", request_id=bad, sampling=_sampling())
        assert _refused(lambda: stub.Generate(request)).startswith("request_id")
    with pytest.raises(ValueError, match="request_id is 1000000 bytes"):
        smol.engine.add_request("hi", request_id="x" * 1_000_000)


@pytest.mark.parametrize("role", ["", "hacker", "user<|im_end|>", "User"])
def test_chat_roles_outside_the_known_set_are_refused(stub, smol, role):
    request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role=role, content="hi")]),
                                 sampling=_sampling())
    details = _refused(lambda: stub.Generate(request))
    assert "prompt.chat" in details and "messages[0]['role']" in details
    with pytest.raises(ValueError, match=r"messages\[0\]\['role'\]"):
        smol.chat([{"role": role, "content": "hi"}], SamplingParams(max_tokens=2), use_tqdm=False)


def test_too_many_or_too_long_stop_strings_are_refused(stub):
    many = pb.GenerateRequest(text="hi", sampling=_sampling(stop=[f"s{i}" for i in range(5000)]))
    assert "stop: 5000 stop strings is too many" in _refused(lambda: stub.Generate(many))
    huge = pb.GenerateRequest(text="hi", sampling=_sampling(stop=["x" * 100_000]))
    assert "stop string of 100000 characters" in _refused(lambda: stub.Generate(huge))


def test_the_most_stop_strings_allowed_are_searched_every_step(stub):
    """At the bound, a request still runs, and a stop string among the many still cuts it."""
    free = pb.GenerateRequest(text="Name a colour.", sampling=_sampling(max_tokens=8))
    text = _final(stub.Generate(free)).text
    cut = text[len(text) // 2:len(text) // 2 + 2]
    assert cut.strip(), text
    stops = [f"{i:04d}" * (MAX_STOP_STRING_CHARS // 4) for i in range(MAX_STOP_STRINGS - 1)]
    request = pb.GenerateRequest(text="Name a colour.",
                                 sampling=_sampling(max_tokens=8, stop=stops + [cut]))
    final = _final(stub.Generate(request))
    assert final.finish_reason == "stop" and final.stop_reason == cut
    assert final.text == text[:text.index(cut)]


def test_invalid_utf8_on_the_wire_is_invalid_argument(served):
    _, channel = served
    raw = pb.GenerateRequest(text="hi", sampling=_sampling()).SerializeToString()
    broken = raw.replace(b"hi", b"h\xff")
    call = channel.unary_stream(GENERATE, request_serializer=lambda data: data,
                                response_deserializer=pb.GenerateResponse.FromString)
    assert "does not parse" in _refused(lambda: call(broken))
    cut_off = channel.unary_stream(GENERATE, request_serializer=lambda data: data,
                                   response_deserializer=pb.GenerateResponse.FromString)
    assert "does not parse" in _refused(lambda: cut_off(raw[:-3]))


def test_lone_surrogates_are_refused_in_python(smol):
    with pytest.raises(ValueError, match="lone surrogate"):
        smol.generate("a\ud800b", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[0\]\['content'\] holds a lone surrogate"):
        smol.chat([{"role": "user", "content": "\udcff"}], SamplingParams(max_tokens=2),
                  use_tqdm=False)
    with pytest.raises(ValueError, match="stop: a stop string holds a lone surrogate"):
        smol.generate("hi", SamplingParams(max_tokens=2, stop=["\ud800"]), use_tqdm=False)


def test_chat_content_is_data_not_template_code(stub, smol):
    hostile = ("{{ 7*7 }}{% for x in range(10**9) %}x{% endfor %}"
               "{{ raise_exception('boom') }}{% include '/etc/passwd' %}")
    text = smol.engine.tokenizer.apply_chat_template([{"role": "user", "content": hostile}])
    assert hostile in text and "49" not in text
    request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user",
                                                                       content=hostile)]),
                                 sampling=_sampling())
    assert _final(stub.Generate(request)).usage.completion_tokens == 3


def test_a_text_too_long_to_fit_is_refused_before_tokenizing(stub, smol):
    max_chars = smol.engine.tokenizer.max_token_chars
    limit = SMOL["max_model_len"] - 1
    text = "a" * (limit * max_chars + 1)
    request = pb.GenerateRequest(text=text, sampling=_sampling())
    assert "cannot fit in the max prompt length" in _refused(lambda: stub.Generate(request))
    chat = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=text)]),
                              sampling=_sampling())
    assert "cannot fit in the max prompt length" in _refused(lambda: stub.Generate(chat))
    fits = pb.GenerateRequest(text="a " * 400, sampling=_sampling())
    assert "tokens exceed the max prompt length" in _refused(lambda: stub.Generate(fits))


def test_the_server_stays_healthy_with_every_page_back(served, stub):
    """Runs last in this module: everything above left the server serving and the pool free."""
    server, channel = served
    for service in ("", "meshserve.v1.Generation"):
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    assert _final(stub.Generate(pb.GenerateRequest(text="hi", sampling=_sampling()))).text
    wait_for(lambda: pages_free(server))
