"""`meshserve bench --repeats N`: every system runs N times, interleaved, and the claim is the
ratio of medians.

One run of a benchmark on a shared machine is a sample, not a measurement: the same engine on
the same requests has swung by 25% between runs here. So each repeat runs every system once, in
the same order (meshserve continuous, static, then each peer), and the next repeat starts again:
a slow minute of the machine then falls on every system alike, not on one. For each system the
result holds every run and its median, min and max of output tokens/s; for continuous against
each other system, the ratio of the medians, and its range over the repeats (the smallest and
the largest ratio of one repeat's pair).

Each run records the machine's 1-minute load average before and after it
(`os.getloadavg`). The benchmark itself keeps at most one runnable thread per core and the
host thread busy, so a load above `cores + 1` means another process shared the cores: such a run
is marked `shared`, and the summary counts them (a reader should distrust a summary with any).
"""

from __future__ import annotations

import os
import statistics
from typing import Any, Callable

# Output tokens/s is the measure every system reports (meshserve's policies and every peer).
MEASURE = "output_tokens_per_s"
# Time to first token, where every run of a system reports it (its p50 and p99 over requests):
# summarized like the measure, each repeat's quantile one sample. Lower is better, so a ratio
# below 1 favours meshserve.
LATENCIES = {"ttft_p50_s": "median", "ttft_p99_s": "p99"}


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def load_average() -> float:
    """The machine's 1-minute load average."""
    return os.getloadavg()[0]


def measured(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`run()`'s result with the load average before and after it, and whether that load says
    another process shared the cores."""
    before = load_average()
    result = run()
    after = load_average()
    return result | {"load_average": {"before": before, "after": after,
                                      "shared": max(before, after) > cores() + 1}}


def summarize(runs: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per system (a key of every run: "continuous", "static", or a peer's name), its runs'
    output tokens/s with median, min and max; for continuous against each other system, the
    ratio of medians and its range over the repeats' pairs. A peer skipped in any repeat is left
    out, with the reason; `runs` is a list of repeats, each {system: its result}."""
    systems = list(dict.fromkeys(name for run in runs for name in run))
    summary: dict[str, Any] = {"repeats": len(runs), "systems": {}, "ratios": {}, "skipped": {}}
    for name in systems:
        results = [run.get(name) for run in runs]
        missing = next((r for r in results if r is None or MEASURE not in r), False)
        if missing is not False:
            summary["skipped"][name] = (missing or {}).get("skipped", "not run in every repeat")
            continue
        summary["systems"][name] = {
            MEASURE: _spread([r[MEASURE] for r in results]),
            "shared_runs": sum(bool(r.get("load_average", {}).get("shared")) for r in results)}
        for measure, quantile in LATENCIES.items():
            if all(isinstance(r.get("ttft_s"), dict) for r in results):
                summary["systems"][name][measure] = _spread(
                    [r["ttft_s"][quantile] for r in results])
    measured_systems = summary["systems"]
    if "continuous" in measured_systems:
        ours = measured_systems["continuous"]
        for name, system in measured_systems.items():
            if name == "continuous":
                continue
            summary["ratios"][f"continuous/{name}"] = _ratio(ours[MEASURE], system[MEASURE])
            for measure in LATENCIES:
                if measure in ours and measure in system:
                    summary["ratios"][f"continuous/{name}"][measure] = _ratio(
                        ours[measure], system[measure])
    summary["shared_runs"] = sum(s["shared_runs"] for s in measured_systems.values())
    return summary


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": values}


def _ratio(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """The ratio of two systems' medians, and its range over the repeats' pairs."""
    pairs = [a / b for a, b in zip(ours["runs"], theirs["runs"])]
    return {"ratio_of_medians": ours["median"] / theirs["median"], "min": min(pairs),
            "max": max(pairs), "pairs": pairs}


def median_run(runs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The run of system `name` whose output tokens/s is the median (the lower middle one of an
    even count): a whole run to show where one run is shown (tables, plots)."""
    ordered = sorted((run[name] for run in runs), key=lambda r: r[MEASURE])
    return ordered[(len(ordered) - 1) // 2]


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The summary as the table `meshserve bench` prints."""
    lines = [f"{summary['repeats']} interleaved repeats; output tokens/s:",
             f"{'system':<14} {'median':>8} {'min':>8} {'max':>8} {'shared':>6}  "
             f"continuous / it (range)"]
    for name, system in summary["systems"].items():
        m = system[MEASURE]
        ratio = summary["ratios"].get(f"continuous/{name}")
        cell = "" if ratio is None else (f"{ratio['ratio_of_medians']:.2f}x "
                                         f"({ratio['min']:.2f}-{ratio['max']:.2f})")
        lines.append(f"{name:<14} {m['median']:>8.1f} {m['min']:>8.1f} {m['max']:>8.1f} "
                     f"{system['shared_runs']:>6}  {cell}")
    for measure, label in (("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99")):
        timed = {name: s[measure] for name, s in summary["systems"].items() if measure in s}
        if not timed:
            continue
        lines.append(f"{label}, ms:")
        for name, m in timed.items():
            ratio = summary["ratios"].get(f"continuous/{name}", {}).get(measure)
            cell = "" if ratio is None else (f"{ratio['ratio_of_medians']:.2f}x "
                                             f"({ratio['min']:.2f}-{ratio['max']:.2f})")
            lines.append(f"{name:<14} {m['median'] * 1e3:>8.1f} {m['min'] * 1e3:>8.1f} "
                         f"{m['max'] * 1e3:>8.1f} {'':>6}  {cell}")
    for name, reason in summary["skipped"].items():
        lines.append(f"{name:<14} skipped: {reason}")
    if summary["shared_runs"]:
        lines.append(f"{summary['shared_runs']} runs shared the cores with another process "
                     "(load average above cores + 1): distrust this summary")
    return lines
