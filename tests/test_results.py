"""The committed results in `benchmarks/results/` and what README.md and docs/benchmarks.md quote
from them (docs/benchmarks.md, "Result files"):

- every JSON result names, in `environment.git_commit`, a commit of this repository's history
  (an ancestor of HEAD), so the source that produced it can be checked out; a shallow clone
  cannot tell, and fails with how to fetch the history rather than pass unchecked;
- every plot sits beside the result it was drawn from, and every other file there is an input
  (a workload or a predictor) that a result names;
- every figure the two documents quote from a result file is in that file: in each paragraph,
  list item or table row that names a result file (or follows a `<!-- results: ... -->` marker,
  or is a row of a table in a section whose last command writes one), every decimal figure must
  be one of the file's numbers, rounded as written, in the unit written after it, or a ratio
  (`0.79x`) of two figures beside it, or be named by a `<!-- not from the results: ... -->`
  marker;
- `scripts/compare_grammar_libraries.py`, which may run where meshserve is not installed, stamps
  and never overwrites its result like every other writer (`tests/serving/test_bench.py` covers
  the `meshserve` commands).

Only git, the JSON and the Markdown are read: nothing here imports jax.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
QUOTING_DOCS = ("README.md", "docs/benchmarks.md")


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


def _result_files() -> list[Path]:
    return sorted(RESULTS.glob("*.json"))


# -- Provenance: every result names a commit of the history ---------------------------------------


@pytest.fixture(scope="module")
def full_history() -> None:
    """This checkout's history, whole; a shallow clone or no checkout fails the test with what
    to do, since an ancestor check there could not be trusted either way."""
    inside = _git("rev-parse", "--is-inside-work-tree")
    if inside.returncode != 0:
        pytest.fail(f"{ROOT} is not a git checkout, so no result's commit can be checked; run "
                    f"the tests from a clone of the repository")
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.fail("this clone is shallow, so a result's commit may be missing from it whether "
                    "or not it is in the history; fetch the whole history first (git fetch "
                    "--unshallow)")


@pytest.mark.parametrize("path", _result_files(), ids=lambda p: p.name)
def test_every_result_names_a_commit_in_the_history(path, full_history):
    result = json.loads(path.read_text())
    stamp = result.get("environment") or {}
    commit = stamp.get("git_commit")
    assert isinstance(commit, str) and re.fullmatch(r"[0-9a-f]{40}", commit), (
        f"{path.name}: environment.git_commit must be the full commit the run came from, got "
        f"{commit!r}")
    assert _git("merge-base", "--is-ancestor", commit, "HEAD").returncode == 0, (
        f"{path.name} names commit {commit[:12]}, which is not in HEAD's history (rewritten "
        f"before it landed?); stamp the commit whose source ran, with a provenance note")
    if "provenance" in result:  # why the stamp says what it says, in prose beside it
        assert isinstance(result["provenance"], str) and result["provenance"], (
            f"{path.name}: provenance must be a sentence saying why, not fields of its own")
    if "git_dirty" in stamp:
        assert stamp["git_dirty"] in (True, False), f"{path.name}: git_dirty must be a boolean"
    if stamp.get("git_dirty_paths"):
        assert stamp["git_dirty"] is True and re.fullmatch(r"[0-9a-f]{64}",
                                                           stamp["git_diff_sha256"])


def test_every_plot_sits_beside_its_result():
    """`<stem>-<plot>.png` beside `<stem>.json`, which lists it in `plots.files`."""
    for png in sorted(RESULTS.glob("*.png")):
        owners = [p for p in _result_files() if png.name.startswith(p.stem + "-")
                  and re.fullmatch(r"[a-z_]+\.png", png.name[len(p.stem) + 1:])]
        assert len(owners) == 1, f"{png.name} is not the plot of one result beside it"
        plots = json.loads(owners[0].read_text()).get("plots")
        assert plots and png.name in plots["files"], (
            f"{owners[0].name} does not list its plot {png.name} in plots.files")


def test_every_other_file_is_an_input_a_result_names():
    """Workloads (.jsonl) and predictors (.npz) are source: a result that ran on them names
    them, so its stamp covers them (a tree where they differ is dirty)."""
    texts = "\n".join(p.read_text() for p in _result_files())
    for path in sorted(RESULTS.iterdir()):
        if path.suffix in (".json", ".png"):
            continue
        assert path.suffix in (".jsonl", ".npz"), f"{path.name}: not a kind of result file"
        assert f"benchmarks/results/{path.name}" in texts, f"no result names {path.name}"


# -- Figures quoted from result files ----------------------------------------------------------

# The scales a figure may have against the JSON's number, by the unit written after it: the
# JSON holds seconds, bytes, fractions and per-second rates (and a few fields already in ms, us
# or percent).
UNIT_SCALES = {
    "ms": (1e3, 1.0), "s": (1.0,), "us": (1e6, 1.0), "µs": (1e6, 1.0), "%": (100.0, 1.0),
    "x": (1.0,), "KB": (1e-3,), "MB": (1e-6,), "GB": (1e-9,), "MiB": (2 ** -20,),
    "GiB": (2 ** -30,), "GB/s": (1e-9,), "GFLOP/s": (1e-9,), "tok/s": (1.0,),
}
UNITLESS_SCALES = (1.0, 1e3, 1e6, 100.0, 1e-6, 1e-9)  # a table cell: its column names the unit
FIGURE = re.compile(r"(?<![\w.,/#-])(\d+(?:,\d{3})*\.\d+)(?![\w.]*\.\d|\w*\.json|[\w-]*\.png)"
                    r"(?:\s?(GB/s|GFLOP/s|tok/s|GiB|MiB|GB|MB|KB|ms|us|µs|x|s)\b|(%))?")
MARKER = re.compile(r"<!--\s*(results|not from the results):(.*?)-->")
NAMED = re.compile(r"([\w.-]*(?:\{[\w,.-]+\})?[\w.-]*\.json)")
OUTPUT_FLAG = re.compile(r"--out(?:put)?\s+(\S+\.json)")


@dataclasses.dataclass(frozen=True)
class Figure:
    """A decimal figure as written, and the unit written after it."""

    text: str
    unit: str | None

    @property
    def bounds(self) -> tuple[float, float]:
        """The values that round to the figure as written."""
        value = float(self.text.replace(",", ""))
        half = 0.5 * 10.0 ** -len(self.text.split(".")[1]) + 1e-9
        return value - half, value + half


@dataclasses.dataclass(frozen=True)
class Quote:
    """Text that quotes result files: a paragraph, a list item or a table row."""

    line: int
    text: str
    files: frozenset[str]
    exempt: frozenset[str]  # figures it says come from elsewhere
    block: tuple[Figure, ...]  # every figure of its paragraph or table, for ratios


def _cited(text: str) -> set[str]:
    """Result files a text names: `benchmarks/results/X.json` or `X.json`, with `{a,b}` read
    as either."""
    names = set()
    for found in NAMED.findall(text):
        name = found.rsplit("/", 1)[-1]
        brace = re.fullmatch(r"(.*)\{(.*)\}(.*)", name)
        options = ([brace[1] + part + brace[3] for part in brace[2].split(",")] if brace
                   else [name])
        names |= {n for n in options if (RESULTS / n).is_file()}
    return names


def _numbers(value):
    """Every number of a result outside per-request `samples`, with numeric keys (a
    temperature) and numbers written inside its strings (a load average in a note)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key != "samples":
                yield from _numbers(key)
                yield from _numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _numbers(item)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield float(value)
    elif isinstance(value, str):
        yield from (float(n) for n in re.findall(r"\d+\.\d+", value))


@lru_cache(maxsize=None)
def _values(name: str) -> tuple[float, ...]:
    return tuple(_numbers(json.loads((RESULTS / name).read_text())))


def _figures(text: str) -> tuple[Figure, ...]:
    """The decimal figures of a text, leaving out markers, inline code and link targets."""
    text = MARKER.sub("", text)
    text = re.sub(r"`[^`]*`", "", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return tuple(Figure(m[1], m[2] or m[3]) for m in FIGURE.finditer(text))


def in_files(figure: Figure, files) -> bool:
    """Whether one of the files' numbers, in the figure's unit, rounds to it as written."""
    low, high = figure.bounds
    scales = UNIT_SCALES.get(figure.unit, UNITLESS_SCALES) if figure.unit else UNITLESS_SCALES
    return any(low <= value * scale <= high
               for name in files for value in _values(name) for scale in scales)


def a_ratio_of(figure: Figure, figures) -> bool:
    """Whether a ratio (`0.79x`) is that of two other figures (each checked on its own),
    within their rounding."""
    if figure.unit != "x":
        return False
    low, high = figure.bounds
    others = [f.bounds for f in figures if f is not figure and f.unit != "x"]
    return any(a_low / b_high <= high and a_high / b_low >= low
               for a_low, a_high in others for b_low, b_high in others
               if (a_low, a_high) != (b_low, b_high) and b_low > 0)


def _blocks(markdown: str):
    """Each paragraph, list item or table outside fenced code as (first line number, lines,
    files the section's last command writes), and each marker on a line of its own as (line
    number, kind, text). A command is fenced code; the files it writes are the result files
    its `--output` or `--out` name, until the next heading or command."""
    block, start, fence, code, written = [], 0, False, "", set()
    for number, line in enumerate(markdown.splitlines(), 1):
        marker = MARKER.fullmatch(line) if line.startswith("<!--") else None
        ends = (line.startswith("```") or fence or not line.strip() or line.startswith("#")
                or marker or re.match(r"([-*]|\d+\.)\s", line))
        if block and ends:
            yield start, block, written
            block = []
        if line.startswith("```"):
            fence = not fence
            if not fence:
                written = {n for found in OUTPUT_FLAG.findall(code) for n in _cited(found)}
            code = ""
        elif fence:
            code += line + "\n"
        elif line.startswith("#"):
            written = set()
        elif marker:
            yield number, marker[1], marker[2]
        elif line.strip():
            start = start if block else number
            block.append(line)
    if block:
        yield start, block, written


def quotes(markdown: str) -> list[Quote]:
    """Each paragraph or list item that names a result file, each table row that names one,
    and each row of a table in a section whose last command writes result files (quoting
    those). A marker `<!-- results: X.json ... -->` on its own line ties the next paragraph or
    table to those files instead, and inside a paragraph ties that paragraph;
    `<!-- not from the results: 2.5 ... -->` names figures that come from elsewhere (a target,
    a load average), for the next block or the paragraph it is in."""
    found, marked, exempt = [], set(), set()
    for start, lines, extra in _blocks(markdown):
        if isinstance(lines, str):  # a marker line, for the next block
            if lines == "results":
                marked = _cited(extra)
                assert marked, f"line {start}: the marker names no result file that exists"
            else:
                exempt = set(extra.split())
            continue
        text = "\n".join(lines)
        for kind, names in MARKER.findall(re.sub(r"`[^`]*`", "", text)):
            if kind == "results":
                marked |= _cited(names)
            else:
                exempt |= set(names.split())
        block = _figures(text)
        if all(line.lstrip().startswith("|") for line in lines):
            rows = [(start + i, line, _cited(line) or marked or extra)
                    for i, line in enumerate(lines)]
        else:
            rows = [(start, text, _cited(text) | marked)]
        found += [Quote(number, row, frozenset(files), frozenset(exempt), block)
                  for number, row, files in rows if files]
        marked, exempt = set(), set()
    return found


def misquoted(markdown: str) -> list[str]:
    """'line: figure is not in files' for each quoted figure that is neither in its files, nor
    a ratio of figures beside it, nor exempted."""
    wrong = []
    for quote in quotes(markdown):
        figures = _figures(quote.text)
        for figure in figures:
            if figure.text in quote.exempt or in_files(figure, quote.files):
                continue
            if a_ratio_of(figure, figures if len(figures) > 2 else quote.block):
                continue
            wrong.append(f"{quote.line}: {figure.text}{' ' + figure.unit if figure.unit else ''}"
                         f" is not in {', '.join(sorted(quote.files))}")
    return wrong


@pytest.mark.parametrize("doc", QUOTING_DOCS)
def test_every_figure_quoted_from_a_result_file_is_in_it(doc):
    wrong = misquoted((ROOT / doc).read_text(encoding="utf-8"))
    assert not wrong, f"{doc}:\n" + "\n".join(wrong)


def test_the_check_finds_a_figure_that_is_not_in_its_file():
    """The convention at work on a text of its own: a figure off by its last digit, a figure in
    the wrong unit and a ratio of nothing beside it fail; an exempted figure, one in code and a
    ratio of figures beside it do not; a paragraph that names no result file is not read."""
    name = "chat-mix-64-defaults-cpu-b426b59.json"
    result = json.loads((RESULTS / name).read_text())["results"]
    rate = result["continuous"]["output_tokens_per_s"]  # 133.136...
    static = result["static"]["output_tokens_per_s"]
    ttft = result["peers"]["llama-server"]["ttft_s"]["median"]
    text = (f"It ran at 1.5 tok/s.\n\n<!-- not from the results: 2.5 -->\n"
            f"It ran at {rate:.1f} tok/s against {static:.1f} ({rate / static:.2f}x), TTFT "
            f"{ttft:.1f} s, not {rate + 0.1:.1f}, {ttft:.2f} GB or 9.99x; target 2.5x (`{name}`, "
            f"`v1.25`).\n\n<!-- results: {name} -->\n| engine | tok/s |\n|---|---|\n"
            f"| static | {static:.1f} |\n| static | {static + 0.1:.1f} |\n")
    assert [(q.line, set(q.files), set(q.exempt)) for q in quotes(text)] == [
        (4, {name}, {"2.5"}), (7, {name}, set()), (8, {name}, set()), (9, {name}, set()),
        (10, {name}, set())]
    assert misquoted(text) == [f"4: {rate + 0.1:.1f} is not in {name}",
                               f"4: {ttft:.2f} GB is not in {name}",
                               f"4: 9.99 x is not in {name}",
                               f"10: {static + 0.1:.1f} is not in {name}"]


# -- The writer outside meshserve's commands -----------------------------------------------------


def test_the_grammar_script_stamps_its_result_and_never_overwrites_it(tmp_path):
    """With a tiny tokenizer, llguidance only: the JSON names this checkout's commit, and the
    same --output again is refused before anything runs."""
    tokenizer = tmp_path / "tokenizer.json"
    subprocess.run([sys.executable, "-c", "import sys; from tests.serving.tiny_tokenizer import "
                    "tiny_tokenizer; open(sys.argv[1], 'w').write(tiny_tokenizer()._backend"
                    ".to_str())", str(tokenizer)], cwd=ROOT, check=True)
    command = [sys.executable, "scripts/compare_grammar_libraries.py", "--tokenizer",
               str(tokenizer), "--vocab-size", "512", "--eos", "1", "--allow-dirty",
               "--output", str(tmp_path / "g-{commit}.json")]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
    head = _git("rev-parse", "HEAD").stdout.strip()
    out = tmp_path / f"g-{head[:7]}.json"
    result = json.loads(out.read_text())
    assert result["environment"]["git_commit"] == head
    assert result["command"].startswith("scripts/compare_grammar_libraries.py --tokenizer")
    assert result["llguidance"]["json_schema"]["steps"] > 0
    kept = out.read_bytes()
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 2 and f"--output {out} exists" in again.stderr
    assert out.read_bytes() == kept


def test_the_profile_script_refuses_an_existing_result_before_it_loads(tmp_path):
    """scripts/profile_step.py goes through the same check before it loads a model."""
    out = tmp_path / "profile.json"
    out.write_text("kept\n")
    run = subprocess.run([sys.executable, "scripts/profile_step.py", "--model", "no-such-model",
                          "--batch", "1", "--allow-dirty", "--output", str(out)],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2 and f"--output {out} exists" in run.stderr
    assert out.read_text() == "kept\n"
