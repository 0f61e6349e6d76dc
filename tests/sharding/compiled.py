"""Compiling the runner's step without running it, and reading the partitioned HLO it becomes."""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np

from meshserve.batching.plan import empty_sub_batch, greedy_sampling
from meshserve.model.config import ModelConfig
from meshserve.model.runner import ModelRunner, RunnerConfig, pad_sub_batch
from meshserve.model.transformer import model_from_params
from meshserve.sharding.layout import prepare
from meshserve.sharding.rules import DEFAULT_RULES, ShardingRules
from tests.conftest import random_params

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
ROWS, PAGES = 4, 4  # the decode bucket compiled below: 4 rows per replica, 4 pages per row
RUNNER_CONFIG = RunnerConfig(num_pages=16, page_size=8, max_rows=ROWS, max_tokens=16,
                             max_pages_per_seq=PAGES, max_logprobs=4)
RULES = {"default": DEFAULT_RULES, "ffw-replicated": ShardingRules({**DEFAULT_RULES.table,
                                                                     "ffw": None})}


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    runner: ModelRunner
    args: tuple  # (params, cache, (batch,), (sampling,))
    compiled: object  # jax.stages.Compiled
    hlo: "Hlo"


def tensor_parallel_step(preset: str, mesh: str, tokens: int = 1, *, rules: str = "default",
                         overrides: tuple = ()) -> CompiledStep:
    """The runner of a random-weight `preset` on `mesh`, and its step compiled for
    (ROWS, tokens, PAGES). Cached: several test modules read the same programs."""
    return _tensor_parallel_step(preset, mesh, tokens, rules, overrides)


@functools.lru_cache(maxsize=None)
def _tensor_parallel_step(preset: str, mesh: str, tokens: int, rules: str,
                          overrides: tuple) -> CompiledStep:
    config = ModelConfig.preset(preset, **dict(overrides))
    prepared = prepare(model_from_params(config, random_params(config)), mesh,
                       rules=RULES[rules])
    runner = ModelRunner(prepared.model, RUNNER_CONFIG, prepared.layout)
    args = step_arguments(runner, ROWS, tokens, PAGES)
    compiled = runner._step.lower(*args).compile()
    return CompiledStep(runner, args, compiled, Hlo.parse(compiled.as_text()))


def step_arguments(runner: ModelRunner, rows: int, tokens: int, pages: int) -> tuple:
    """The step's arguments for the bucket `(rows per replica, tokens, pages)`, built as
    `ModelRunner._dispatch` builds them, for a sub-batch of padding rows (as in warmup)."""
    empty = empty_sub_batch(rows * runner.num_replicas, tokens, pages)
    replicas = np.repeat(np.arange(runner.num_replicas, dtype=np.int32), rows)
    plan = dataclasses.replace(empty, replicas=replicas)
    shape = runner.padded_shape(plan)
    assert shape == (rows, tokens, pages), f"{(rows, tokens, pages)} is not a bucket: {shape}"
    index = runner.row_index(plan, shape[0])
    total = shape[0] * runner.num_replicas
    sharding = None if runner.layout is None else runner.layout.rows
    batch = pad_sub_batch(plan, (total, *shape[1:]), index=index, sharding=sharding)
    sampling = runner._device_sampling(greedy_sampling(plan.num_rows), total, shape[2], index,
                                       sharding)
    return runner.params, runner.cache, (batch,), (sampling,)


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    opcode: str  # async pairs read as their collective: "all-reduce-start" -> "all-reduce"
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, dims) of each result (tuples)
    operands: tuple[str, ...]
    called: tuple[str, ...]  # computations this op calls (loop body, branches, reducers, ...)
    text: str


@dataclasses.dataclass(frozen=True)
class Hlo:
    computations: dict[str, list[Op]]
    entry: str

    @classmethod
    def parse(cls, text: str) -> "Hlo":
        computations: dict[str, list[Op]] = {}
        entry, current = None, None
        for line in text.splitlines():
            header = re.match(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$", line)
            if header:
                current = header.group(2)
                computations[current] = []
                if header.group(1):
                    entry = current
            elif line.startswith("}"):
                current = None
            elif current is not None and (op := _parse_op(line)) is not None:
                computations[current].append(op)
        assert entry is not None, "no ENTRY computation in the HLO"
        return cls(computations, entry)

    def reachable(self, root: str) -> set[str]:
        """`root` and every computation it calls, transitively."""
        seen, todo = set(), [root]
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo.extend(c for op in self.computations[name] for c in op.called)
        return seen

    def ops(self, opcode: str, within: set[str] | None = None) -> list[Op]:
        names = self.computations if within is None else within
        return [op for name in names for op in self.computations[name] if op.opcode == opcode]

    def collectives(self, within: set[str] | None = None) -> list[Op]:
        return [op for c in COLLECTIVES for op in self.ops(c, within)]

    def loop_carrying(self, shape: tuple[int, ...]) -> Op:
        """The one while loop whose state holds an array of `shape` (e.g. the KV cache shard)."""
        loops = [op for op in self.ops("while") if any(dims == shape for _, dims in op.shapes)]
        assert len(loops) == 1, f"{len(loops)} while loops carry {shape}"
        return loops[0]

    def body(self, loop: Op) -> set[str]:
        (body,) = re.findall(r"\bbody=%([\w.\-]+)", loop.text)
        return self.reachable(body)

    def trip_count(self, loop: Op) -> int:
        (count,) = re.findall(r'"known_trip_count":\{"n":"(\d+)"\}', loop.text)
        return int(count)

    def parameter_shapes(self) -> set[tuple[int, ...]]:
        return {dims for op in self.computations[self.entry] if op.opcode == "parameter"
                for _, dims in op.shapes}


def replica_groups(op: Op, num_devices: int) -> list[list[int]]:
    """The device groups of a collective, from any of the three ways HLO writes them:
    `{{0,1},{2,3}}`, the iota form `[2,2]<=[4]` (optionally `<=[a,b]T(1,0)`), and the mesh form
    `mesh['axis_0'=2,'axis_1'=2] {'axis_1'}` (mesh axes in order, device ids in row-major order)."""
    text = op.text
    explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", text)
    if explicit:
        return [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}",
                                                                        explicit.group(1))]
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if iota:
        shape = [int(d) for d in iota.group(1).split(",")]
        ids = np.arange(num_devices).reshape([int(d) for d in iota.group(2).split(",")])
        if iota.group(3):
            ids = ids.transpose([int(d) for d in iota.group(3).split(",")])
        return ids.reshape(shape).tolist()
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", text)
    assert mesh, f"replica groups not understood: {text[:300]}"
    axes = re.findall(r"'(\w+)'=(\d+)", mesh.group(1))
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    grouped = [names.index(a) for a in re.findall(r"'(\w+)'", mesh.group(2))]
    assert int(np.prod(sizes)) == num_devices, text[:300]
    ids = np.arange(num_devices).reshape(sizes)
    rest = [i for i in range(len(sizes)) if i not in grouped]
    ids = ids.transpose(rest + grouped)
    return ids.reshape(-1, int(np.prod([sizes[i] for i in grouped]))).tolist()


def source_target_pairs(op: Op) -> list[tuple[int, int]]:
    """The (source, target) devices of a collective-permute."""
    (pairs,) = re.findall(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", op.text)
    return [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs)]


def _parse_op(line: str) -> Op | None:
    m = re.match(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*", line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):  # a tuple type: up to its closing parenthesis
        end = _closing(rest, 0)
        type_text, rest = rest[:end + 1], rest[end + 1:].lstrip()
    else:
        type_text, _, rest = rest.partition(" ")
    opcode_match = re.match(r"([\w\-]+)\(", rest)
    if not opcode_match:
        return None
    opcode = opcode_match.group(1)
    args_end = _closing(rest, opcode_match.end() - 1)
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[opcode_match.end():args_end]))
    attrs = rest[args_end:]
    called = re.findall(r"\b(?:body|condition|to_apply|calls|true_computation|"
                        r"false_computation)=%([\w.\-]+)", attrs)
    for group in re.findall(r"branch_computations=\{([^}]*)\}", attrs):
        called += re.findall(r"%([\w.\-]+)", group)
    shapes = tuple((dtype, tuple(int(d) for d in dims.split(",") if d))
                   for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", type_text))
    if opcode.endswith("-start") and opcode[:-len("-start")] in COLLECTIVES:
        opcode = opcode[:-len("-start")]
    return Op(name=m.group(1), opcode=opcode, shapes=shapes, operands=operands,
              called=tuple(called), text=line)


def _closing(text: str, start: int) -> int:
    """Index of the parenthesis closing the one at `text[start]`."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise ValueError(f"unbalanced parentheses in {text[:200]!r}")
