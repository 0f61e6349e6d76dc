"""Generate the golden fixtures of the dense families: Qwen3, Gemma 2, Gemma 3 (text), Phi-3.

A developer tool beside ``make_golden.py`` (whose helpers it uses), with the same needs: HF
``transformers`` and ``torch`` on the CPU, nothing downloaded. Regenerate with::

    .venv/bin/python scripts/make_golden_families.py [--out tests/golden]

For each family, ``tests/golden/tiny-<family>/`` gets a tiny random model that HF transformers
builds from its config class (``Qwen3Config``, ``Gemma2Config``, ``Gemma3TextConfig``,
``Phi3Config`` with LongRoPE and partial rotary), saved with ``save_pretrained`` in float16 (the
weights are rounded to float16 first, and every reference below is computed from the rounded
weights in float32, so a float32 load of the files reproduces them exactly), and:

``logits.npz``
    ``input_ids`` (int32 [2, 20]) and HF's ``logits`` (float32 [2, 20, vocab]) of one full
    forward pass, eager attention, no cache. Phi-3 adds ``logits_short``: the first 16 tokens
    alone, which HF rotates with the short LongRoPE factors (the full 20 exceed
    ``original_max_position_embeddings`` = 16 and take the long ones).

``greedy.json``
    Three prompts (random ids; lengths straddling the sliding window of 8) and HF's greedy
    continuation: 12 tokens by plain argmax with the KV cache, each step's logprob and top-2
    margin. Every step is checked against a cache-free forward pass of the whole sequence.

Config switches chosen to exercise each family's differences at this size: Gemma 2 soft-caps
at 4 (scores) and 5 (logits) and scales queries by ``query_pre_attn_scalar`` = 24 instead of
head_dim 16; Gemma 3 has a 2x linear RoPE scaling on its full layers and its own RoPE base on
the sliding ones; Phi-3 rotates 12 of 16 dimensions. ``config.json`` keeps the form hub
checkpoints have: transformers 4's keys (``rope_theta``, ``rope_scaling``, no ``layer_types``)
for Qwen3, Gemma 2 and Phi-3, transformers 5's (``rope_parameters`` per layer type,
``layer_types``) for Gemma 3; HF must reload each folder to identical logits.

Weights: matrices N(0, 0.2^2); norm weights 1 + N(0, 0.1^2), or N(0, 0.1^2) for Gemma, whose
norms scale by (1 + w). Gemma's tied embedding enters the residual stream scaled by sqrt(hidden),
and a stream that its input embedding leads predicts that token again: greedy decoding would
repeat one token, and the token check would add nothing. So Gemma's embedding is N(0, 0.1^2),
its post-attention and post-MLP norms scale by 4 (w = 3 + N(0, 0.1^2)) and its final norm by 2
(w = 1 + N(0, 0.1^2)): the layers lead the stream and the logits keep top-2 margins over 0.01,
and each greedy continuation takes five or more distinct tokens. Runs are deterministic.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_golden import (REPO_ROOT, check_against_full_forward, greedy, r6,  # noqa: E402
                         setup_determinism, versions, write_json, write_npz)

NUM_NEW_TOKENS = 12
WINDOW = 8
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=128, rms_norm_eps=1e-6)


def family_configs():
    """(folder, config, seed, prompt lengths, config.json rewrite)."""
    from transformers import Gemma2Config, Gemma3TextConfig, Phi3Config, Qwen3Config

    phi3_rope = {"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                 "long_factor": [1.5, 2.0, 3.0, 4.5, 7.0, 11.0]}
    return [
        ("tiny-qwen3", Qwen3Config(**SHAPE, rope_theta=1000000.0, tie_word_embeddings=True,
                                   bos_token_id=None, eos_token_id=2), 11, (5, 13, 24),
         _legacy_rope(rope_theta=1000000.0, rope_scaling=None)),
        ("tiny-gemma2", Gemma2Config(**SHAPE, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                     attn_logit_softcapping=4.0, final_logit_softcapping=5.0,
                                     bos_token_id=None, eos_token_id=1, pad_token_id=0), 12,
         (5, 13, 24), _legacy_rope(rope_theta=10000.0, drop=("layer_types",))),
        ("tiny-gemma3", Gemma3TextConfig(
            **SHAPE, sliding_window=WINDOW, sliding_window_pattern=3, rope_theta=1000000.0,
            rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
            bos_token_id=None, eos_token_id=1, pad_token_id=0), 13, (5, 13, 24), None),
        ("tiny-phi3", Phi3Config(
            **{k: v for k, v in SHAPE.items() if k != "head_dim"},
            original_max_position_embeddings=16, partial_rotary_factor=0.75,
            rope_scaling=dict(phi3_rope), sliding_window=WINDOW, tie_word_embeddings=False,
            bos_token_id=None, eos_token_id=2, pad_token_id=0), 14, (17, 21, 26),
         _legacy_rope(rope_theta=10000.0, rope_scaling=dict(phi3_rope),
                      original_max_position_embeddings=16, partial_rotary_factor=0.75)),
    ]


def _legacy_rope(*, drop: tuple[str, ...] = (), **keys):
    """config.json as transformers 4 wrote it: `rope_parameters` out, the old keys in."""
    def rewrite(cfg: dict) -> dict:
        cfg = {k: v for k, v in cfg.items() if k != "rope_parameters" and k not in drop}
        return cfg | keys
    return rewrite


# Gemma's (see the docstring): the embedding's scale, and the mean of w in the norms that scale
# by (1 + w) and are not 0.
GEMMA_EMBED_STD = 0.1
GEMMA_NORM_MEANS = {"post_attention_layernorm": 3.0, "post_feedforward_layernorm": 3.0,
                    "model.norm": 1.0}


@torch.no_grad()
def reinit(model, seed: int, *, gemma: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():  # tied parameters appear once
        if p.ndim >= 2:
            std = GEMMA_EMBED_STD if gemma and name.endswith("embed_tokens.weight") else 0.2
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        elif name.endswith("norm.weight"):
            p.copy_(_norm_mean(name, gemma) + torch.randn(p.shape, generator=gen) * 0.1)
        else:
            raise ValueError(f"unexpected parameter {name} {tuple(p.shape)}")
        p.copy_(p.half().float())  # the saved float16 weights are the reference's weights


def _norm_mean(name: str, gemma: bool) -> float:
    """The mean of a norm weight: 1 for the (w) norms, Gemma's from GEMMA_NORM_MEANS (0 for the
    rest) for its (1 + w) norms."""
    if not gemma:
        return 1.0
    norm = name.removesuffix(".weight")
    return next((mean for key, mean in GEMMA_NORM_MEANS.items()
                 if norm == key or norm.endswith("." + key)), 0.0)


@torch.no_grad()
def forward_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits


def greedy_cases(model, lengths, vocab: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(2000 + seed)
    cases = []
    for length in lengths:
        prompt = torch.randint(0, vocab, (length,), generator=gen).tolist()
        toks, lps, margins = greedy(model, prompt, NUM_NEW_TOKENS)
        worst = check_against_full_forward(model, prompt, toks, lps, margins)
        assert worst < 1e-4, worst
        assert len(set(toks)) > 1, f"greedy repeats token {toks[0]}: its check would add nothing"
        cases.append({"prompt_ids": prompt, "greedy_ids": toks,
                      "greedy_logprobs": [r6(x) for x in lps],
                      "top2_margin": [r6(x) for x in margins]})
        print(f"    prompt {length}: min margin {min(margins):.4f}, cache-vs-full {worst:.1e}")
    return cases


def make_family(out: Path, folder: str, config, seed: int, lengths, rewrite) -> None:
    from transformers import AutoModelForCausalLM

    d = out / folder
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation="eager")
    model.eval()
    reinit(model, seed, gemma="gemma" in folder)
    gen = torch.Generator().manual_seed(1000 + seed)
    ids = torch.randint(0, config.vocab_size, (2, 20), generator=gen)
    logits = forward_logits(model, ids)
    assert torch.isfinite(logits).all()
    arrays = dict(input_ids=ids.numpy().astype(np.int32), logits=logits.numpy())
    if folder == "tiny-phi3":
        short = forward_logits(model, ids[:, :16])
        assert not torch.allclose(short, logits[:, :16], atol=1e-3), "LongRoPE did not switch"
        arrays["logits_short"] = short.numpy()
    cases = greedy_cases(model, lengths, config.vocab_size, seed)

    model.half().save_pretrained(str(d))
    cfg_path = d / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if rewrite is not None:
        cfg = rewrite(cfg)
    cfg["golden_note"] = (f"random tiny model from scripts/make_golden_families.py (seed {seed}); "
                          f"transformers {versions()['transformers_version']}, "
                          f"torch {torch.__version__}")
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    write_npz(d / "logits.npz", **arrays, versions=np.array(json.dumps(versions(),
                                                                       sort_keys=True)))
    write_json(d / "greedy.json", {**versions(), "dtype": "float32",
                                   "num_new_tokens": NUM_NEW_TOKENS, "cases": cases})
    _check_reload(d, ids, logits)
    size = sum(f.stat().st_size for f in d.iterdir())
    print(f"  {folder}: logits std {logits.std().item():.3f}, {size / 1024:.0f} KiB")
    assert size < 400 * 1024, size


@torch.no_grad()
def _check_reload(d: Path, ids: torch.Tensor, logits: torch.Tensor) -> None:
    """HF reads the written folder (the rewritten config.json included) to the same logits."""
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                 attn_implementation="eager")
    again.eval()
    got = forward_logits(again, ids)
    assert torch.equal(got, logits), f"{d.name}: reload differs by {(got - logits).abs().max()}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "golden")
    p.add_argument("--families", default="tiny-qwen3,tiny-gemma2,tiny-gemma3,tiny-phi3")
    args = p.parse_args(argv)
    setup_determinism(0)
    wanted = set(args.families.split(","))
    for folder, config, seed, lengths, rewrite in family_configs():
        if folder in wanted:
            print(f"{folder}:")
            make_family(args.out, folder, config, seed, lengths, rewrite)
    return 0


if __name__ == "__main__":
    sys.exit(main())
