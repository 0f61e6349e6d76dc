"""A draft model as a proposer: a second, smaller model that guesses the target's next tokens.

The draft model has a runner of its own (`ModelRunner`: its weights, its own KV cache, its
compiled steps) with the target's cache geometry, and it keeps each request's draft KV at the
request's own page ids: the target's scheduler owns the pages, and the draft cache is simply a
second array behind the same ids. So the draft needs no allocator, and the pages the
`Speculator` reserves for a request's drafts hold both models' KV for them.

Per step, for the requests that draft (`propose`):

    catch-up  the request's tokens the draft cache does not hold yet, up to and including its
              last token (position n - 1), as prefill chunks within the draft runner's token
              budget (several calls when they do not fit one); the last row's argmax is d1
    decode    k - 1 calls of one row per request: d(j - 1) at position n - 2 + j, argmax d(j)

Drafts are the draft model's argmax (greedy): their distribution is one-hot, so the engine's
exact verification (`meshserve.batching.speculative`) applies as for prompt lookup, and outputs
stay token-identical to decoding without speculation, whatever the draft proposes.

What the draft cache holds is tracked per request (`_Fed`): the tokens fed, in order. The next
step it holds the longest common prefix of those and the request's tokens now (rejected drafts
differ from the tokens that replaced them, and everything after them is stale), and nothing for
a request object it has not seen, or one preempted since (its pages changed). A new request is
caught up from position 0, so it never reads draft KV another request left in its pages; a page
shared through the prefix cache holds the same tokens for every holder, so rewriting it rewrites
the same KV.

Compiled programs: the draft runner's own set, as many as the target's (`RunnerConfig.step_keys`
of the same config), compiled at the engine's warm-up. Limits (refused where the engine is
built): one device, no sliding window, the target's vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from meshserve.batching.plan import sub_batch_from_rows
from meshserve.batching.request import Request
from meshserve.model.executor.runner import ModelRunner


@dataclasses.dataclass
class _Fed:
    """What the draft cache holds of one request: the tokens fed to it, at positions 0 .. ."""

    request: Request
    num_preemptions: int
    tokens: list[int]


class DraftModelProposer:
    """`propose` of `meshserve.batching.speculative.Proposer`, by a draft model's argmax."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.page_size = runner.config.page_size
        self._fed: dict[str, _Fed] = {}
        self.num_calls = 0  # draft runner calls, catch-up and decode

    def warmup(self, *, progress: bool = True) -> None:
        self.runner.warmup(progress=progress, prompt_logprobs=False)  # drafts need none

    def propose(self, requests: Sequence[Request], max_drafts: Sequence[int]
                ) -> list[list[int]]:
        self._forget_finished()
        active = [(r, k) for r, k in zip(requests, max_drafts) if k > 0]
        drafts: dict[int, list[int]] = {id(r): [] for r, _ in active}
        if active:
            for request, token in self._catch_up([r for r, _ in active]):
                drafts[id(request)].append(token)
            for j in range(2, max(k for _, k in active) + 1):
                live = [r for r, k in active if k >= j]
                rows = [([drafts[id(r)][-1]], r.num_tokens - 2 + j, r.pages) for r in live]
                for request, token in zip(live, self._run(rows)):
                    drafts[id(request)].append(token)
            for request, _ in active:  # fed: its tokens, then every draft but the last
                self._fed[request.request_id] = _Fed(
                    request, request.num_preemptions,
                    request.all_token_ids + drafts[id(request)][:-1])
        return [drafts.get(id(r), []) for r in requests]

    def _catch_up(self, requests: list[Request]) -> list[tuple[Request, int]]:
        """Feeds each request's tokens from what the draft cache holds to its last one, in
        chunks within the draft runner's budget; returns each request's first draft (the
        argmax after its last token)."""
        budget = self.runner.config.max_num_batched_tokens
        pending = [(r, min(self._num_held(r), r.num_tokens - 1)) for r in requests]
        firsts = []
        while pending:
            rows, fed, left = [], [], budget
            for request, start in pending:
                count = min(request.num_tokens - start, left)
                if count == 0:
                    break
                rows.append((request.all_token_ids[start:start + count], start, request.pages))
                fed.append((request, start + count))
                left -= count
            later = pending[len(fed):]
            for (request, end), token in zip(fed, self._run(rows)):
                if end == request.num_tokens:
                    firsts.append((request, token))
                else:
                    later.append((request, end))
            pending = later
        return firsts

    def _num_held(self, request: Request) -> int:
        """Leading tokens of `request` whose KV the draft cache holds."""
        fed = self._fed.get(request.request_id)
        if fed is None or fed.request is not request or (
                fed.num_preemptions != request.num_preemptions):
            return 0
        tokens = request.all_token_ids
        count = min(len(fed.tokens), len(tokens))
        differ = np.flatnonzero(np.asarray(fed.tokens[:count]) != np.asarray(tokens[:count]))
        return int(differ[0]) if differ.size else count

    def _run(self, rows: list[tuple[list[int], int, list[int]]]) -> list[int]:
        """One draft runner call of `sub_batch_from_rows` rows; each row's argmax."""
        self.num_calls += 1
        batch = sub_batch_from_rows(rows, page_size=self.page_size)
        (sampled,) = self.runner.run_step([batch])
        return [int(token) for token in sampled.tokens]

    def _forget_finished(self) -> None:
        for request_id in [i for i, fed in self._fed.items() if fed.request.is_finished]:
            del self._fed[request_id]
