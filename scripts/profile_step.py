"""Where a decode step's time goes: the step timed whole, and with parts of it taken out.

    .venv/bin/python scripts/profile_step.py --batch 1 --batch 32 --context 128

Variants, each a fresh runner on SmolLM2 (float32) timed by `roofline.measure_decode_step`:
  full          the step as it serves
  no-attention  the attention backend replaced by an identity (the KV writes stay)
  no-sampler    the sampler replaced by an argmax (no logprobs, penalties or filters)
A variant's distance from `full` is what the part costs. The replacements compute nonsense
tokens; they exist only to time the rest.
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp

from meshserve.model import attention, steps
from meshserve.model.pretrained import load_pretrained
from meshserve.model.sampler import Sampled
from meshserve.serving.bench import roofline
from meshserve.serving.bench.bench import decode_runner


def _identity_attention(q, k, v, cache_k, cache_v, layer, meta, *, block_pages):
    return q, cache_k, cache_v


def _argmax_sampler(logits, s, *, num_top_logprobs, replica_axes):
    rows = logits.shape[0]
    return Sampled(tokens=jnp.argmax(logits, -1).astype(jnp.int32), logprobs=jnp.zeros(rows),
                   top_ids=jnp.zeros((rows, num_top_logprobs), jnp.int32),
                   top_logprobs=jnp.zeros((rows, num_top_logprobs)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, action="append", required=True)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    model = load_pretrained(args.model).model
    backend, sampler = attention.ATTENTION_BACKENDS["jnp"], steps.sample
    variants = {"full": lambda: None,
                "no-attention": lambda: attention.ATTENTION_BACKENDS.update(
                    jnp=_identity_attention),
                "no-sampler": lambda: setattr(steps, "sample", _argmax_sampler)}
    print(f"{'variant':<13} {'batch':>5} {'step ms':>8}")
    for name, apply in variants.items():
        attention.ATTENTION_BACKENDS["jnp"], steps.sample = backend, sampler
        apply()
        for batch in args.batch:
            runner = decode_runner(model, max_batch=batch, context=args.context, page_size=16)
            seconds = roofline.measure_decode_step(runner, batch=batch, context=args.context)
            print(f"{name:<13} {batch:>5} {seconds * 1e3:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
