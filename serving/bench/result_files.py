"""Result files: the source a result is stamped with (its provenance), and the rule that a result
file is never overwritten. Every command and script that writes a result (`meshserve bench`,
`roofline`, `mesh-sweep`, `quality`, `length_eval`, `scripts/profile_step.py`,
`scripts/compare_grammar_libraries.py`) goes through this module.

Invariants:
- A result's `environment` names the commit it ran from (`git_commit`) and whether the tree
  differed from it (`git_dirty`, with the changed paths and a hash of the difference). A tree
  with uncommitted changes is refused before the run unless `--allow-dirty`.
- A result file, and every plot beside it, is a new file: a path that exists is refused before
  the run, and the final write is an exclusive create, so not even a run started beside this one
  can replace a file. `{date}` and `{commit}` in an output path are filled in with the run's UTC
  date and short commit, so one command line gives a new file at each commit and day.

Only the standard library is imported: `scripts/compare_grammar_libraries.py` may run in an
environment without meshserve, and loads this file by its path.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Iterable

SOURCE_DIR = Path(__file__).resolve().parent  # git finds the checkout from here
# What a run writes (its JSON and plots) and prose cannot change what a run computes, so they
# may differ from the commit; anything else that differs makes the tree dirty. Workload and
# predictor inputs in benchmarks/results (.jsonl, .npz) do count.
NOT_SOURCE = (":(exclude)benchmarks/results/*.json", ":(exclude)benchmarks/results/*.png",
              ":(exclude)*.md")
SHORT_COMMIT = 7  # hex digits of the commit that `{commit}` writes into a file name


@dataclasses.dataclass(frozen=True)
class Provenance:
    """The source a result came from: its commit, and the paths where the tree differed from it
    (tracked changes against HEAD, and untracked files) with the SHA-256 of that difference."""

    git_commit: str | None  # None: not run from a git checkout
    dirty_paths: tuple[str, ...] = ()
    diff_sha256: str | None = None

    def as_dict(self) -> dict[str, Any]:
        stamp: dict[str, Any] = {"git_commit": self.git_commit,
                                 "git_dirty": None if self.git_commit is None
                                 else bool(self.dirty_paths)}
        if self.dirty_paths:
            stamp |= {"git_dirty_paths": list(self.dirty_paths),
                      "git_diff_sha256": self.diff_sha256}
        return stamp


def add_allow_dirty_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-dirty", action="store_true",
                        help="write the result even though the source tree has uncommitted "
                             "changes; the JSON then says git_dirty, with the changed paths and "
                             "the SHA-256 of the diff")


def provenance(*, allow_dirty: bool) -> Provenance:
    """The source of a result about to be run; refuses (ValueError) a tree with uncommitted
    changes unless `allow_dirty`, since the commit alone would then not say what ran. Called
    before a run, so a refusal costs nothing."""
    source = source_tree(SOURCE_DIR)
    if source.dirty_paths and not allow_dirty:
        shown = ", ".join(source.dirty_paths[:5]) + (", ..." if len(source.dirty_paths) > 5
                                                      else "")
        raise ValueError(
            f"the source tree has uncommitted changes ({shown}), so commit "
            f"{source.git_commit[:12]} alone would not say what produced this result; commit "
            f"them first, or pass --allow-dirty to record the result as dirty with a hash of "
            f"the diff")
    return source


def source_tree(directory: Path) -> Provenance:
    """The commit checked out around `directory` and how the tree differs from it. The hash
    covers `git diff --binary HEAD` over the source paths, then each untracked file's path and
    bytes in path order."""
    top = _git(directory, "rev-parse", "--show-toplevel")
    head = None if top is None else _git(Path(top.decode().strip()), "rev-parse", "HEAD")
    if head is None:
        return Provenance(None)
    root = Path(top.decode().strip())
    changed = _git(root, "diff", "--name-only", "-z", "HEAD", "--", ".", *NOT_SOURCE) or b""
    untracked = _git(root, "ls-files", "--others", "--exclude-standard", "-z", "--", ".",
                     *NOT_SOURCE) or b""
    new_files = sorted(p.decode() for p in untracked.split(b"\0") if p)
    paths = sorted({p.decode() for p in changed.split(b"\0") if p} | set(new_files))
    if not paths:
        return Provenance(head.decode().strip())
    digest = hashlib.sha256(_git(root, "diff", "--binary", "HEAD", "--", ".", *NOT_SOURCE))
    for path in new_files:
        digest.update(path.encode() + b"\0" + (root / path).read_bytes())
    return Provenance(head.decode().strip(), tuple(paths), digest.hexdigest())


def _git(directory: Path, *args: str) -> bytes | None:
    """git's output, or None where git is missing or fails (not a checkout)."""
    try:
        result = subprocess.run(["git", "-C", str(directory), *args], capture_output=True,
                                check=False)
    except FileNotFoundError:
        return None
    return result.stdout if result.returncode == 0 else None


def machine() -> dict[str, Any]:
    """The machine and Python a run is on."""
    return {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
            "cpu_count": len(os.sched_getaffinity(0)), "python": platform.python_version()}


def host_environment(source: Provenance) -> dict[str, Any]:
    """The machine a result came from and its provenance (`Provenance.as_dict`);
    `meshserve.serving.bench.bench.environment` adds JAX's version and devices."""
    return machine() | source.as_dict()


# -- Never overwritten: output paths ----------------------------------------------------------


def prepare_output(requested: str | Path | None, *, allow_dirty: bool, flag: str = "--output"
                   ) -> tuple[Provenance | None, Path | None]:
    """Before a run that writes a result to `requested` (None: it writes none): the source it
    will be stamped with (`provenance`) and the new file it goes to (`output_path`), refused
    with a ValueError if the tree is dirty without `allow_dirty` or the file exists."""
    if requested is None:
        return None, None
    source = provenance(allow_dirty=allow_dirty)
    path = output_path(requested, source, flag=flag)
    refuse_existing([path], flag=flag)
    return source, path


def output_path(requested: str | Path, source: Provenance | None, *, flag: str = "--output",
                today: datetime.date | None = None) -> Path:
    """`requested` with `{date}` (the UTC date, YYYY-MM-DD) and `{commit}` (the first
    `SHORT_COMMIT` hex digits of the source's commit) filled in; other text is kept as given.
    `{commit}` outside a git checkout raises ValueError naming `flag`."""
    text = str(requested)
    if "{commit}" in text:
        if source is None or source.git_commit is None:
            raise ValueError(f"{flag} {text}: {{commit}} needs a git checkout to name the commit")
        text = text.replace("{commit}", source.git_commit[:SHORT_COMMIT])
    if "{date}" in text:
        day = today or datetime.datetime.now(datetime.timezone.utc).date()
        text = text.replace("{date}", day.isoformat())
    return Path(text)


def refuse_existing(paths: Iterable[Path], *, flag: str = "--output") -> None:
    """Raises ValueError naming `flag` and the first of `paths` that exists: a result file is
    never overwritten. Called before a run, so a refusal costs nothing."""
    for path in paths:
        if path.exists():
            raise ValueError(
                f"{flag} {path} exists, and a result file is never overwritten: name a new "
                f"file (`{{date}}` and `{{commit}}` in the name are filled in with the run's "
                f"date and commit, e.g. {_suggestion(path)})")


def _suggestion(path: Path) -> Path:
    return path.with_name(f"{path.stem}-{{date}}-{{commit}}{path.suffix}")


def plot_paths(directory: Path, stem: str, names: Iterable[str]) -> list[Path]:
    """Where plots named `names` of a result go: `<directory>/<stem>-<name>.png`, beside their
    JSON when `directory` is the JSON's folder and `stem` its name without `.json`."""
    return [directory / f"{stem}-{name}.png" for name in names]


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Writes `payload` as indented JSON to a new file at `path` (its folders made as needed);
    a file already there raises FileExistsError and is left as it was."""
    text = json.dumps(payload, indent=2) + "\n"  # before the file exists: a bad payload leaves none
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "x", encoding="utf-8") as file:
        file.write(text)
