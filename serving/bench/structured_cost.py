"""Structured output measured: its cost in throughput, and the validity of what it produces.

`compare_structured`: the same seeded requests through one continuous engine, unconstrained and
then every request constrained, in one process; output tokens/s of both and their ratio, the
median time to first token of both and its ratio, and the host time the matchers add (advancing
each by its sampled token and computing the next masks, every constrained row's in one parallel
fill) per step, per step with constrained rows and per constrained token, and how much of it the
device hid (`overlap`: the steps whose masks were computed while their forward pass ran, the
share of that mask time during which the device was still busy, and the forward pass's time left
once the masks were ready; `Engine._run_overlapped`). Every constraint is
JSON lines (`json_lines`: one JSON object per line, each valid against a schema, without end):
with `ignore_eos` the output goes on to its target length, as unconstrained output does, so both
runs compute the same tokens. `CONSTRAINTS` names the two sets: "json-lines", one small schema
for every request (`JSON_LINES`), and "json-schemas", request i held to the shipped schema
i mod 54 (`data/json_schemas.json`), so the engine serves many distinct grammars at once.

`schema_validity`: each schema of a set (`data/json_schemas.json`, 54 schemas: nested objects,
arrays, enums, bounded numbers, required and optional fields, `$ref`, `anyOf`/`oneOf`, patterns)
asked for through the chat template, at each temperature, all in one engine; every output is
parsed and validated with `jsonschema`.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from typing import Any, Sequence

from meshserve.batching.sampling import SamplingParams
from meshserve.batching.structured import StructuredOutput
from meshserve.serving.bench.bench import run_offline
from meshserve.serving.bench.workloads import BenchRequest
from meshserve.serving.engine.core import Engine
from meshserve.serving.engine.grammar import JSON_OPTIONS
from meshserve.serving.engine.json_schemas import bounded_numbers

LINE_SCHEMA = {"type": "object",
               "properties": {"name": {"type": "string", "maxLength": 16},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120},
                              "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                       "maxItems": 3}},
               "required": ["name", "age", "tags"], "additionalProperties": False,
               "x-guidance": JSON_OPTIONS}  # compact, as every JSON constraint


def json_lines(schema: dict) -> StructuredOutput:
    """One JSON object a line, each valid against `schema` (compact, its numbers bounded as a
    JSON schema constraint's are), lines without end."""
    line = bounded_numbers(schema) | {"x-guidance": JSON_OPTIONS}
    return StructuredOutput(grammar="start: (line \"\\n\")+\nline: %json " + json.dumps(line))


JSON_LINES = json_lines(LINE_SCHEMA)
CONSTRAINTS = ("json-lines", "json-schemas")


def constraints(name: str) -> list[StructuredOutput]:
    """The constraints of set `name` (`CONSTRAINTS`), request i taking entry i mod their
    number."""
    if name == "json-lines":
        return [JSON_LINES]
    if name == "json-schemas":
        return [json_lines(entry["schema"]) for entry in load_schemas()]
    raise ValueError(f"unknown constraint set {name!r}; one of {', '.join(CONSTRAINTS)}")


def compare_structured(engine: Engine, requests: Sequence[BenchRequest], *,
                       structured: StructuredOutput | Sequence[StructuredOutput] = JSON_LINES,
                       progress: bool = False) -> dict[str, Any]:
    """`requests` unconstrained, then each constrained by `structured` (request i by entry
    i mod their number, when several), on `engine`. Each run starts with an empty prefix cache,
    so the second does not find the first's prompts."""
    given = [structured] if isinstance(structured, StructuredOutput) else list(structured)
    scheduler = engine.scheduler
    scheduler.forget_prefixes()
    plain = run_offline(engine, list(requests), progress=progress)
    scheduler.forget_prefixes()
    seconds, advances = scheduler.constraint_seconds, scheduler.num_constraint_advances
    batches = scheduler.num_constraint_batches
    overlap = _overlap_counters(engine)
    constrained = run_offline(engine, [dataclasses.replace(r, structured=given[i % len(given)])
                                       for i, r in enumerate(requests)], progress=progress)
    seconds = scheduler.constraint_seconds - seconds
    advances = scheduler.num_constraint_advances - advances
    batches = scheduler.num_constraint_batches - batches
    overlap = {name: now - before for (name, now), before
               in zip(_overlap_counters(engine).items(), overlap.values())}
    ttfts = [run["ttft_s"]["median"] for run in (plain, constrained)]
    return {
        "constraint": given[0].key[1] if len(given) == 1 else
        f"{len(given)} distinct constraints, request i taking the (i mod {len(given)})-th",
        "order": ["unconstrained", "constrained"],
        "unconstrained": plain, "constrained": constrained,
        "ratio_output_tokens_per_s": (constrained["output_tokens_per_s"]
                                      / plain["output_tokens_per_s"]),
        "ttft_p50_s": {"unconstrained": ttfts[0], "constrained": ttfts[1]},
        "ratio_ttft_p50": ttfts[1] / ttfts[0] if ttfts[0] else None,
        "matcher_seconds": seconds, "matcher_advances": advances,
        "matcher_ms_per_step": 1e3 * seconds / max(constrained["num_steps"], 1),
        "mask_steps": batches,  # steps in which constrained rows took tokens
        "mask_ms_per_constrained_step": 1e3 * seconds / max(batches, 1),
        "matcher_us_per_token": 1e6 * seconds / max(advances, 1),
        "matcher_share_of_wall": seconds / constrained["wall_s"],
        "overlap": _overlap_report(overlap),
    }


def _overlap_counters(engine: Engine) -> dict[str, float]:
    stats = engine.stats
    return {"steps": stats.overlap_steps, "mask_seconds": stats.overlap_mask_seconds,
            "hidden_seconds": stats.overlap_hidden_seconds,
            "forward_left_seconds": stats.overlap_forward_left_seconds}


def _overlap_report(counts: dict[str, float]) -> dict[str, Any]:
    """The overlapped steps of a run (see the module docstring): per step, the host's mask
    time, the part of it the forward pass hid and the part it did not (the device idle,
    waiting for the masks), and the forward pass's time left once the masks were ready."""
    steps = max(counts["steps"], 1)
    mask, hidden = counts["mask_seconds"], counts["hidden_seconds"]
    return {"steps": int(counts["steps"]),
            "mask_ms_per_step": 1e3 * mask / steps,
            "hidden_ms_per_step": 1e3 * hidden / steps,
            "exposed_ms_per_step": 1e3 * (mask - hidden) / steps,
            "hidden_fraction": hidden / mask if mask else None,
            "forward_left_ms_per_step": 1e3 * counts["forward_left_seconds"] / steps}


def load_schemas(path: str | None = None) -> list[dict[str, Any]]:
    """`[{"name": ..., "schema": {...}}, ...]`: the committed set, or the file at `path`."""
    if path is None:
        text = resources.files("meshserve.serving.bench").joinpath(
            "data/json_schemas.json").read_text(encoding="utf-8")
    else:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    return json.loads(text)


def schema_validity(engine: Engine, schemas: Sequence[dict[str, Any]], *,
                    temperatures: Sequence[float] = (0.0, 0.8), max_tokens: int = 160,
                    seed: int = 0) -> dict[str, Any]:
    """Every schema at every temperature, as one batch: how many outputs parse and validate."""
    import jsonschema  # a test and bench dependency, not a serving one

    tokenizer = engine.tokenizer
    jobs = []
    for temperature in temperatures:
        for i, entry in enumerate(schemas):
            ask = f"Give {entry['name']} as JSON."
            prompt = (tokenizer.apply_chat_template([{"role": "user", "content": ask}])
                      if tokenizer.chat_template else ask)
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i,
                                    structured=StructuredOutput(json_schema=entry["schema"]))
            jobs.append((temperature, entry, engine.add_request(prompt, params)))
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0]
    by_temperature: dict[str, Any] = {}
    for temperature, entry, request_id in jobs:
        completion = outputs[request_id]
        error = _validation_error(jsonschema, completion.text, entry["schema"])
        row = by_temperature.setdefault(str(temperature), {"requests": 0, "valid": 0,
                                                           "failures": [], "output_tokens": 0})
        row["requests"] += 1
        row["output_tokens"] += len(completion.token_ids)
        if error is None:
            row["valid"] += 1
        else:
            row["failures"].append({"name": entry["name"], "text": completion.text,
                                    "finish_reason": completion.finish_reason, "error": error})
    for row in by_temperature.values():
        row["valid_fraction"] = row["valid"] / row["requests"]
    return {"num_schemas": len(schemas), "max_tokens": max_tokens,
            "temperatures": by_temperature}


def _validation_error(jsonschema, text: str, schema: dict) -> str | None:
    try:
        jsonschema.validate(json.loads(text), schema)
    except json.JSONDecodeError as err:
        return f"does not parse: {err.msg}"
    except jsonschema.ValidationError as err:
        return f"does not validate: {err.message}"
    return None
