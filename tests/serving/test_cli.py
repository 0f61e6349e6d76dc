"""The `meshserve` command line, in-process."""

import dataclasses

import pytest

from meshserve.serving.cli.main import build_parser, main
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.options import dataclass_from_args


def test_every_engine_field_is_a_flag():
    args = build_parser().parse_args(["generate", "--prompt", "x", "--num-pages", "9",
                                      "--page-size", "8", "--max-model-len", "64",
                                      "--no-warmup", "--policy", "static"])
    config = dataclass_from_args(EngineConfig, args)
    assert (config.num_pages, config.page_size, config.max_model_len) == (9, 8, 64)
    assert config.warmup is False and config.policy == "static"
    defaults = dataclass_from_args(EngineConfig, build_parser().parse_args(["demo"]))
    assert defaults == EngineConfig()
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= set(vars(args))


def test_missing_model_path_is_a_clear_error(capsys, tmp_path):
    code = main(["generate", "--model", str(tmp_path / "nope.gguf"), "--prompt", "hi"])
    assert code == 2
    err = capsys.readouterr().err
    assert "nope.gguf" in err and "Known names" in err


def test_invalid_runner_config_is_a_clear_error(capsys):
    code = main(["generate", "--model", "tiny-llama", "--prompt", "hi", "--num-pages", "1",
                 "--no-compilation-cache"])
    assert code == 2
    assert "num_pages must be >= 2" in capsys.readouterr().err


def test_invalid_policy_is_a_clear_error(capsys):
    code = main(["generate", "--model", "tiny-llama", "--prompt", "hi", "--policy", "fifo",
                 "--no-compilation-cache"])
    assert code == 2
    assert "policy must be one of" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_answers_with_smollm2(capsys, smollm2_files):
    # tests/serving/served.py's SMOL shapes: the programs the in-process SmolLM2 tests share.
    code = main(["generate", "--model", str(smollm2_files.path), "--prompt",
                 "What is the capital of France?", "--max-tokens", "8", "--num-pages", "64",
                 "--max-num-seqs", "4", "--prefill-chunk", "32", "--max-model-len", "256",
                 "--max-num-batched-tokens", "64", "--max-logprobs", "3",
                 "--no-compilation-cache", "--no-warmup"])
    out = capsys.readouterr().out
    assert code == 0
    assert "Paris" in out and "tokens/s" in out


def test_model_without_tokenizer_is_a_clear_error(capsys):
    assert main(["generate", "--model", "tiny-llama", "--prompt", "hi",
                 "--no-compilation-cache"]) == 2
    assert "has no tokenizer" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_reports_its_startup(capsys, smollm2_files):
    """The lines `meshserve bench --startup` reads: load, the compiled set, the first token."""
    from meshserve.serving.bench.bench import parse_startup

    code = main(["generate", "--model", str(smollm2_files.path), "--prompt", "hi",
                 "--max-tokens", "2", "--num-pages", "16", "--max-num-seqs", "1",
                 "--prefill-chunk", "8", "--max-num-batched-tokens", "8", "--max-model-len", "64",
                 "--no-compilation-cache"])
    assert code == 0
    startup = parse_startup(capsys.readouterr().err)
    assert startup["programs"] == 4  # token buckets 1, 2, 4, 8 (prompt logprobs: on first use)
    assert startup["programs_from_cache"] == 0
    assert 0 < startup["load_s"] and 0 < startup["compile_s"] < startup["first_token_s"]
