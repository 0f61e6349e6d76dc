"""LoRA adapters through the server: `--lora-modules` served by name over HTTP (the official
`openai` client) and gRPC, `/v1/models` cards, loading and unloading while serving, refusals,
and the adapter metrics.

One tiny Llama and its peft adapters (`tests/serving/test_lora.py`'s `served` fixture, with a
character-level tokenizer of its 128 ids beside it) and one engine for the module: its expected
tokens come from `LLM.generate(..., lora_request=)` on the same engine before it is served (and
equal HF + peft's), then a real server on 127.0.0.1 serves the base model as "base" and "alias",
and "attn" (`name=path`) and "mlp" (vLLM's JSON form, its base model "alias") by name, with
runtime updates allowed ("out" is loaded while serving). `meshserve client --lora-name` runs
against the same server.
"""

from __future__ import annotations

import http.client
import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")

from tokenizers import Tokenizer as BackendTokenizer  # noqa: E402
from tokenizers import decoders, models  # noqa: E402

from meshserve import LLM, SamplingParams  # noqa: E402
from meshserve.serving.cli import main as cli  # noqa: E402
from meshserve.serving.engine.core import Engine  # noqa: E402
from meshserve.serving.engine.engine_config import EngineConfig  # noqa: E402
from meshserve.serving.grpc_api.client import Client, ClientError  # noqa: E402
from meshserve.serving.grpc_api.server import GenerationServer, ServerConfig  # noqa: E402
from meshserve.serving.engine.served_adapters import LoraModule, parse_lora_modules  # noqa: E402
from meshserve.serving.http_api.app import HttpServer  # noqa: E402
from tests.serving.fake_runner import FakeModelRunner  # noqa: E402
from tests.serving.served import StepGate, openai_server  # noqa: E402
from tests.serving.test_lora import (ENGINE, NUM_NEW, PROMPTS, _hf_model, peft,  # noqa: E402
                                     served)  # noqa: F401 (the module's fixture)

BASE, ALIAS = "base", "alias"  # the base model's served names
CASES = [(p, a) for p in range(len(PROMPTS)) for a in (None, "attn", "mlp", "out")]
FAKE = dict(num_pages=32, page_size=4, max_num_seqs=2, max_num_batched_tokens=16,
            prefill_chunk=16, max_model_len=64, warmup=False, compilation_cache=False)


def _text(ids) -> str:
    """The character-level tokenizer's text of token ids: id i is chr(0x100 + i)."""
    return "".join(chr(0x100 + i) for i in ids)


@pytest.fixture(scope="module")
def expected(served, tmp_path_factory):  # noqa: F811
    """The engine, and the tokens `LLM.generate` gives each (prompt, adapter) case on it. The
    model directory gets a tokenizer of its own, one character per id (no EOS), so that text
    prompts (`meshserve client`) can be served."""
    base_dir, requests, want = served
    model_dir = shutil.copytree(base_dir, tmp_path_factory.mktemp("lora-server") / "base")
    tokenizer = BackendTokenizer(models.BPE(vocab={_text([i]): i for i in range(128)},
                                            merges=[]))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    llm = LLM(str(model_dir), **ENGINE)
    assert llm.tokenizer.encode(_text(PROMPTS[2])) == PROMPTS[2]
    outputs = llm.generate([PROMPTS[p] for p, _ in CASES], _greedy(), use_tqdm=False,
                           lora_request=[requests.get(a) for _, a in CASES])
    tokens = {case: out.outputs[0].token_ids for case, out in zip(CASES, outputs)}
    assert all(tokens[case] == want[case].tokens for case in CASES)  # HF + peft's
    mixed = [tuple(tokens[p, a]) for p, a in CASES if a != "out"]
    assert len(set(mixed)) == len(mixed)  # "attn" and "mlp" change every prompt's tokens
    return llm.engine, tokens


@pytest.fixture(scope="module")
def serving(served, expected):  # noqa: F811
    """(server, openai client, step gate) serving "attn" and "mlp" beside the base model."""
    _, requests, _ = served
    engine, _ = expected
    gate = StepGate(engine)
    modules = (f"attn={requests['attn'].lora_path}",
               json.dumps({"name": "mlp", "path": requests["mlp"].lora_path,
                           "base_model_name": ALIAS}))
    with openai_server(engine, served_model_name=(BASE, ALIAS), lora_modules=modules,
                       allow_runtime_lora_updating=True) as (server, client):
        yield server, client, gate


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)


def _completion(client, model: str, prompt: int):
    return client.completions.create(
        model=model, prompt=PROMPTS[prompt], max_tokens=NUM_NEW, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True})


def _http(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, str]:
    """(status, body text) of one request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, None if body is None else json.dumps(body),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def _post(server, path: str, body: dict) -> tuple[int, str]:
    return _http(server.http_port, "POST", path, body)


def _error(text: str) -> dict:
    return json.loads(text)["error"]


def _metric(server, name: str, **labels) -> float:
    _, text = _http(server.http_port, "GET", "/metrics")
    for line in text.splitlines():
        match = re.fullmatch(rf"meshserve:{name}\{{(.*)\}} (\S+)", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            return float(match.group(2))
    raise AssertionError(f"no sample {name} {labels}")


def test_the_model_field_selects_an_adapter_or_the_base_model(serving, expected):
    """Every served case at once (steps mix the adapters and the base model): the adapter's
    tokens, as LLM.generate gives them, and the response names the model asked for."""
    server, client, _ = serving
    _, tokens = expected
    cases = [(p, a) for p, a in CASES if a != "out"]
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda case: _completion(client, case[1] or BASE, case[0]),
                                cases))
    for (p, a), answer in zip(cases, answers):
        assert answer.model == (a or BASE)
        assert answer.choices[0].token_ids == tokens[p, a], (p, a)


def test_v1_models_lists_each_adapter_with_its_parent(serving, served):  # noqa: F811
    server, client, _ = serving
    _, requests, _ = served
    cards = {card.id: card for card in client.models.list().data}
    assert list(cards) == [BASE, ALIAS, "attn", "mlp"]
    assert cards[BASE].parent is None
    for name, parent in (("attn", BASE), ("mlp", ALIAS)):  # mlp's JSON module names its base
        assert (cards[name].parent, cards[name].root) == (parent, requests[name].lora_path)
    assert client.models.retrieve("mlp").root == requests["mlp"].lora_path
    assert client.models.retrieve("mlp").parent == ALIAS


def test_an_unknown_model_is_404_on_every_route(serving):
    server, client, _ = serving
    with pytest.raises(openai.NotFoundError) as raised:
        _completion(client, "nope", 0)
    assert raised.value.code == "model_not_found" and "'attn'" in raised.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="x")


def test_grpc_lora_name_selects_an_adapter_and_server_info_lists_them(serving, expected):
    server, _, _ = serving
    _, tokens = expected
    with Client(f"127.0.0.1:{server.port}") as client:
        assert client.server_info().lora_names == ("attn", "mlp")
        params = dict(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
        assert client.generate(PROMPTS[1], params, lora_name="mlp").token_ids == tokens[1, "mlp"]
        assert client.generate(PROMPTS[1], params).token_ids == tokens[1, None]
        with pytest.raises(ClientError, match="lora_name: no LoRA adapter is served as 'nope'"):
            client.generate(PROMPTS[1], params, lora_name="nope")


def test_adapters_load_and_unload_while_serving(serving, served, expected, tmp_path):  # noqa: F811
    """"out" loaded, used and unloaded; a request running with it when it is unloaded finishes
    with its tokens; bad loads are 400s naming the field, and change nothing."""
    server, client, gate = serving
    base_dir, requests, _ = served
    _, tokens = expected
    load, unload = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
    path = requests["out"].lora_path
    status, text = _post(server, load, {"lora_name": "out", "lora_path": path})
    assert status == 200, text
    assert _completion(client, "out", 2).choices[0].token_ids == tokens[2, "out"]
    assert [card.id for card in client.models.list().data] == [BASE, ALIAS, "attn", "mlp",
                                                               "out"]

    gate.shut()  # one request runs with "out" (its slot pinned) while it is unloaded
    try:
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(_completion, client, "out", 0)
            gate.step_until(lambda: server.engine.scheduler.num_running == 1)
            assert _post(server, unload, {"lora_name": "out"})[0] == 200
            gate.open()
            assert running.result(timeout=60).choices[0].token_ids == tokens[0, "out"]
    finally:
        gate.open()
    with pytest.raises(openai.NotFoundError):
        _completion(client, "out", 0)
    status, text = _post(server, unload, {"lora_name": "out"})
    assert (status, _error(text)["param"], _error(text)["code"]) == (
        404, "lora_name", "model_not_found")

    wide = tmp_path / "wide"  # rank 16 over max_lora_rank 8
    peft.get_peft_model(_hf_model(base_dir), peft.LoraConfig(
        r=16, target_modules=["q_proj"])).save_pretrained(wide)
    for body, param, named in (
            ({"lora_name": "wide", "lora_path": str(wide)}, "lora_path", "max_lora_rank"),
            ({"lora_name": "gone", "lora_path": str(tmp_path / "gone")}, "lora_path",
             "not a directory"),
            ({"lora_name": "attn", "lora_path": path}, "lora_name", "already served"),
            ({"lora_name": BASE, "lora_path": path}, "lora_name", "base model"),
            ({"lora_name": "x"}, "lora_path", "required"),
            ({"lora_name": "x", "lora_path": path, "load_inplace": True}, "load_inplace",
             "not a field")):
        status, text = _post(server, load, body)
        error = _error(text)
        assert (status, error["param"]) == (400, param), (body, error)
        assert named in error["message"], error
    assert [card.id for card in client.models.list().data] == [BASE, ALIAS, "attn", "mlp"]


def test_cli_client_lora_name_runs_the_adapter(serving, expected, capsys):
    """`meshserve client --lora-name` streams the adapter's answer; without it the base
    model's; an unknown name exits 2 with NOT_FOUND naming lora_name."""
    server, _, _ = serving
    _, tokens = expected
    target = f"127.0.0.1:{server.port}"
    prompt = ["--prompt", _text(PROMPTS[2]), "--raw", "--max-tokens", str(NUM_NEW)]
    assert tokens[2, "mlp"] != tokens[2, None]
    for name in ("mlp", "attn", None):
        lora = [] if name is None else ["--lora-name", name]
        assert cli.main(["client", "--target", target, *prompt, *lora]) == 0
        out = capsys.readouterr()
        assert out.out == _text(tokens[2, name]) + "\n", name
        assert f"{NUM_NEW} completion tokens" in out.err
    assert cli.main(["client", "--target", target, *prompt, "--lora-name", "nope"]) == 2
    assert "NOT_FOUND: lora_name: no LoRA adapter is served as 'nope'" in capsys.readouterr().err
    assert cli.main(["client", "--target", target, *prompt, "--lora-name", " "]) == 2
    assert "--lora-name must name a served LoRA adapter" in capsys.readouterr().err


def test_lora_modules_take_vllms_json_form():
    """`name=path` and vLLM's JSON object, mixed; the JSON form's faults are refused naming the
    key."""
    modules = parse_lora_modules([
        "sql=/a/sql", '{"name": "chat", "path": "/a/chat"}',
        ' {"name": "code", "path": "/a/code", "base_model_name": "llama"}'])
    assert modules == (LoraModule("sql", "/a/sql"), LoraModule("chat", "/a/chat"),
                       LoraModule("code", "/a/code", "llama"))
    for value, named in (
            ('{"name": "a", "path": "/x", "scale": 2}', "unknown key 'scale'"),
            ('{"path": "/x"}', "has no 'name'"),
            ('{"name": "a"}', "has no 'path'"),
            ('{"name": "", "path": "/x"}', "'name' must be a non-empty string"),
            ('{"name": "a", "path": 3}', "'path' must be a non-empty string"),
            ('{"name": "a", "path": "/x", "base_model_name": ""}',
             "'base_model_name' must be a non-empty string"),
            ('{"name": "a", "path": "/x", "base_model_name": null}', None),
            ('{"name": "a", "path": "/x"', "is not valid JSON"),
            ('["a", "/x"]', "is not name=path"),
            ('{"name": "a", "path": "/x"} ', None)):
        if named is None:
            assert parse_lora_modules([value]) == (LoraModule("a", "/x"),)
            continue
        with pytest.raises(ValueError, match=re.escape(named)):
            parse_lora_modules([value])
    with pytest.raises(ValueError, match="the name 'a' is given twice"):
        parse_lora_modules(['{"name": "a", "path": "/x"}', "a=/y"])


def test_runtime_routes_need_the_flag(serving):
    """The same loop and adapters behind an app without --allow-runtime-lora-updating."""
    server, _, _ = serving
    config = ServerConfig(port=0, http_port=0, served_model_name=(BASE,))
    closed = HttpServer(server.loop, config, adapters=server.adapters)
    port = closed.start()
    try:
        status, text = _http(port, "POST", "/v1/load_lora_adapter",
                             {"lora_name": "out", "lora_path": "/x"})
        assert status == 404 and "--allow-runtime-lora-updating" in _error(text)["message"]
        assert server.adapters.get("out") is None
    finally:
        closed.stop()


def test_metrics_count_requests_per_adapter_and_slot_loads(serving):
    server, client, _ = serving
    before = _metric(server, "lora_requests_total", lora_name="attn")
    _completion(client, "attn", 0)
    with Client(f"127.0.0.1:{server.port}") as grpc_client:
        grpc_client.generate(PROMPTS[0], dict(max_tokens=1), lora_name="attn")
    assert _metric(server, "lora_requests_total", lora_name="attn") == before + 2
    stats, slots = server.engine.stats, server.engine.scheduler.adapter_slots
    assert _metric(server, "lora_adapter_loads_total") == stats.num_adapter_loads > 0
    assert _metric(server, "lora_adapter_evictions_total") == slots.num_evictions > 0
    assert _metric(server, "lora_resident_adapters") == slots.num_resident == 2
    assert _metric(server, "lora_max_adapters") == 2


def test_lora_flags_need_enable_lora_and_bad_modules_fail_at_start(expected):
    config = EngineConfig(**FAKE)
    plain = Engine(FakeModelRunner(config), None, config)
    for flags in (dict(lora_modules=("a=/x",)), dict(allow_runtime_lora_updating=True)):
        with pytest.raises(ValueError, match="needs --enable-lora"):
            GenerationServer(plain, ServerConfig(port=0, **flags))
    with pytest.raises(ValueError, match="not name=path"):
        ServerConfig(lora_modules=("attn",))
    with pytest.raises(ValueError, match="given twice"):
        ServerConfig(lora_modules=("a=/x", "a=/y"))
    with pytest.raises(ValueError, match="unknown key 'scale'"):
        ServerConfig(lora_modules=('{"name": "a", "path": "/x", "scale": 2}',))
    other_base = '{"name": "a", "path": "/x", "base_model_name": "other"}'
    with pytest.raises(ValueError, match="base_model_name 'other' is not a served model name"):
        ServerConfig(served_model_name=(BASE,), lora_modules=(other_base,)).check_lora(True)
    engine, _ = expected
    with pytest.raises(ValueError, match="--lora-modules bad=/nonexistent: lora_path"):
        GenerationServer(engine, ServerConfig(port=0, lora_modules=("bad=/nonexistent",)))
    with pytest.raises(ValueError, match="base_model_name 'other' is not a served model name"):
        GenerationServer(engine, ServerConfig(port=0, lora_modules=(other_base,)))
