"""`meshserve convert`: write a model (any `--model` form) as a meshserve checkpoint directory:
orbax weights, config, tokenizer and manifest; `--model DIR` then loads it."""

from __future__ import annotations

import argparse
from pathlib import Path

from meshserve.model.loading.checkpoint import check_destination, save_checkpoint
from meshserve.model.loading.hub import DEFAULT_MODEL
from meshserve.model.loading.pretrained import load_pretrained
from meshserve.model.quant_formats import SCHEMES
from meshserve.serving.options import DTYPES

HELP = "write a model as a meshserve checkpoint"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="known model name, .gguf file, HF directory, checkpoint, or preset")
    parser.add_argument("--out", required=True, type=Path, help="the checkpoint directory")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="the weights' dtype (default: %(default)s)")
    parser.add_argument("--quantization", default="none", choices=SCHEMES,
                        help="weight-only quantized kernels, as the engine's --quantization "
                             "(default: %(default)s: a float checkpoint)")
    parser.add_argument("--force", action="store_true", help="replace --out if it is not empty")


def run(args: argparse.Namespace) -> None:
    check_destination(args.out, force=args.force)  # before the (slow) load
    pretrained = load_pretrained(args.model, dtype=args.dtype, quantization=args.quantization)
    path = save_checkpoint(pretrained.model, pretrained.tokenizer, args.out, force=args.force)
    config = pretrained.config
    tokenizer = "with its tokenizer" if pretrained.tokenizer is not None else "no tokenizer"
    print(f"wrote {config.name} ({config.num_params / 1e6:.1f}M params, {config.dtype}, "
          f"{tokenizer}) to {path}")
