"""`meshserve demo`: `batch` on the shipped example prompts, answers printed as they finish."""

from __future__ import annotations

import argparse
import tempfile
from importlib import resources
from pathlib import Path

from meshserve.serving import options
from meshserve.serving.cli.batch_command import run_batch

HELP = "answer the shipped example prompts"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_model_args(parser)


def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_batch(args, demo_prompts(), Path(tmp) / "results.jsonl", show=True)


def demo_prompts() -> Path:
    return Path(str(resources.files("meshserve.serving") / "examples" / "demo_prompts.jsonl"))
