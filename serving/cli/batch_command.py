"""`meshserve batch`: run a JSONL file of requests; results are appended as each finishes, and a
rerun skips the ids already in the output.

Input lines are JSON objects with one of `prompt` (text), `prompt_token_ids` or `messages`
(chat), an optional `id` (default: the line number), and any `SamplingParams` field. Every line
is parsed and checked before any work is done. On many processes (`--coordinator`, ... or
`--distributed`) process 0 reads, schedules and writes; the others follow its plan stream.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Iterator

from tqdm.auto import tqdm

from meshserve.batching.sampling import SamplingParams
from meshserve.serving.engine import multihost
from meshserve.serving import options
from meshserve.serving.cli.serve_command import follow, print_plan_stream
from meshserve.serving.python_api.llm import LLM

HELP = "run a JSONL file of requests"
SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, type=Path, help="the JSONL requests")
    parser.add_argument("--output", required=True, type=Path,
                        help="the JSONL results, appended to; ids already there are skipped")
    parser.add_argument("--show", action="store_true", help="print each answer as it finishes")
    options.add_cluster_args(parser)
    options.add_model_args(parser)


def run(args: argparse.Namespace) -> None:
    run_batch(args, args.input, args.output, show=args.show)


def read_requests(path: Path) -> Iterator[dict[str, Any]]:
    """Parses and validates every line first, so a bad line fails before any work is done."""
    if not path.is_file():
        raise FileNotFoundError(f"batch input {path} does not exist")
    lines = path.read_text(encoding="utf-8").splitlines()
    entries, first_line = [], {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        entry = _parse_line(line, number, path)
        if entry["id"] in first_line:
            raise ValueError(f"{path}:{number}: id {entry['id']!r} is already used on line "
                             f"{first_line[entry['id']]}")
        first_line[entry["id"]] = number
        entries.append(entry)
    return iter(entries)


def _parse_line(line: str, number: int, path: Path) -> dict[str, Any]:
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from None
    if not isinstance(entry, dict):
        raise ValueError(f"{path}:{number}: each line must be a JSON object")
    prompts = [k for k in ("prompt", "prompt_token_ids", "messages") if k in entry]
    if len(prompts) != 1:
        raise ValueError(f"{path}:{number}: give exactly one of prompt, prompt_token_ids, messages")
    unknown = set(entry) - SAMPLING_FIELDS - {"id", "prompt", "prompt_token_ids", "messages"}
    if unknown:
        raise ValueError(f"{path}:{number}: unknown fields {sorted(unknown)}")
    sampling = {k: v for k, v in entry.items() if k in SAMPLING_FIELDS}
    try:
        params = SamplingParams(**sampling)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}:{number}: {err}") from None
    return {"id": str(entry.get("id", number)), "kind": prompts[0], "value": entry[prompts[0]],
            "params": params}


def finished_ids(path: Path) -> set[str]:
    """Ids already in the output. A torn last line (an interrupted write) is cut off."""
    if not path.exists():
        return set()
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
        path.write_text(text, encoding="utf-8")
    return {json.loads(line)["id"] for line in text.splitlines() if line.strip()}


def run_batch(args: argparse.Namespace, input_path: Path, output_path: Path, *,
              show: bool) -> None:
    cluster_config = (options.cluster_config_from_args(args) if hasattr(args, "coordinator")
                      else None)
    if cluster_config is not None:
        return _run_on_cluster(args, cluster_config, input_path, output_path, show=show)
    todo = _pending(input_path, output_path)
    if not todo:
        return
    llm = options.load_llm(args, needs_tokenizer=any(e["kind"] != "prompt_token_ids"
                                                     for e in todo))
    _run_entries(llm, todo, output_path, show=show)


def _pending(input_path: Path, output_path: Path, where: str = "") -> list[dict]:
    """The input's requests whose ids are not in the output yet; prints the counts."""
    entries = list(read_requests(input_path))
    done = finished_ids(output_path)
    todo = [e for e in entries if e["id"] not in done]
    print(f"{len(entries)} requests, {len(done & {e['id'] for e in entries})} already done, "
          f"{len(todo)} to run{where}")
    return todo


def _run_entries(llm: LLM, todo: list[dict], output_path: Path, *, show: bool) -> None:
    for entry in todo:
        prompt = (options.chat(llm, entry["value"]) if entry["kind"] == "messages"
                  else entry["value"])
        llm.engine.add_request(prompt, entry["params"], request_id=entry["id"])
    _drain_to_file(llm, output_path, len(todo), show=show)


def _run_on_cluster(args: argparse.Namespace, cluster_config: multihost.ClusterConfig,
                    input_path: Path, output_path: Path, *, show: bool) -> None:
    """`batch` on many processes: process 0 reads the input, schedules and writes the output;
    the others follow its plan stream until it stops them. Every process joins before anything
    is read, so an input with nothing left to run still ends the job cleanly."""
    llm = options.load_llm(args, needs_tokenizer=False, cluster=cluster_config)
    cluster = llm.cluster
    if not cluster.is_leader:
        follow(llm, cluster)  # returns once process 0 stops the job, else exits non-zero
        return
    try:
        todo = _pending(input_path, output_path, f" on {cluster.num_processes} processes")
        if todo and llm.tokenizer is None and any(e["kind"] != "prompt_token_ids" for e in todo):
            raise ValueError(f"model {args.model!r} has no tokenizer; give prompt_token_ids")
        if todo:
            _run_entries(llm, todo, output_path, show=show)
            print_plan_stream(llm, cluster)
    finally:
        if cluster.failed is None:
            cluster.shutdown()  # STOP: the followers leave with us, also after bad input


def _drain_to_file(llm: LLM, output_path: Path, total: int, *, show: bool) -> None:
    started, num_tokens = time.perf_counter(), 0
    output_path.parent.mkdir(parents=True, exist_ok=True)
    with output_path.open("a", encoding="utf-8") as out_file, \
            tqdm(total=total, desc="batch", unit="req") as bar:
        while llm.engine.has_unfinished():
            for out in llm.engine.step():
                if not out.finished:
                    continue
                out_file.write(json.dumps(_result_record(out), ensure_ascii=False) + "\n")
                out_file.flush()
                num_tokens += len(out.outputs[0].token_ids)
                bar.update(1)
                if show:
                    tqdm.write(f"\n>>> {out.request_id}\n{out.outputs[0].text.strip()}")
    elapsed = time.perf_counter() - started
    stats = llm.engine.stats
    print(f"{num_tokens} output tokens in {elapsed:.2f}s: {num_tokens / elapsed:.1f} tokens/s; "
          f"padding {stats.prefill_padding:.0%} prefill, {stats.decode_padding:.0%} decode; "
          f"{llm.engine.scheduler.num_preemptions} preemptions; "
          f"{stats.compiles_after_warmup} compiles after warm-up")


def _result_record(out) -> dict[str, Any]:
    completion = out.outputs[0]
    return {"id": out.request_id, "text": completion.text, "token_ids": completion.token_ids,
            "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
            "num_prompt_tokens": len(out.prompt_token_ids),
            "num_output_tokens": len(completion.token_ids)}
