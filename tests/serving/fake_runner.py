"""An arithmetic runner that keeps the engine's runner contract
(`meshserve.batching.runner_protocol`), so engine and server tests assert exact streams with no
model and nothing to compile.

It runs plans on the scheduler tests' fake paged cache (`tests/batching/fake.py`): each real row
writes its new tokens through its page table, reads its whole context back through it, and its
next token is an arithmetic function of that context (`reference_outputs` gives a request's
tokens alone). Before each step it poisons the pages the engine's scheduler holds free, so a page
the engine freed too early, or read after freeing, changes the output.

Logprobs are arithmetic too (`token_logprob`, `top_logprobs`): the sampled token is always rank 1,
followed by the next ids in order. Sampling parameters other than the stops are ignored: every
row is greedy under the rule. Prompt logprobs are not computed.
"""

from __future__ import annotations

import numpy as np

from meshserve.batching.plan import StepPlan, SubBatchPlan
from meshserve.batching.runner_protocol import SampledRows
from meshserve.model.config import ModelConfig
from meshserve.serving.engine.engine_config import EngineConfig
from tests.batching.fake import VOCAB, FakeRunner, reference_outputs  # noqa: F401

MODEL = ModelConfig(name="fake-arithmetic", vocab_size=VOCAB, hidden_size=8, intermediate_size=8,
                    num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
                    max_position_embeddings=1024)


def token_logprob(token: int) -> float:
    return -0.25 * (token % 5) - 0.125


def top_ids(token: int, count: int) -> list[int]:
    return [(token + k) % VOCAB for k in range(count)]


def top_logprobs(token: int, count: int) -> list[float]:
    return [token_logprob(token) - 0.5 * k for k in range(count)]


class FakeModelRunner:
    """`window`: the model's every layer slides over that many keys; rows read only those
    (`FakeRunner`), and the engine frees the pages behind them."""

    splits_sampling = False  # every step is one `execute`

    def __init__(self, config: EngineConfig, *, window: int = 0):
        settled = config.for_model(MODEL)
        self.model_config = MODEL.replace(sliding_window=window)
        self.config = settled.runner_config()
        self.num_replicas = settled.mesh_config.data
        self.attention = "arithmetic"
        self.last_wait_seconds = 0.0
        self.last_user: object | None = None
        self.channel = None
        self.num_executed = 0
        self._cache = FakeRunner(num_pages=self.config.num_pages, page_size=self.config.page_size,
                                 num_replicas=self.num_replicas, window=window)

    def warmup(self, *, progress: bool = True, prompt_logprobs: bool = True
               ) -> list[tuple[int, ...]]:
        return []  # nothing to compile

    def execute(self, plan: StepPlan) -> list[SampledRows]:
        engine = self.last_user  # set by the engine before each step
        if engine is not None:
            self._cache.poison_free_pages(engine.scheduler)
        self.num_executed += 1
        return [self._rows(tokens) for tokens in self._cache.run(plan)]

    def padded_tokens(self, sub_batches: list[SubBatchPlan]) -> int:
        return sum(batch.num_tokens for batch in sub_batches)

    def _rows(self, tokens: np.ndarray) -> SampledRows:
        k = self.config.max_logprobs
        return SampledRows(
            tokens=tokens.astype(np.int32),
            logprobs=np.array([token_logprob(int(t)) for t in tokens], np.float32),
            top_ids=np.array([top_ids(int(t), k) for t in tokens], np.int32).reshape(-1, k),
            top_logprobs=np.array([top_logprobs(int(t), k) for t in tokens],
                                  np.float32).reshape(-1, k))
