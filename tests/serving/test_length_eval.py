"""The length-prediction workloads, datasets and the evaluation command."""

import json

import pytest

from meshserve.batching.sampling import SamplingParams
from meshserve.serving.bench import length_eval
from meshserve.serving.bench.length_eval import (LengthSample, chat_prompts, load_dataset,
                                                 planted_length_workload, save_dataset, split)


def test_planted_workload_is_seeded_and_within_bounds():
    samples = planted_length_workload(300, seed=3)
    assert samples == planted_length_workload(300, seed=3)
    assert samples != planted_length_workload(300, seed=4)
    for s in samples:
        assert 1 <= s.output_len <= s.params.max_tokens
        assert len(s.prompt_token_ids) >= 8 and max(s.prompt_token_ids) < 49152
    assert len({s.output_len for s in samples}) > 50  # a spread of lengths, not a few values


def test_dataset_round_trip_and_bad_lines(tmp_path):
    samples = [LengthSample([1, 2, 3], SamplingParams(max_tokens=9, temperature=0.0), 4),
               LengthSample([7], SamplingParams(max_tokens=5, ignore_eos=True), 5)]
    path = tmp_path / "lengths.jsonl"
    save_dataset(path, samples)
    assert load_dataset(path) == samples
    path.write_text('{"prompt_token_ids": [1], "max_tokens": 0, "temperature": 0, '
                    '"ignore_eos": false, "output_len": 1}\n')
    with pytest.raises(ValueError, match="lengths.jsonl:1: not a length sample.*max_tokens"):
        load_dataset(path)


def test_split_and_chat_prompts_are_seeded():
    train, test = split(list(range(10)), 0.7, seed=0)
    assert len(train) == 7 and sorted(train + test) == list(range(10))
    assert chat_prompts(20, seed=1) == chat_prompts(20, seed=1)
    assert len(set(chat_prompts(50))) > 20


@pytest.mark.slow
def test_the_command_prints_and_writes_json(tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert length_eval.main(["--allow-dirty", "--num-requests", "300", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["command"].endswith(f"--num-requests 300 --out {out}")
    planted = result["results"]["planted"]
    assert set(planted["predictors"]) == {"prior", "marginal", "learned"}
    assert planted["num_train"] == 210 and "learned" in capsys.readouterr().out
    assert length_eval.main(["--workload", "nope"]) == 2


def test_the_learned_predictor_and_test_prompts_are_saved_for_a_serving_run(tmp_path):
    """--save-predictor writes what `--length-predictor` loads; --save-test writes the held-out
    prompts as a bench JSONL workload."""
    from meshserve.model.length_predictor import LearnedPredictor
    from meshserve.serving.bench.workloads import load_jsonl_workload

    predictor, workload = tmp_path / "p.npz", tmp_path / "test.jsonl"
    assert length_eval.main(["--num-requests", "200", "--save-predictor", str(predictor),
                             "--save-test", str(workload)]) == 0
    assert LearnedPredictor.load(predictor, background=False).is_trained
    requests = load_jsonl_workload(workload, vocab_size=49152)
    assert len(requests) == 60 and all(r.num_output_tokens in (128, 256, 512) for r in requests)
    with pytest.raises(SystemExit):
        length_eval.main(["--workload", "planted", "--workload", "planted",
                          "--save-test", str(workload)])
