"""Verification keeps the target's distribution, checked statistically.

Every test draws N samples with fixed seeds and compares the empirical distribution with the
exact one by Pearson's chi-square: the statistic must stay below the critical value at
significance 1e-4 (cells with an expected count under 5 merged), so a correct sampler fails with
probability under 1e-4 and a biased one (say 2 points of total variation on a cell of 10%, at
N = 20000) fails with near certainty. Seeds are fixed, so the outcome is reproducible.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from meshserve.batching.sampling import greedy_sampling
from meshserve.batching.speculative import accepted_length
from meshserve.model.executor.sampler import sample
from meshserve.model.executor.verification import rejection_sample, target_probs

N = 20_000
ALPHA = 1e-4
VOCAB = 8


def _chi_square_ok(observed: np.ndarray, expected_probs: np.ndarray) -> bool:
    """Pearson's test at significance ALPHA; cells expected under 5 times merged into one."""
    expected = expected_probs.ravel() * observed.sum()
    observed = observed.ravel().astype(np.float64)
    small = expected < 5
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token of zero probability came out"
    statistic = float(np.sum((observed[keep] - expected[keep]) ** 2 / expected[keep]))
    dof = int(keep.sum()) - 1
    p_value = float(jax.scipy.special.gammaincc(dof / 2, statistic / 2))
    return p_value > ALPHA


def _distribution(rng: np.random.Generator, *, zeros: int = 0) -> np.ndarray:
    p = rng.dirichlet(np.ones(VOCAB))
    p[rng.choice(VOCAB, zeros, replace=False)] = 0
    return p / p.sum()


def test_rejection_sampling_keeps_the_target_distribution_for_any_draft_distribution():
    rng = np.random.default_rng(0)
    p, q = _distribution(rng, zeros=2), _distribution(rng, zeros=1)
    drafts = rng.choice(VOCAB, N, p=q)
    accepted, tokens = rejection_sample(jnp.broadcast_to(p, (N, VOCAB)),
                                        jnp.broadcast_to(q, (N, VOCAB)),
                                        jnp.asarray(drafts, jnp.int32), jax.random.key(1))
    counts = np.bincount(np.asarray(tokens), minlength=VOCAB)
    assert _chi_square_ok(counts, p)
    # acceptance happens with probability sum_x min(p(x), q(x))
    rate, expected = float(np.mean(accepted)), float(np.minimum(p, q).sum())
    assert abs(rate - expected) < 4 * np.sqrt(expected * (1 - expected) / N)


def test_a_one_hot_draft_is_accepted_with_p_of_it_and_corrected_from_the_rest():
    rng = np.random.default_rng(2)
    p = _distribution(rng)
    x = int(np.argsort(p)[-2])  # the second likeliest token
    q = np.eye(VOCAB)[x]
    accepted, tokens = rejection_sample(jnp.broadcast_to(p, (N, VOCAB)),
                                        jnp.broadcast_to(q, (N, VOCAB)),
                                        jnp.full(N, x, jnp.int32), jax.random.key(3))
    accepted, tokens = np.asarray(accepted), np.asarray(tokens)
    assert _chi_square_ok(np.bincount(tokens, minlength=VOCAB), p)
    residual = np.where(np.arange(VOCAB) == x, 0, p) / (1 - p[x])
    assert _chi_square_ok(np.bincount(tokens[~accepted], minlength=VOCAB), residual)


def _rows(temperature: float, top_k: int, top_p: float, seeds: np.ndarray, step: int):
    """Sampling rows on device: one per seed, sampling output index `step`."""
    count = len(seeds)
    return jax.tree.map(jnp.asarray, dataclasses.replace(
        greedy_sampling(count), temperature=np.full(count, temperature, np.float32),
        top_k=np.full(count, top_k, np.int32), top_p=np.full(count, top_p, np.float32),
        seeds=seeds.astype(np.uint32), steps=np.full(count, step, np.int32)))


def test_verification_by_the_sampler_keeps_the_joint_distribution_of_two_tokens():
    """The engine's path: a request with drafted tokens d1, d2 samples every position with the
    ordinary sampler (its seed, output index 0, 1, 2) and accepts up to the first mismatch;
    without a draft accepted its second token comes from the next step (output index 1 again,
    after the token it emitted). The first two tokens must follow p0(a) p1(b | a), p after
    temperature 0.8, top-k 6 and top-p 0.9, over N seeds."""
    rng = np.random.default_rng(4)
    first = jnp.asarray(rng.normal(0, 1.5, VOCAB), jnp.float32)  # logits of position 0
    after = jnp.asarray(rng.normal(0, 1.5, (VOCAB, VOCAB)), jnp.float32)  # [previous, V]
    seeds = np.arange(N)
    params = dict(temperature=0.8, top_k=6, top_p=0.9)
    rows = [_rows(**params, seeds=seeds, step=j) for j in range(3)]
    p0 = np.asarray(target_probs(first[None], _take(rows[0], 1)))[0]
    p1 = np.asarray(target_probs(after, _take(rows[0], VOCAB)))  # [previous, V]
    d1, d2 = int(np.argsort(p0)[-1]), int(np.argsort(p1[np.argsort(p0)[-1]])[-1])

    def draw(logits, step):  # one sampler call over all N seeds
        return np.asarray(sample(logits, rows[step]).tokens)

    y0 = draw(jnp.broadcast_to(first, (N, VOCAB)), 0)  # the scheduled row
    y1 = draw(jnp.broadcast_to(after[d1], (N, VOCAB)), 1)  # draft row of d1
    y2 = draw(jnp.broadcast_to(after[d2], (N, VOCAB)), 2)  # draft row of d2 (not needed here)
    next_step = draw(after[y0], 1)  # no draft accepted: the next step samples after y0
    accepted = np.array([accepted_length((d1, d2), s) for s in zip(y0, y1, y2)])
    second = np.where(accepted >= 1, y1, next_step)
    assert (accepted >= 1).mean() > 0.1  # d1 is the likeliest token: often right
    assert np.array_equal(second, next_step)  # token-identical to decoding without drafts
    joint = np.zeros((VOCAB, VOCAB))
    np.add.at(joint, (y0, second), 1)
    assert _chi_square_ok(joint, p0[:, None] * p1)


def _take(rows, count: int):
    return jax.tree.map(lambda a: a[:count], rows)
