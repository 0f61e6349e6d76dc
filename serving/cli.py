"""The `meshserve` command line.

Subcommands:
  demo       answer a few prompts with the default model and print tokens/s
  generate   answer prompts given on the command line (`--prompt`, repeatable)
  roofline   measure this machine's bandwidth and matmul rate, and decode steps against the floor

Options that configure a part of meshserve are generated from that part's config dataclass
(`RunnerConfig` today), so a field is declared once and the CLI follows it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Sequence

from meshserve.model.config import bytes_per_element
from meshserve.model.hub import DEFAULT_MODEL
from meshserve.model.pretrained import load_pretrained
from meshserve.model.runner import CompileCounter, ModelRunner, RunnerConfig
from meshserve.serving import roofline
from meshserve.serving.generate import generate_greedy

DEMO_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for learning to code.",
)


def add_dataclass_args(parser: argparse.ArgumentParser, cls) -> None:
    """One `--field-name` option per field of a frozen config dataclass, typed by its default."""
    group = parser.add_argument_group(cls.__name__)
    for field in dataclasses.fields(cls):
        flag = "--" + field.name.replace("_", "-")
        group.add_argument(flag, type=type(field.default), default=field.default,
                           dest=field.name, help=f"(default: {field.default})")


def dataclass_from_args(cls, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshserve", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("demo", "answer a few prompts with the default model"),
                            ("generate", "answer the given prompts")):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--model", default=DEFAULT_MODEL,
                         help="known model name, .gguf file, HF directory, or preset")
        sub.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
        sub.add_argument("--max-new-tokens", type=int, default=64)
        sub.add_argument("--raw", action="store_true",
                         help="feed prompts as plain text, without the chat template")
        if name == "generate":
            sub.add_argument("--prompt", action="append", required=True,
                             help="a prompt; repeat for a batch")
        add_dataclass_args(sub, RunnerConfig)
    roofline = commands.add_parser("roofline", help="decode step time against the machine's floor")
    roofline.add_argument("--model", default=DEFAULT_MODEL)
    roofline.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    roofline.add_argument("--batch", type=int, action="append",
                          help="decode batch size; repeat for several (default: 1)")
    roofline.add_argument("--context", type=int, default=128, help="tokens already in context")
    add_dataclass_args(roofline, RunnerConfig)
    return parser


def run_roofline(args: argparse.Namespace) -> None:
    runner_config = dataclass_from_args(RunnerConfig, args)
    pretrained = load_pretrained(args.model, dtype=args.dtype)
    runner = ModelRunner(pretrained.model, runner_config)
    machine = roofline.measure_machine()
    config = pretrained.config
    print(f"bandwidth {machine.bandwidth / 1e9:.1f} GB/s, matmul {machine.matmul_rate / 1e9:.1f} "
          f"GFLOP/s, weights {config.num_params * bytes_per_element(config.dtype) / 1e6:.0f} MB")
    print(f"{'batch':>5} {'step ms':>9} {'floor ms':>9} {'floor/step':>10}")
    for batch in args.batch or [1]:
        step = roofline.measure_decode_step(runner, batch=batch, context=args.context)
        floor = roofline.decode_floor(config, machine, batch=batch, context=args.context)
        print(f"{batch:>5} {step * 1e3:>9.2f} {floor * 1e3:>9.2f} {floor / step:>10.2f}")


def run_generate(args: argparse.Namespace, prompts: Sequence[str]) -> None:
    runner_config = dataclass_from_args(RunnerConfig, args)
    started = time.perf_counter()
    pretrained = load_pretrained(args.model, dtype=args.dtype)
    tokenizer = pretrained.tokenizer
    if tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer; pass a GGUF file or an HF "
                         "directory with tokenizer.json")
    runner = ModelRunner(pretrained.model, runner_config)
    prompt_ids = [tokenizer.encode(_render(tokenizer, p, raw=args.raw)) for p in prompts]
    print(f"loaded {pretrained.config.name} in {time.perf_counter() - started:.1f}s")
    started = time.perf_counter()
    with CompileCounter() as compiles:
        rows = generate_greedy(runner, prompt_ids, max_new_tokens=args.max_new_tokens,
                               stop_token_ids=tokenizer.eos_token_ids)
    elapsed = time.perf_counter() - started
    for prompt, row in zip(prompts, rows):
        print(f"\n>>> {prompt}\n{tokenizer.decode(row.token_ids).strip()}")
    num_tokens = sum(len(r.token_ids) for r in rows)
    running = elapsed - compiles.seconds
    print(f"\n{num_tokens} tokens for a batch of {len(rows)} in {elapsed:.2f}s, of which "
          f"{compiles.seconds:.2f}s compiling {compiles.count} programs: "
          f"{num_tokens / running:.1f} tokens/s compiled")


def _render(tokenizer, prompt: str, *, raw: bool) -> str:
    if raw:
        return prompt
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}])


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "roofline":
            run_roofline(args)
        else:
            run_generate(args, DEMO_PROMPTS if args.command == "demo" else args.prompt)
    except (ValueError, FileNotFoundError) as err:
        print(f"meshserve: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
