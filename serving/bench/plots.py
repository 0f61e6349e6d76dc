"""PNG plots of a `meshserve bench` result (matplotlib, Agg backend, no display needed).

`write_plots(results, directory, stem)` writes what the results hold and returns the file names
written and, for each plot it could not draw, the reason:

  throughput   output tokens/s against the swept rate or concurrency, per policy; without a
               sweep, one bar per policy (and per peer that ran)
  latency_cdf  CDFs of TTFT, TPOT and E2EL per policy (online: client-side; offline: the
               engine's per-request TTFT and E2EL, all sent at t=0)
  step_time    device step seconds against host seconds, stacked, per policy
  padding      padding waste of prefill and decode, static against continuous
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from meshserve.batching.knobs import POLICY_NAMES  # noqa: E402


def write_plots(results: dict[str, Any], directory: Path, stem: str) -> dict[str, Any]:
    """Writes `<stem>-<plot>.png` files into `directory`, one per name of `NAMES` it can draw;
    returns {"files": [...], "skipped": {plot: reason}}."""
    return save_figures(PLOTS, results, directory, stem)


def save_figures(draws: Sequence[tuple[str, Callable[[Any, Any], str | None]]], data: Any,
                 directory: Path, stem: str, *,
                 size: tuple[float, float] = (7, 4.5)) -> dict[str, Any]:
    """Each `draw(fig, data)` fills a figure and returns None, or the reason it could not;
    drawn figures go to new files `<directory>/<stem>-<name>.png` (a file already there raises
    FileExistsError: a result's plot is never overwritten). Returns {"files", "skipped"}."""
    directory.mkdir(parents=True, exist_ok=True)
    files, skipped = [], {}
    for name, draw in draws:
        fig = plt.figure(figsize=size)
        try:
            reason = draw(fig, data)
            if reason is None:
                path = directory / f"{stem}-{name}.png"
                fig.tight_layout()
                with open(path, "xb") as file:
                    fig.savefig(file, format="png", dpi=100)
                files.append(path.name)
            else:
                skipped[name] = reason
        finally:
            plt.close(fig)
    return {"files": files, "skipped": skipped}


def _throughput(fig, results: dict[str, Any]) -> str | None:
    ax = fig.add_subplot()
    sweep = results.get("sweep")
    if sweep:
        for policy in POLICY_NAMES:
            ax.plot(sweep["values"], [r["output_tokens_per_s"] for r in sweep[policy]],
                    marker="o", label=policy)
        ax.set_xlabel("request rate (req/s)" if sweep["axis"] == "rate" else "concurrency")
        ax.legend()
    else:
        labels = list(POLICY_NAMES)
        values = [results[p]["output_tokens_per_s"] for p in POLICY_NAMES]
        for name, peer in (results.get("peers") or {}).items():
            if "output_tokens_per_s" in peer:
                labels.append(name)
                values.append(peer["output_tokens_per_s"])
        ax.bar(labels, values, color=[f"C{i}" for i in range(len(labels))])
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput")
    return None


def _latency_cdf(fig, results: dict[str, Any]) -> str | None:
    metrics = [m for m in ("ttft_s", "tpot_s", "e2el_s")
               if any(results[p].get("samples", {}).get(m) for p in POLICY_NAMES)]
    if not metrics:
        return "no per-request latencies in this run"
    for i, metric in enumerate(metrics, start=1):
        ax = fig.add_subplot(1, len(metrics), i)
        for policy in POLICY_NAMES:
            values = np.sort(np.asarray(results[policy].get("samples", {}).get(metric) or []))
            if values.size:
                ax.step(values * 1e3, np.arange(1, values.size + 1) / values.size,
                        where="post", label=policy)
        ax.set_xlabel(f"{metric.removesuffix('_s').upper()} (ms)")
        ax.set_ylim(0, 1.02)
        if i == 1:
            ax.set_ylabel("fraction of requests")
            ax.legend()
    return None


def _step_time(fig, results: dict[str, Any]) -> str | None:
    ax = fig.add_subplot()
    device = [results[p]["step_seconds"] for p in POLICY_NAMES]
    host = [max(results[p]["wall_s"] - results[p]["step_seconds"], 0.0) for p in POLICY_NAMES]
    ax.bar(POLICY_NAMES, device, label="device step")
    ax.bar(POLICY_NAMES, host, bottom=device, label="host")
    ax.set_ylabel("seconds")
    ax.set_title("Wall time: device step vs host")
    ax.legend()
    return None


def _padding(fig, results: dict[str, Any]) -> str | None:
    ax = fig.add_subplot()
    x = np.arange(2)
    for i, policy in enumerate(("static", "continuous")):
        r = results[policy]
        ax.bar(x + (i - 0.5) * 0.38, [r["prefill_padding"] * 100, r["decode_padding"] * 100],
               width=0.38, label=policy)
    ax.set_xticks(x, ["prefill", "decode"])
    ax.set_ylabel("padded slots (%)")
    ax.set_title("Padding waste")
    ax.legend()
    return None


# The plots `write_plots` draws, each to `<stem>-<name>.png`.
PLOTS = (("throughput", _throughput), ("latency_cdf", _latency_cdf), ("step_time", _step_time),
         ("padding", _padding))
NAMES = tuple(name for name, _ in PLOTS)
