"""`meshserve bench --lora-adapters N`: what serving many LoRA adapters in one batch costs.

`random_adapters` writes N adapters of the served model in PEFT's format (`write_lora`): every
projection LoRA can modify, rank `rank`, random A and B (B non-zero, so each adapter changes
the outputs). `spread` gives request i adapter i mod N. The bench then runs the continuous engine
with `enable_lora` and `max_loras` N, each request with its adapter, beside `bench.BASE_MODEL`:
the continuous engine without LoRA on the same requests (the base model alone), and the static
baseline (which serves no adapters: the base model too). `ratio_lora_output_tokens_per_s` is
what the adapters cost.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import numpy as np

from meshserve.batching.adapters import LoRARequest
from meshserve.model.config import ModelConfig
from meshserve.model.loading.lora_files import module_shapes, write_lora
from meshserve.serving.bench.workloads import BenchRequest

DEFAULT_RANK = 16
B_SCALE = 0.02  # lora_B's spread: a visible change to every projection, not a new model


def random_adapters(directory: str | Path, config: ModelConfig, count: int, *,
                    rank: int = DEFAULT_RANK, seed: int = 0,
                    b_scale: float = B_SCALE) -> list[LoRARequest]:
    """`count` adapters of a model of `config` under `directory` (one folder each), as
    `LoRARequest`s named lora-1 ... lora-N with ids 1 ... N; lora_B's entries have spread
    `b_scale`."""
    if count < 1 or rank < 1:
        raise ValueError(f"count and rank must be >= 1, got {count} and {rank}")
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(1, count + 1):
        weights = {}
        for module, (fan_in, fan_out) in sorted(module_shapes(config).items()):
            a = rng.standard_normal((config.num_layers, rank, fan_in)) / np.sqrt(fan_in)
            b = b_scale * rng.standard_normal((config.num_layers, fan_out, rank))
            weights[module] = (a.astype(np.float32), b.astype(np.float32))
        path = write_lora(Path(directory) / f"lora-{i}", config, weights, lora_alpha=rank)
        requests.append(LoRARequest(f"lora-{i}", i, str(path)))
    return requests


def spread(requests: Sequence[BenchRequest], adapters: Sequence[LoRARequest]
           ) -> list[BenchRequest]:
    """Request i with adapter i mod len(adapters)."""
    return [dataclasses.replace(r, lora_request=adapters[i % len(adapters)])
            for i, r in enumerate(requests)]
