"""PNG charts of a `meshserve mesh-sweep` result, one bar group per mesh that ran:

  serving        output tokens/s; TTFT and TPOT (mean bars, p99 marks); decode and prefill
                 step time
  memory         weight and KV bytes per device, stacked
  communication  collective result bytes per decode step, stacked by kind

Meshes that could not run are left out of every chart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from meshserve.serving.bench.plots import save_figures
from meshserve.sharding.hlo import COLLECTIVES


def write_plots(records: list[dict[str, Any]], directory: Path, stem: str) -> dict[str, Any]:
    """Writes `<stem>-serving.png`, `-memory.png` and `-communication.png` (`NAMES`); returns
    {"files": [...], "skipped": {chart: reason}}."""
    ran = [r for r in records if "error" not in r]
    if not ran:
        return {"files": [], "skipped": {name: "no mesh ran" for name in NAMES}}
    return save_figures(CHARTS, ran, directory, stem, size=(11, 4.5))


def _serving(fig, ran: list[dict[str, Any]]) -> str | None:
    labels = [r["mesh"] for r in ran]
    x = np.arange(len(ran))
    ax = fig.add_subplot(1, 3, 1)
    ax.bar(labels, [r["serving"]["output_tokens_per_s"] for r in ran], color="C0")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput")
    ax = fig.add_subplot(1, 3, 2)
    for i, metric in enumerate(("ttft_s", "tpot_s")):
        offset = (i - 0.5) * 0.38
        ax.bar(x + offset, [r["serving"][metric]["mean"] * 1e3 for r in ran], width=0.38,
               color=f"C{i}", label=f"{metric.removesuffix('_s').upper()} mean")
        ax.scatter(x + offset, [r["serving"][metric]["p99"] * 1e3 for r in ran], marker="_",
                   s=200, color="black", zorder=3, label="p99" if i else None)
    ax.set_xticks(x, labels)
    ax.set_ylabel("ms")
    ax.set_title("Latency")
    ax.legend(fontsize=8)
    ax = fig.add_subplot(1, 3, 3)
    for i, step in enumerate(("decode_step_s", "prefill_step_s")):
        ax.bar(x + (i - 0.5) * 0.38, [r["steps"][step] * 1e3 for r in ran], width=0.38,
               color=f"C{i + 2}", label=step.removesuffix("_step_s"))
    ax.set_xticks(x, labels)
    ax.set_ylabel("ms per step")
    ax.set_title("Step time")
    ax.legend(fontsize=8)
    return None


def _memory(fig, ran: list[dict[str, Any]]) -> str | None:
    ax = fig.add_subplot()
    labels = [r["mesh"] for r in ran]
    weights = [r["memory"]["weight_bytes"] / 1e6 for r in ran]
    ax.bar(labels, weights, label="weights")
    ax.bar(labels, [r["memory"]["kv_bytes"] / 1e6 for r in ran], bottom=weights,
           label="KV cache")
    ax.set_ylabel("MB per device (the fullest)")
    ax.set_title("Memory per device")
    ax.legend()
    return None


def _communication(fig, ran: list[dict[str, Any]]) -> str | None:
    ax = fig.add_subplot()
    labels = [r["mesh"] for r in ran]
    bottom = np.zeros(len(ran))
    for i, kind in enumerate(COLLECTIVES):
        values = np.array([r["collectives"][kind]["bytes_per_step"] / 1e3 for r in ran])
        if values.any():
            ax.bar(labels, values, bottom=bottom, color=f"C{i}", label=kind)
            bottom += values
    ax.set_ylabel("KB per decode step, per device")
    ax.set_title("Collectives in the decode program")
    if bottom.any():
        ax.legend()
    return None


# The charts `write_plots` draws, each to `<stem>-<name>.png`.
CHARTS = (("serving", _serving), ("memory", _memory), ("communication", _communication))
NAMES = tuple(name for name, _ in CHARTS)
