"""The benchmark requests: `BenchRequest`, the named workloads that make them, and the user's own
JSONL workloads. Shared by the engine's benchmarks (`bench`), the load generator (`loadgen`), the
peers (`peers`, `llama_server`), the mesh sweep and the quality check.

The workloads (prompt tokens are seeded random ids; every output is forced to its target length with
`ignore_eos` and `max_tokens`, so both policies do the same work):
  chat-mix    prompts lognormal, median 64, sigma 1.0, clipped to [8, 512];
              outputs lognormal, median 48, sigma 1.0, clipped to [4, 256]
  long        prompts uniform in [256, 1024], outputs uniform in [16, 128]
  fixed-IxO   every request has I prompt and O output tokens, e.g. fixed-128x64
  shared-prefix  4 system prompts of 256 tokens, each request one of them (at random) then its
              own question, lognormal median 32, clipped to [8, 128]; outputs as chat-mix but
              clipped to [4, 128]: what prefix caching is for
  grounded    text prompts whose answers copy, quote or edit their input (`grounded_workload`:
              repeat a passage, change one word, quote and summarise, rename a function in
              code), greedy, ended by the model's EOS (at most 256 tokens): where speculative
              decoding by prompt lookup pays. Needs the model's tokenizer.

  jsonl:PATH  the user's own prompts (`load_jsonl_workload`): one JSON object a line with
              `prompt` (text, through the model's tokenizer) or `prompt_token_ids`, and an
              optional `max_tokens` (the output length)

Plain Python and numpy: the load generator and the llama-server peer import this without jax.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path

import numpy as np

from meshserve.batching.adapters import LoRARequest
from meshserve.batching.sampling import SamplingParams
from meshserve.batching.structured import StructuredOutput


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    """`num_output_tokens` is the output's length, forced with `ignore_eos`; with
    `stop_at_eos` it is only a cap, and the model's own EOS ends the output (`--stop-at-eos`)."""

    prompt_token_ids: list[int]
    num_output_tokens: int
    stop_at_eos: bool = False
    structured: StructuredOutput | None = None  # `meshserve bench --structured`
    lora_request: LoRARequest | None = None  # `meshserve bench --lora-adapters`

    def params(self) -> SamplingParams:
        """Greedy, so every policy and ordering generates the same tokens."""
        return SamplingParams(max_tokens=self.num_output_tokens, ignore_eos=not self.stop_at_eos,
                              temperature=0.0, structured=self.structured)


def make_workload(name: str, *, num_requests: int, vocab_size: int,
                  seed: int = 0) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    if name == "shared-prefix":
        return _shared_prefix_workload(num_requests, vocab_size, rng)
    prompt_lens, output_lens = _lengths(name, num_requests, rng)
    return [BenchRequest(prompt_token_ids=rng.integers(0, vocab_size, int(p)).tolist(),
                         num_output_tokens=int(o)) for p, o in zip(prompt_lens, output_lens)]


def _lengths(name: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if name == "chat-mix":
        prompts = np.clip(np.round(64 * rng.lognormal(0.0, 1.0, n)), 8, 512)
        outputs = np.clip(np.round(48 * rng.lognormal(0.0, 1.0, n)), 4, 256)
        return prompts, outputs
    if name == "long":
        return rng.integers(256, 1025, n), rng.integers(16, 129, n)
    if name.startswith("fixed-"):
        prompt_len, output_len = (int(x) for x in name.removeprefix("fixed-").split("x"))
        return np.full(n, prompt_len), np.full(n, output_len)
    if name == "grounded":
        raise ValueError("the grounded workload is text: build it with "
                         "grounded_workload(tokenizer)")
    raise ValueError(f"unknown workload {name!r}; use chat-mix, long, shared-prefix, grounded or "
                     f"fixed-IxO (fixed-128x64)")


SHARED_PREFIXES, SHARED_PREFIX_LEN = 4, 256


def _shared_prefix_workload(n: int, vocab_size: int,
                            rng: np.random.Generator) -> list[BenchRequest]:
    """Requests that each start with one of a few long system prompts (see the docstring)."""
    systems = [rng.integers(0, vocab_size, SHARED_PREFIX_LEN).tolist()
               for _ in range(SHARED_PREFIXES)]
    choices = rng.integers(0, SHARED_PREFIXES, n)
    questions = np.clip(np.round(32 * rng.lognormal(0.0, 1.0, n)), 8, 128)
    outputs = np.clip(np.round(48 * rng.lognormal(0.0, 1.0, n)), 4, 128)
    return [BenchRequest(prompt_token_ids=systems[c] + rng.integers(0, vocab_size, int(q)).tolist(),
                         num_output_tokens=int(o)) for c, q, o in zip(choices, questions, outputs)]


JSONL_FIELDS = {"prompt", "prompt_token_ids", "max_tokens", "id"}


def load_jsonl_workload(path: str | Path, *, tokenizer=None, vocab_size: int | None = None,
                        default_max_tokens: int = 64) -> list[BenchRequest]:
    """The requests of a JSONL file: each non-blank line `{"prompt": "text"}` or
    `{"prompt_token_ids": [...]}`, with an optional `"max_tokens"` (default `default_max_tokens`)
    and `"id"`. Text is encoded with `tokenizer`. A bad line raises ValueError naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"workload file {path} does not exist")
    requests = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            requests.append(_parse_workload_line(line, f"{path}:{number}", tokenizer=tokenizer,
                                                 vocab_size=vocab_size,
                                                 default_max_tokens=default_max_tokens))
    if not requests:
        raise ValueError(f"workload file {path} holds no requests")
    return requests


def _parse_workload_line(line: str, where: str, *, tokenizer, vocab_size: int | None,
                         default_max_tokens: int) -> BenchRequest:
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err.msg})") from None
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: each line must be a JSON object")
    if unknown := set(entry) - JSONL_FIELDS:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)}")
    if ("prompt" in entry) == ("prompt_token_ids" in entry):
        raise ValueError(f"{where}: give exactly one of prompt, prompt_token_ids")
    max_tokens = entry.get("max_tokens", default_max_tokens)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"{where}: max_tokens must be an integer >= 1, got {max_tokens!r}")
    if "prompt" in entry:
        text = entry["prompt"]
        if not isinstance(text, str) or not text:
            raise ValueError(f"{where}: prompt must be a non-empty string")
        if tokenizer is None:
            raise ValueError(f"{where}: a text prompt needs the model's tokenizer and this model "
                             "has none; give prompt_token_ids instead")
        ids = tokenizer.encode(text)
    else:
        ids = entry["prompt_token_ids"]
        if (not isinstance(ids, list) or not ids
                or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids)):
            raise ValueError(f"{where}: prompt_token_ids must be a non-empty list of "
                             "integers >= 0")
        if vocab_size is not None and max(ids) >= vocab_size:
            raise ValueError(f"{where}: token id {max(ids)} is outside the vocabulary of "
                             f"{vocab_size}")
    return BenchRequest(prompt_token_ids=list(ids), num_output_tokens=max_tokens)


# -- grounded: answers that copy, quote or edit their input (where speculation pays) -------------

GROUNDED_MAX_TOKENS = 256  # the longest answer; the model's EOS usually ends it first


def grounded_workload(tokenizer, *, num_requests: int, seed: int = 0,
                      max_tokens: int = GROUNDED_MAX_TOKENS) -> list[BenchRequest]:
    """Chat prompts whose answers copy their input (`data/grounded.json`): repeat a passage
    exactly, rewrite it with one word changed, quote its first sentence and summarise it, or
    rename a function in a piece of code and return the whole code. Outputs end at the model's
    EOS (at most `max_tokens`). Needs the model's tokenizer and chat template."""
    if tokenizer is None:
        raise ValueError("the grounded workload is text: it needs a model with a tokenizer")
    data = json.loads(resources.files("meshserve.serving.bench").joinpath(
        "data/grounded.json").read_text(encoding="utf-8"))
    tasks = _grounded_tasks(data)
    order = np.random.default_rng(seed).permutation(num_requests) % len(tasks)
    requests = []
    for index in order:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": tasks[index]}])
        requests.append(BenchRequest(prompt_token_ids=tokenizer.encode(prompt),
                                     num_output_tokens=max_tokens, stop_at_eos=True))
    return requests


def _grounded_tasks(data: dict) -> list[str]:
    """Every task the data gives, in a fixed order: four per passage, one per piece of code."""
    tasks = []
    for passage, (old, new) in zip(data["passages"], data["passage_swaps"]):
        first = passage.split(". ")[0].rstrip(".") + "."
        tasks += [f"Repeat the following text exactly, word for word:\n\n{passage}",
                  f"Rewrite the following text, changing only \"{old}\" to \"{new}\" and keeping "
                  f"everything else the same:\n\n{passage}",
                  f"Quote the first sentence of the following text, then summarise the rest in "
                  f"one sentence:\n\n{passage}",
                  f"Correct any mistakes in the following text and return it in full:\n\n"
                  f"{passage.replace(first, first.lower(), 1)}"]
    for code, (old, new) in zip(data["code"], data["code_renames"]):
        tasks.append(f"Rename `{old}` to `{new}` in the following code and return the whole "
                     f"code:\n\n```\n{code}```")
    return tasks
