"""The command line's shared options, generated from the configs' field metadata.

A config field declared with `knob(default, help, compile=...)` (`meshserve.batching.knobs`)
becomes `--field-name`, typed by its annotation, with its help text, "(compile)" when a new value
changes compiled shapes, and its default. Booleans get `--x/--no-x`. Nothing here re-declares a
knob: a config's field list is the flag list.

Also the groups several subcommands share: the model and engine options (`add_model_args`,
`load_llm`), the sampling options (`add_sampling_args`) and the many-hosts options
(`add_cluster_args`, `cluster_config_from_args`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import typing

from meshserve.batching.sampling import SamplingParams
from meshserve.model.loading.hub import DEFAULT_MODEL
from meshserve.serving.engine import multihost
from meshserve.serving.engine.engine_config import EngineConfig
from meshserve.serving.python_api.llm import LLM

DTYPES = ("float32", "bfloat16")


def flag_fields(cls) -> list[dataclasses.Field]:
    """The fields of config `cls` that are command-line flags: those declared with help text."""
    return [f for f in dataclasses.fields(cls)
            if "help" in f.metadata and f.metadata.get("flag", True)]


def help_text(field: dataclasses.Field) -> str:
    """The field's help, its choices, "(compile)" if it changes compiled shapes, its default."""
    meta = field.metadata
    text = meta["help"]
    if meta.get("choices"):
        text += f"; one of {', '.join(meta['choices'])}"
    notes = ["compile"] if meta.get("compile") else []
    default = "%(default)s"
    if isinstance(field.default, tuple):  # a list flag: its values as they are typed
        default = " ".join(field.default) or "none"
    return f"{text} ({'; '.join(notes + ['default: ' + default])})"


def add_config_args(parser: argparse.ArgumentParser, cls, *, title: str | None = None,
                    description: str | None = None) -> argparse._ArgumentGroup:
    """One `--field-name` option per flag field of a frozen config dataclass."""
    group = parser.add_argument_group(title or cls.__name__, description)
    hints = typing.get_type_hints(cls)
    for field in flag_fields(cls):
        flags = ["--" + field.name.replace("_", "-"), *field.metadata.get("aliases", ())]
        kind = _scalar_type(hints[field.name])
        common = dict(default=field.default, dest=field.name, help=help_text(field))
        if kind is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, **common)
        else:
            group.add_argument(*flags, type=kind, metavar=field.metadata.get("metavar"),
                               nargs=field.metadata.get("nargs"), **common)
    return group


def _scalar_type(hint) -> type:
    """`int` for `int` and `int | None`; `str` for `str | MeshConfig | None` and for
    `tuple[str, ...]` (a list flag, `nargs` in its metadata)."""
    options = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    return options[0]


def dataclass_from_args(cls, args: argparse.Namespace):
    """Config `cls` from its flags; fields without a flag keep their defaults."""
    return cls(**{f.name: getattr(args, f.name) for f in flag_fields(cls)})


# -- the model and engine ---------------------------------------------------------------------

def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="known model name, .gguf file, HF directory, or preset")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="the weights' dtype (default: %(default)s)")
    add_config_args(parser, EngineConfig)


def load_llm(args: argparse.Namespace, *, needs_tokenizer: bool, warmup: bool = True,
             cluster: multihost.ClusterConfig | None = None) -> LLM:
    """The model and engine; bad options and a missing tokenizer fail before the warm-up."""
    config = dataclass_from_args(EngineConfig, args)
    started = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, cluster=cluster,
              **(dataclasses.asdict(config) | {"warmup": False}))
    print(f"meshserve: loaded {llm.model_config.name} in {time.perf_counter() - started:.1f} s",
          file=sys.stderr, flush=True)
    if needs_tokenizer and llm.tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer; pass a GGUF file or an HF "
                         "directory with tokenizer.json")
    if warmup and config.warmup:
        llm.engine.warmup()
    return llm


def chat(llm: LLM, messages: list[dict]) -> str:
    return llm.tokenizer.apply_chat_template(messages)


# -- sampling ---------------------------------------------------------------------------------

SAMPLING_FLAGS = {  # the `SamplingParams` fields a prompt on the command line takes
    "max_tokens": (64, "tokens to generate per prompt"),
    "temperature": (0.0, "0 is greedy"),
    "seed": (None, "sampling seed"),
}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    hints = typing.get_type_hints(SamplingParams)
    for name, (default, text) in SAMPLING_FLAGS.items():
        group.add_argument("--" + name.replace("_", "-"), type=_scalar_type(hints[name]),
                           default=default, help=f"{text} (default: %(default)s)")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(**{name: getattr(args, name) for name in SAMPLING_FLAGS})


# -- many hosts -------------------------------------------------------------------------------

def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    group = add_config_args(
        parser, multihost.ClusterConfig, title="many hosts (jax.distributed)",
        description="one process per host, one mesh over all their devices; process 0 serves, "
                    "the others follow its plan stream. Give all of --coordinator, "
                    "--num-processes and --process-id, or --distributed to read them from the "
                    "cluster (SLURM, Open MPI, Kubernetes).")
    group.add_argument("--distributed", action="store_true",
                       help="join a multi-process job, auto-detecting what is not given")


def cluster_config_from_args(args: argparse.Namespace) -> multihost.ClusterConfig | None:
    """The job to join, or None to run alone."""
    given = [args.coordinator, args.num_processes, args.process_id]
    if all(v is None for v in given) and not args.distributed:
        return None
    if any(v is None for v in given) and not args.distributed:
        raise ValueError("give all of --coordinator, --num-processes and --process-id, or add "
                         "--distributed to read the missing ones from the cluster environment")
    return dataclass_from_args(multihost.ClusterConfig, args)
