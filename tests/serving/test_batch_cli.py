"""`meshserve batch`, in-process: JSONL in, one result line per request out, resumable.

The tests run the tiny random Llama preset on `prompt_token_ids` lines, so no tokenizer is needed
(tests/serving/test_cli.py covers a real model end to end).
"""

import contextlib
import io
import json

import pytest

from meshserve.serving.cli.main import main

# tests/serving/test_engine.py's shapes: its programs, compiled once a session.
ENGINE_FLAGS = ["--num-pages", "64", "--page-size", "16", "--max-num-seqs", "4",
                "--max-num-batched-tokens", "32", "--prefill-chunk", "16", "--max-model-len", "128",
                "--max-logprobs", "5", "--no-warmup", "--no-compilation-cache"]
REQUESTS = [
    {"id": "a", "prompt_token_ids": [5, 6, 7], "max_tokens": 4},
    {"id": "b", "prompt_token_ids": list(range(10, 50)), "max_tokens": 9},
    {"id": "c", "prompt_token_ids": [9], "max_tokens": 6, "temperature": 0.8, "seed": 3},
    {"id": "d", "prompt_token_ids": [3, 1, 4, 1, 5], "max_tokens": 2, "logprobs": 2},
    {"prompt_token_ids": [8] * 20, "max_tokens": 5},  # no id: it is the line number, "5"
]


def _write_jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def _batch(input_path, output_path) -> tuple[int, str]:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["batch", "--model", "tiny-llama", "--input", str(input_path),
                     "--output", str(output_path), *ENGINE_FLAGS])
    return code, stdout.getvalue()


def _lines(path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines(keepends=True)


@pytest.fixture(scope="module")
def requests_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("batch") / "requests.jsonl"
    _write_jsonl(path, [r | {"ignore_eos": True, "temperature": r.get("temperature", 0)}
                        for r in REQUESTS])
    return path


@pytest.fixture(scope="module")
def full_run(requests_file):
    """One run over every request into a fresh file: (exit code, stdout, {id: result line})."""
    output = requests_file.with_name("full.jsonl")
    code, stdout = _batch(requests_file, output)
    return code, stdout, {json.loads(line)["id"]: line for line in _lines(output)}


def test_every_request_gets_one_result_line(full_run):
    code, stdout, lines = full_run
    assert code == 0
    assert "5 requests, 0 already done, 5 to run" in stdout
    assert sorted(lines) == ["5", "a", "b", "c", "d"]
    for request in REQUESTS:
        record = json.loads(lines[request.get("id", "5")])
        assert record["finish_reason"] == "length"
        assert record["num_output_tokens"] == len(record["token_ids"]) == request["max_tokens"]
        assert record["num_prompt_tokens"] == len(request["prompt_token_ids"])
        assert all(isinstance(t, int) for t in record["token_ids"])


def test_rerun_skips_done_ids_and_recomputes_a_torn_line(requests_file, full_run, tmp_path):
    _, _, reference = full_run
    output = tmp_path / "out.jsonl"
    kept = json.dumps({"id": "a", "text": "", "token_ids": [0], "finish_reason": "length",
                       "stop_reason": None, "num_prompt_tokens": 3, "num_output_tokens": 1}) + "\n"
    torn = reference["c"][:25]  # a write cut short: no newline
    output.write_text(kept + reference["b"] + torn, encoding="utf-8")

    code, stdout = _batch(requests_file, output)
    assert code == 0 and "5 requests, 2 already done, 3 to run" in stdout
    lines = _lines(output)
    assert lines[:2] == [kept, reference["b"]]  # left exactly as they were
    appended = {json.loads(line)["id"]: line for line in lines[2:]}
    assert len(appended) == len(lines) - 2 == 3
    assert appended == {i: reference[i] for i in ("c", "d", "5")}

    code, stdout = _batch(requests_file, output)
    assert code == 0 and "5 already done, 0 to run" in stdout
    assert _lines(output) == lines


GOOD = '{"id": "ok", "prompt_token_ids": [1, 2]}'


@pytest.mark.parametrize("lines, line_number, message", [
    ([GOOD, '{"id": "x", "prompt_token_ids": [1, 2]'], 2, "not valid JSON"),
    ([GOOD, '[1, 2]'], 2, "must be a JSON object"),
    ([GOOD, '{"prompt_token_ids": [1], "temprature": 0}'], 2, "unknown fields ['temprature']"),
    ([GOOD, '{"prompt": "hi", "prompt_token_ids": [1]}'], 2, "exactly one of"),
    ([GOOD, '{"id": "y", "max_tokens": 3}'], 2, "exactly one of"),
    ([GOOD, '{"prompt_token_ids": [1], "temperature": -1}'], 2, "temperature must be >= 0"),
    ([GOOD, '{"prompt_token_ids": [1], "max_tokens": "8"}'], 2, "max_tokens must be an int"),
    ([GOOD, '{"id": "x", "prompt_token_ids": [1]}', '{"id": "ok", "prompt_token_ids": [3]}'], 3,
     "'ok'"),
])
def test_bad_input_fails_before_any_work(tmp_path, capsys, lines, line_number, message):
    input_path, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    input_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    code, _ = _batch(input_path, output)
    err = capsys.readouterr().err
    assert code == 2
    assert f"{input_path}:{line_number}" in err and message in err
    assert not output.exists()


def test_missing_input_file_is_a_clear_error(tmp_path, capsys):
    code, _ = _batch(tmp_path / "missing.jsonl", tmp_path / "out.jsonl")
    assert code == 2
    assert "missing.jsonl does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_text_prompts_on_a_model_without_tokenizer_fail_before_any_work(tmp_path, capsys):
    input_path, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(input_path, [{"id": "t", "prompt": "Hello"}])
    code, _ = _batch(input_path, output)
    assert code == 2 and "has no tokenizer" in capsys.readouterr().err
    assert not output.exists()

