"""Evaluation of output-length predictors: workloads with known output lengths, a train/test
split, and the error of each predictor on the held-out part.

Workloads (each a list of `LengthSample`: prompt token ids, sampling params, actual output length):
  planted   `planted_length_workload`: seeded synthetic requests whose output length is planted
            in the prompt. Each request belongs to one of six tasks; its prompt is the task's
            fixed 6-token instruction followed by filler drawn from 4,000 common token ids with
            Zipf weights, as in text (lognormal count, median 42). The output length is the
            task's median (6 to 192 tokens) times (prompt length / 48) ** 0.5, times lognormal
            noise (sigma 0.25), clipped to [1, max_tokens] with max_tokens drawn from 128, 256
            and 512. A predictor that knew the task and prompt length would have a log-length
            error of about 0.25. Also usable as a bench workload ("planted-length"): send each
            prompt with `max_tokens=output_len, ignore_eos=True`.
  smollm2   `generate_smollm2_dataset`: seeded chat prompts from task templates (one word, yes or
            no, a haiku, a list, an essay, code, ...) answered greedily by SmolLM2-135M-Instruct
            without ignore_eos, so each length is where the model stopped (or max_tokens).
  jsonl:P   a dataset written by `save_dataset`, one sample a line.

Metrics (`evaluate`), on the test part:
  mae            mean |median prediction - actual| in tokens;
  coverage       per quantile q, the fraction of actual lengths <= the predicted q quantile
                 (a calibrated predictor gives about q);
  reserve_ratio  tokens reserved at the top quantile per actual output token (what page
                 reservation at that quantile would hold).
Predictors compared: `prior` (`PriorPredictor`, no data), `marginal` (the training set's length
quantiles for every request: data, but no features) and `learned` (`LearnedPredictor`).

    python -m meshserve.serving.bench.length_eval --workload planted --out results.json

The committed results were made with (the dataset first, then both evaluations):

    python -m meshserve.serving.bench.length_eval --workload smollm2 --num-requests 160 \
        --dataset benchmarks/results/length-smollm2-dataset.jsonl
    python -m meshserve.serving.bench.length_eval --workload planted \
        --workload jsonl:benchmarks/results/length-smollm2-dataset.jsonl \
        --out benchmarks/results/length-predictor-eval.json

and the predictor and held-out prompts of the serving comparison in docs/benchmarks.md ("Output-length prediction") with:

    python -m meshserve.serving.bench.length_eval \
        --workload jsonl:benchmarks/results/length-smollm2-dataset.jsonl \
        --save-predictor benchmarks/results/length-predictor-smollm2.npz \
        --save-test benchmarks/results/length-smollm2-test-workload.jsonl

Every file this writes is a new one (`meshserve.serving.bench.result_files`): those paths exist
now, so a rerun names new files (`{date}` and `{commit}` in a name are filled in). `--out` is
stamped with the source's commit, and refused from a tree with uncommitted changes unless
`--allow-dirty`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from meshserve.batching.length import (FeatureConfig, LengthFeatures, LengthPrediction,
                                       LengthPredictor, PriorPredictor, check_quantiles,
                                       extract_features)
from meshserve.batching.sampling import SamplingParams
from meshserve.model.length_predictor import LearnedPredictor, PredictorConfig
from meshserve.serving.bench import result_files

PLANTED_MEDIANS = (6, 12, 24, 48, 96, 192)  # each task's median output length at 48 prompt tokens
PLANTED_MAX_TOKENS = (128, 256, 512)
_INSTRUCTION_LEN = 6  # tokens of each task's fixed instruction
_NUM_COMMON = 4000  # the filler vocabulary, drawn with Zipf weights (exponent 1.1)


@dataclasses.dataclass(frozen=True)
class LengthSample:
    """One request and the length of the output it got."""

    prompt_token_ids: list[int]
    params: SamplingParams
    output_len: int


# -- workloads ---------------------------------------------------------------------------------------

def planted_length_workload(num_requests: int, *, vocab_size: int = 49152,
                            seed: int = 0) -> list[LengthSample]:
    """Seeded requests whose output length depends on the prompt (see the module docstring)."""
    num_special = len(PLANTED_MEDIANS) * _INSTRUCTION_LEN + _NUM_COMMON
    if num_requests < 1 or vocab_size < num_special:
        raise ValueError(f"need num_requests >= 1 and vocab_size >= {num_special}, got "
                         f"{num_requests} and {vocab_size}")
    rng = np.random.default_rng(seed)
    ids = rng.choice(vocab_size, num_special, replace=False)
    instructions = ids[:len(PLANTED_MEDIANS) * _INSTRUCTION_LEN].reshape(len(PLANTED_MEDIANS), -1)
    common = ids[len(PLANTED_MEDIANS) * _INSTRUCTION_LEN:]  # filler, in Zipf rank order
    zipf = 1.0 / np.arange(1, _NUM_COMMON + 1) ** 1.1
    return [_planted_sample(rng, instructions, common, zipf / zipf.sum())
            for _ in range(num_requests)]


def _planted_sample(rng: np.random.Generator, instructions: np.ndarray, common: np.ndarray,
                    zipf: np.ndarray) -> LengthSample:
    task = int(rng.integers(len(PLANTED_MEDIANS)))
    num_filler = int(np.clip(round(42 * rng.lognormal(0.0, 0.6)), 2, 250))
    prompt = np.concatenate([instructions[task], rng.choice(common, num_filler, p=zipf)])
    max_tokens = int(rng.choice(PLANTED_MAX_TOKENS))
    length = PLANTED_MEDIANS[task] * (len(prompt) / 48) ** 0.5 * rng.lognormal(0.0, 0.25)
    params = SamplingParams(max_tokens=max_tokens, temperature=float(rng.choice([0.0, 0.8])))
    return LengthSample(prompt.tolist(), params, int(np.clip(round(length), 1, max_tokens)))


_CHAT_TEMPLATES = (
    "Answer with a single word: what color is {thing}?",
    "Reply only yes or no: is {thing} bigger than a house?",
    "Give a one-sentence definition of {topic}.",
    "List three facts about {topic}.",
    "Write a haiku about {thing}.",
    "Explain {topic} to a ten-year-old.",
    "Write a detailed essay about {topic}, with an introduction and a conclusion.",
    "Write a short story about {thing}.",
    "What is {a} plus {b}? Give only the number.",
    "Translate into French: I like {thing}.",
    "Summarize the history of {topic} in one paragraph.",
    "Write a Python function that counts the {thing}s in a list, with comments.",
)
_TOPICS = ("photosynthesis", "gravity", "the internet", "volcanoes", "democracy", "music",
           "the moon", "chess", "rain", "money", "electricity", "bread")
_THINGS = ("a banana", "an elephant", "the sky", "a bicycle", "a cat", "the ocean", "a pencil",
           "a tree", "a robot", "snow")


def chat_prompts(num_prompts: int, *, seed: int = 0) -> list[str]:
    """Seeded user messages drawn from templates that ask for answers of very different length."""
    rng = np.random.default_rng(seed)
    return [_CHAT_TEMPLATES[rng.integers(len(_CHAT_TEMPLATES))].format(
        topic=_TOPICS[rng.integers(len(_TOPICS))], thing=_THINGS[rng.integers(len(_THINGS))],
        a=int(rng.integers(100)), b=int(rng.integers(100))) for _ in range(num_prompts)]


def generate_smollm2_dataset(num_prompts: int, *, seed: int = 0, max_tokens: int = 256,
                             max_num_seqs: int = 16) -> list[LengthSample]:
    """Greedy SmolLM2-135M-Instruct answers to `chat_prompts`, without ignore_eos: each sample's
    length is where the model stopped, or max_tokens."""
    from meshserve.serving.python_api.llm import LLM  # loads the engine only when generating

    # no warm-up: only the buckets this run uses are compiled
    llm = LLM("smollm2-135m-instruct", max_num_seqs=max_num_seqs, max_model_len=512,
              warmup=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    conversations = [[{"role": "user", "content": p}] for p in chat_prompts(num_prompts, seed=seed)]
    outputs = llm.chat(conversations, params)
    return [LengthSample(list(out.prompt_token_ids), params, len(out.outputs[0].token_ids))
            for out in outputs]


def save_dataset(path: str | Path, samples: Sequence[LengthSample]) -> None:
    """One JSON object a line: prompt_token_ids, max_tokens, temperature, ignore_eos, output_len."""
    lines = [json.dumps({"prompt_token_ids": s.prompt_token_ids, "max_tokens": s.params.max_tokens,
                         "temperature": s.params.temperature, "ignore_eos": s.params.ignore_eos,
                         "output_len": s.output_len}) for s in samples]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")


def save_workload(path: str | Path, samples: Sequence[LengthSample]) -> None:
    """The prompts as a `meshserve bench --workload jsonl:PATH` file (prompt_token_ids and
    max_tokens; run it with `--stop-at-eos` so the model decides each length again)."""
    lines = [json.dumps({"prompt_token_ids": s.prompt_token_ids, "max_tokens": s.params.max_tokens})
             for s in samples]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")


def load_dataset(path: str | Path) -> list[LengthSample]:
    """The samples `save_dataset` wrote; a bad line raises ValueError naming it."""
    samples = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            params = SamplingParams(max_tokens=row["max_tokens"], temperature=row["temperature"],
                                    ignore_eos=row["ignore_eos"])
            samples.append(LengthSample(list(row["prompt_token_ids"]), params,
                                        int(row["output_len"])))
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path}:{number}: not a length sample: {error!r}") from error
    return samples


# -- evaluation --------------------------------------------------------------------------------------

class MarginalPredictor:
    """The same distribution for every request: the quantiles of the lengths it observed,
    clipped to each request's bounds. Data but no features: the baseline that shows what the
    features add. Falls back to the prior until it has observed anything."""

    def __init__(self, quantiles: Sequence[float]):
        self.quantiles = check_quantiles(quantiles)
        self._lengths: list[int] = []
        self._prior = PriorPredictor(quantiles)

    def predict(self, features: Sequence[LengthFeatures]) -> list[LengthPrediction]:
        if not self._lengths:
            return self._prior.predict(features)
        values = np.quantile(self._lengths, self.quantiles)
        return [LengthPrediction.clipped(self.quantiles, values, f) for f in features]

    def observe(self, features: LengthFeatures, output_len: int) -> None:
        self._lengths.append(output_len)


def sample_features(sample: LengthSample, config: FeatureConfig) -> LengthFeatures:
    return extract_features(sample.prompt_token_ids, sample.params, config)


def split(samples: Sequence[LengthSample], train_fraction: float,
          seed: int) -> tuple[list[LengthSample], list[LengthSample]]:
    """A seeded shuffle cut into train and test parts."""
    if not 0 < train_fraction < 1:
        raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction}")
    order = np.random.default_rng(seed).permutation(len(samples))
    cut = int(round(train_fraction * len(samples)))
    return [samples[i] for i in order[:cut]], [samples[i] for i in order[cut:]]


def evaluate(predictor: LengthPredictor, features: Sequence[LengthFeatures],
             actual: Sequence[int]) -> dict:
    """MAE of the median, coverage of each quantile and the reserve ratio (module docstring)."""
    predictions = predictor.predict(features)
    actual = np.asarray(actual, np.float64)
    median = np.array([p.median for p in predictions], np.float64)
    coverage = {f"q{round(q * 100)}": float(np.mean(actual <= [p.at(q) for p in predictions]))
                for q in predictor.quantiles}
    top = np.array([p.at(predictor.quantiles[-1]) for p in predictions], np.float64)
    return {"mae": float(np.mean(np.abs(median - actual))), "coverage": coverage,
            "reserve_ratio": float(top.sum() / actual.sum())}


def run_eval(samples: Sequence[LengthSample], *, train_fraction: float = 0.7, seed: int = 0,
             config: PredictorConfig = PredictorConfig(), save_predictor: str | Path | None = None,
             save_test: str | Path | None = None) -> dict:
    """Trains each predictor on the train part and evaluates it on the test part. Optionally
    saves the learned predictor and the test part's prompts as a `meshserve bench` workload
    (`save_workload`), so a serving run can use one on the other."""
    train, test = split(samples, train_fraction, seed)
    learned = LearnedPredictor(config, background=False)
    predictors = {"prior": PriorPredictor(config.quantiles),
                  "marginal": MarginalPredictor(config.quantiles), "learned": learned}
    for sample in train:
        for predictor in predictors.values():
            predictor.observe(sample_features(sample, config.features), sample.output_len)
    start = time.perf_counter()
    if not learned.retrain():
        raise ValueError(f"{len(train)} training samples are fewer than min_samples "
                         f"({config.min_samples})")
    train_seconds = time.perf_counter() - start
    if save_predictor is not None:
        learned.save(save_predictor)
    if save_test is not None:
        save_workload(save_test, test)
    test_features = [sample_features(s, config.features) for s in test]
    actual = [s.output_len for s in test]
    return {"num_train": len(train), "num_test": len(test),
            "mean_output_len": float(np.mean(actual)), "train_seconds": train_seconds,
            "predictors": {name: evaluate(p, test_features, actual)
                           for name, p in predictors.items()}}


# -- command line ------------------------------------------------------------------------------------

def load_workload(name: str, args: argparse.Namespace) -> list[LengthSample]:
    if name == "planted":
        return planted_length_workload(args.num_requests, seed=args.seed)
    if name == "smollm2":
        samples = generate_smollm2_dataset(args.num_requests, seed=args.seed)
        save_dataset(args.dataset, samples)
        return samples
    if name.startswith("jsonl:"):
        return load_dataset(name.removeprefix("jsonl:"))
    raise ValueError(f"unknown workload {name!r}; use planted, smollm2 or jsonl:PATH")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshserve.serving.bench.length_eval",
                                     description="Output-length predictors against the prior.")
    parser.add_argument("--workload", action="append",
                        help="planted, smollm2 (generates and writes --dataset) or jsonl:PATH; "
                             "repeat for several (default: planted)")
    parser.add_argument("--num-requests", type=int, default=2000,
                        help="requests for planted, prompts for smollm2")
    parser.add_argument("--dataset", default="benchmarks/results/length-smollm2-dataset.jsonl",
                        help="the new file the smollm2 workload writes its samples to")
    parser.add_argument("--train-fraction", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the results as JSON to this new file")
    parser.add_argument("--save-predictor", help="write the learned predictor (.npz) to this "
                        "new file; needs a single --workload")
    parser.add_argument("--save-test", help="write the test part's prompts to this new file, as "
                        "a bench workload (JSONL); needs a single --workload")
    result_files.add_allow_dirty_argument(parser)
    args = parser.parse_args(argv)
    if (args.save_predictor or args.save_test) and len(args.workload or ["planted"]) != 1:
        parser.error("--save-predictor and --save-test need a single --workload")
    argv = sys.argv[1:] if argv is None else list(argv)
    command = ["python", "-m", "meshserve.serving.bench.length_eval", *argv]
    results = {"command": shlex.join(command), "results": {}}
    try:
        source, out = _prepare_outputs(args)
        for name in args.workload or ["planted"]:
            result = run_eval(load_workload(name, args), train_fraction=args.train_fraction,
                              seed=args.seed, save_predictor=args.save_predictor,
                              save_test=args.save_test)
            results["results"][name] = result
            print(format_result(name, result))
    except ValueError as error:
        print(f"length_eval: error: {error}", file=sys.stderr)
        return 2
    if out is not None:
        result_files.write_json(out, {"command": results["command"],
                                      "environment": result_files.host_environment(source),
                                      "results": results["results"]})
        print(f"wrote {out}")
    return 0


def _prepare_outputs(args: argparse.Namespace) -> tuple[result_files.Provenance | None,
                                                         Path | None]:
    """Before anything runs: the source the results JSON (`--out`) is stamped with and its new
    file, and each file this run writes (`--dataset` for the smollm2 workload, `--save-predictor`,
    `--save-test`) resolved in `args`; `{date}` and `{commit}` are filled in, and a path that
    exists or a dirty tree without `--allow-dirty` raises ValueError naming the flag."""
    source, out = result_files.prepare_output(args.out, allow_dirty=args.allow_dirty,
                                              flag="--out")
    writes = [("save_predictor", "--save-predictor"), ("save_test", "--save-test")]
    if "smollm2" in (args.workload or []):
        writes.append(("dataset", "--dataset"))
    writes = [(attr, flag) for attr, flag in writes if getattr(args, attr) is not None]
    tree = source or (result_files.source_tree(result_files.SOURCE_DIR) if writes else None)
    for attr, flag in writes:
        path = result_files.output_path(getattr(args, attr), tree, flag=flag)
        result_files.refuse_existing([path], flag=flag)
        setattr(args, attr, str(path))
    return source, out


def format_result(name: str, result: dict) -> str:
    lines = [f"{name}: {result['num_train']} train, {result['num_test']} test, mean output "
             f"{result['mean_output_len']:.1f} tokens, trained in {result['train_seconds']:.2f} s"]
    for predictor, m in result["predictors"].items():
        coverage = "  ".join(f"{q} {c:.2f}" for q, c in m["coverage"].items())
        lines.append(f"  {predictor:9s} MAE {m['mae']:7.1f}  coverage {coverage}  "
                     f"reserve x{m['reserve_ratio']:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
