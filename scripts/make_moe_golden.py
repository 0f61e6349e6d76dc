"""Generate the committed mixture-of-experts reference fixtures under ``tests/golden/``.

A developer tool, like ``scripts/make_golden.py`` (whose helpers it reuses): it needs HF
``transformers`` and ``torch`` (CPU), which are not meshserve runtime dependencies::

    .venv/bin/pip install torch==2.13.0 && .venv/bin/pip install -e '.[peers-hf]'
    .venv/bin/python scripts/make_moe_golden.py [--out tests/golden]

For each family it writes a folder (``tiny-mixtral/``, ``tiny-qwen2-moe/``, ``tiny-qwen3-moe/``)
holding a tiny randomly initialised HF model saved with ``save_pretrained`` (safetensors, one
tensor per expert as HF saves them) and:

``logits.npz``
    ``input_ids`` (int32 [2, 20]) and ``logits`` (float32 [2, 20, vocab]) of one full forward
    pass (no KV cache).
``greedy.json``
    Four prompts (the third shares the second's first 16 tokens, for prefix caching) and, for
    each alone, HF's greedy continuation with a KV cache: the token ids, the log-softmax
    logprob of each and the top-1 minus top-2 logprob margin at each step.

The weights are re-initialised larger than HF's default (matrices N(0, 0.2^2), norms
1 + N(0, 0.1^2)), so logits and routing are clearly decided. Routing is checked too: over every
token the fixtures feed (prompts and continuations), the k-th and (k+1)-th router probabilities
of every layer differ by at least ``MIN_ROUTER_GAP``, so float noise cannot change which experts
a token runs (the smallest gap is recorded), and every greedy step's top-2 logprob margin is at
least ``MIN_TOP2_MARGIN``, so every token is compared. config.json also gets the legacy keys that hub
checkpoints written by transformers 4 carry (``rope_theta``, ``num_experts``). Runs are
deterministic (seeds, float32, fixed zip timestamps).
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
from make_golden import greedy, reinit, setup_determinism, versions, write_json, write_npz  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
NUM_NEW_TOKENS = 10
MIN_TOP2_MARGIN = 1e-3  # every greedy token is decided by more than float noise
MIN_ROUTER_GAP = 1e-5  # float32 noise in the router probabilities is ~1e-7 here
PROMPT_LENGTHS = (7, 23, 29, 3)
SHARED_PREFIX = 16  # prompt 2 starts with prompt 1's first 16 tokens
MAX_FOLDER_BYTES = 400 * 1024


def tiny_configs():
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    attention = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128,
                     tie_word_embeddings=False, bos_token_id=None, eos_token_id=2)
    experts = dict(num_experts_per_tok=2)
    return [
        # (folder, config, seed)
        ("tiny-mixtral", MixtralConfig(**attention, **experts, intermediate_size=16,
                                       num_local_experts=8, rope_theta=1e6, rms_norm_eps=1e-5),
         11),
        ("tiny-qwen2-moe", Qwen2MoeConfig(**attention, **experts, intermediate_size=48,
                                          moe_intermediate_size=16, num_experts=8,
                                          shared_expert_intermediate_size=32,
                                          norm_topk_prob=False, rope_theta=1e6,
                                          rms_norm_eps=1e-6), 12),
        ("tiny-qwen3-moe", Qwen3MoeConfig(**attention, **experts, head_dim=8,
                                          intermediate_size=48, moe_intermediate_size=16,
                                          num_experts=8, norm_topk_prob=True, rope_theta=1e6,
                                          rms_norm_eps=1e-6), 14),
    ]


def prompts(vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(2000 + seed)
    out = [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    out[2][:SHARED_PREFIX] = out[1][:SHARED_PREFIX]
    return out


@torch.no_grad()
def router_gap(model, sequences: list[list[int]], k: int) -> float:
    """The smallest difference between the k-th and (k+1)-th router probability, over every
    token of `sequences` and every layer."""
    gaps = []
    for seq in sequences:
        ids = torch.tensor([seq], dtype=torch.long)
        out = model(input_ids=ids, output_router_logits=True, use_cache=False)
        for logits in out.router_logits:
            probs = torch.softmax(logits.float().reshape(-1, logits.shape[-1]), dim=-1)
            top = torch.topk(probs, k + 1, dim=-1).values
            gaps.append(float((top[:, k - 1] - top[:, k]).min()))
    return min(gaps)


def legacy_keys(config) -> dict:
    """What a transformers 4 config.json of the family carries besides transformers 5's keys."""
    keys = {"rope_theta": config.rope_parameters["rope_theta"], "rope_scaling": None}
    if config.model_type != "mixtral":
        keys["num_experts"] = config.num_experts
    return keys


def make_fixture(out: Path, folder: str, config, seed: int) -> None:
    from transformers import AutoModelForCausalLM

    d = out / folder
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    reinit(model, seed)
    gen = torch.Generator().manual_seed(1000 + seed)
    input_ids = torch.randint(0, config.vocab_size, (2, 20), generator=gen)
    with torch.no_grad():
        logits = model(input_ids=input_ids, use_cache=False).logits
    assert torch.isfinite(logits).all() and 1.0 <= logits.std().item() <= 5.0, logits.std()

    cases = []
    for prompt in prompts(config.vocab_size, seed):
        tokens, logprobs, margins = greedy(model, prompt, NUM_NEW_TOKENS)
        cases.append({"prompt_ids": prompt, "greedy_ids": tokens,
                      "greedy_logprobs": [round(x, 6) for x in logprobs],
                      "top2_margin": [round(x, 6) for x in margins]})
    margin = min(min(c["top2_margin"]) for c in cases)
    assert margin >= MIN_TOP2_MARGIN, f"{folder}: greedy top-2 margin {margin:.2e}; another seed"
    fed = [c["prompt_ids"] + c["greedy_ids"][:-1] for c in cases] + input_ids.tolist()
    gap = router_gap(model, fed, config.num_experts_per_tok)
    assert gap >= MIN_ROUTER_GAP, f"{folder}: router gap {gap:.2e}; pick another seed"

    model.save_pretrained(str(d))
    cfg_path = d / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(legacy_keys(config))
    cfg["golden_note"] = (f"random tiny model from scripts/make_moe_golden.py (seed {seed}); "
                          f"transformers {versions()['transformers_version']}, "
                          f"torch {torch.__version__}")
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    write_npz(d / "logits.npz", input_ids=input_ids.numpy().astype(np.int32),
              logits=logits.numpy().astype(np.float32),
              versions=np.array(json.dumps(versions(), sort_keys=True)))
    write_json(d / "greedy.json", {
        **versions(), "dtype": "float32", "num_new_tokens": NUM_NEW_TOKENS,
        "min_router_gap": float(f"{gap:.3e}"),
        "note": ("HF greedy decoding with a KV cache, each prompt alone: plain argmax over the "
                 "raw logits, EOS not special; logprobs are log_softmax of the raw logits, "
                 "rounded to 6 decimals. Prompt 2 shares prompt 1's first "
                 f"{SHARED_PREFIX} tokens."),
        "cases": cases,
    })
    check_reload(d, input_ids, logits)
    size = sum(f.stat().st_size for f in d.iterdir())
    print(f"  {folder}: logits std {logits.std().item():.3f}, router gap {gap:.2e}, "
          f"files {sorted(f.name for f in d.iterdir())}, {size / 1024:.0f} KiB")
    assert size < MAX_FOLDER_BYTES, size


def check_reload(directory: Path, input_ids, logits) -> None:
    """HF must reload the folder, legacy keys included, to identical logits."""
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    again.eval()
    with torch.no_grad():
        reloaded = again(input_ids=input_ids, use_cache=False).logits
    assert torch.equal(logits, reloaded), (logits - reloaded).abs().max()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "golden")
    args = parser.parse_args(argv)
    setup_determinism(0)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"transformers/torch: {versions()}; out={args.out}")
    for folder, config, seed in tiny_configs():
        make_fixture(args.out, folder, config, seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
