"""What the gRPC tests share: the tiny engine's settings, token-id prompts, and waiting on a
served engine."""

import time

import numpy as np

from meshserve.serving.server import GenerationServer

ENGINE = dict(num_pages=64, page_size=16, max_num_seqs=8, max_num_batched_tokens=64,
              prefill_chunk=32, max_model_len=256, max_logprobs=5, compilation_cache=False,
              warmup=False)


def prompt_ids(seed: int, length: int = 12) -> list[int]:
    return np.random.default_rng(seed).integers(2, 512, size=length).tolist()


def wait_for(condition, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def pages_free(server: GenerationServer) -> bool:
    scheduler = server.engine.scheduler
    return not scheduler.has_unfinished() and scheduler.kv_usage().num_used_pages == 0
