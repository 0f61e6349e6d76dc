"""`meshserve bench --structured`: the same requests unconstrained, then each held to a JSON
schema (one shared, or request i to shipped schema i mod 54), and what the run reports: the
throughput ratio, TTFT p50 of both runs, the host time of the masks per step and how much of it
the device hid. A tiny
random-weight Llama saved with the tiny byte-level tokenizer, three short requests, the shapes of
tests/serving/test_structured.py (so the compilation cache already holds its programs)."""

import json

import pytest

from meshserve.model.config import ModelConfig
from meshserve.model.loading.checkpoint import save_checkpoint
from meshserve.model.transformer import model_from_params
from meshserve.serving.bench import structured_cost
from meshserve.serving.cli.main import main
from tests.conftest import random_params
from tests.serving.tiny_tokenizer import tiny_tokenizer

ENGINE = ["--num-pages", "64", "--page-size", "16", "--max-num-seqs", "4",
          "--max-num-batched-tokens", "8", "--prefill-chunk", "8", "--max-model-len", "160",
          "--max-logprobs", "5", "--no-compilation-cache", "--no-warmup", "--no-progress",
          "--overlap-masks"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = ModelConfig.preset("tiny-llama")
    model = model_from_params(config, random_params(config))
    return save_checkpoint(model, tiny_tokenizer(), tmp_path_factory.mktemp("tiny") / "ckpt")


def test_each_request_held_to_its_own_schema_reports_ratio_ttft_and_mask_time(checkpoint,
                                                                              tmp_path, capsys):
    out = tmp_path / "structured.json"
    assert main(["bench", "--structured", "json-schemas", "--model", str(checkpoint),
                 "--workload", "fixed-8x6", "--num-requests", "3", "--output", str(out),
                 "--allow-dirty", *ENGINE]) == 0
    printed = capsys.readouterr().out
    assert "TTFT p50" in printed and "ms per step with constrained rows" in printed
    results = json.loads(out.read_text())["structured"]
    assert results["constraint_set"] == "json-schemas"
    assert results["constraint"].startswith("54 distinct constraints")
    assert [results[run]["output_tokens"] for run in results["order"]] == [18, 18]
    assert results["ratio_output_tokens_per_s"] > 0
    assert all(value > 0 for value in results["ttft_p50_s"].values())
    assert results["ratio_ttft_p50"] == pytest.approx(results["ttft_p50_s"]["constrained"]
                                                      / results["ttft_p50_s"]["unconstrained"])
    assert 0 < results["mask_steps"] <= results["constrained"]["num_steps"]
    assert results["matcher_advances"] == 18 and results["mask_ms_per_constrained_step"] > 0
    overlap = results["overlap"]  # the masks computed while each next forward pass ran
    assert 0 < overlap["steps"] < results["mask_steps"] and "masks beside the forward" in printed
    assert overlap["hidden_ms_per_step"] + overlap["exposed_ms_per_step"] == pytest.approx(
        overlap["mask_ms_per_step"])
    assert 0 <= overlap["hidden_fraction"] <= 1


def test_the_schema_set_holds_each_request_to_a_shipped_schema_as_json_lines(capsys):
    schemas = structured_cost.constraints("json-schemas")
    assert len(schemas) == len(structured_cost.load_schemas()) == 54
    assert len({s.key for s in schemas}) == 54 and all(s.kind == "grammar" for s in schemas)
    assert structured_cost.constraints("json-lines") == [structured_cost.JSON_LINES]
    with pytest.raises(ValueError, match="unknown constraint set 'xml'"):
        structured_cost.constraints("xml")
    with pytest.raises(SystemExit):
        main(["bench", "--structured", "xml"])
