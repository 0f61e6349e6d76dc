"""Reading the partitioned HLO of a compiled program: its computations, ops and collectives.

`Hlo.parse(compiled.as_text())` turns the text XLA prints after SPMD partitioning into
computations of `Op`s. Async collective pairs read as their collective ("all-reduce-start" ->
"all-reduce"), so a program reads the same whichever form the backend chose.

`executed_collectives` counts what one run of a program executes, per kind, with the bytes of
the results (what each device holds after the collective). A collective whose every group is one
device (a vote over a mesh axis of size 1) moves nothing and is not counted. Within a program:

    a while loop   its body times the trip count XLA knows (`known_trip_count`); a loop whose
                   count is only known at run time (a pipeline's tick loop) counts the trip count
                   the caller passes, else once
    a conditional  its busiest branch (the most collectives): the sampler's greedy and sampling
                   paths, a pipeline stage's idle, decode and prefill branches
    any other call once (fusions and reducers hold no collectives)

Tests and `meshserve mesh-sweep` both read programs through this module. Plain Python and numpy.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    opcode: str  # async pairs read as their collective: "all-reduce-start" -> "all-reduce"
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, dims) of each result (tuples)
    operands: tuple[str, ...]
    called: tuple[str, ...]  # computations this op calls (loop body, branches, reducers, ...)
    text: str
    is_async_start: bool = False  # an "-start" op: its result may hold inputs and flags too

    @property
    def result_bytes(self) -> int:
        """Bytes of the op's results on one device. An async start other than all-reduce's
        returns (input, output, sync flags): its output is the largest array there."""
        sizes = [DTYPE_BYTES.get(dtype, 4) * int(np.prod(dims, dtype=np.int64))
                 for dtype, dims in self.shapes]
        if self.is_async_start and self.opcode != "all-reduce":
            return max(sizes, default=0)
        return sum(sizes)


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
        """The one outermost while loop whose state holds an array of `shape` (e.g. the KV cache
        shard, which the layer scan carries, and the attention's own loops inside it too)."""
        loops = [op for op in self.ops("while") if any(dims == shape for _, dims in op.shapes)]
        inner = set().union(*(self.body(loop) for loop in loops))
        outer = [loop for loop in loops
                 if not any(loop in self.computations[name] for name in inner)]
        assert len(outer) == 1, f"{len(outer)} outermost while loops carry {shape}"
        return outer[0]

    def body(self, loop: Op) -> set[str]:
        (body,) = re.findall(r"\bbody=%([\w.\-]+)", loop.text)
        return self.reachable(body)

    def trip_count(self, loop: Op) -> int:
        (count,) = re.findall(r'"known_trip_count":\{"n":"(\d+)"\}', loop.text)
        return int(count)

    def parameter_shapes(self) -> set[tuple[int, ...]]:
        return {dims for op in self.computations[self.entry] if op.opcode == "parameter"
                for _, dims in op.shapes}


@dataclasses.dataclass(frozen=True)
class CollectiveTally:
    """Collectives of one kind: how many ops, and the bytes of their results per device."""

    count: int = 0
    bytes: int = 0

    def __add__(self, other: "CollectiveTally") -> "CollectiveTally":
        return CollectiveTally(self.count + other.count, self.bytes + other.bytes)

    def times(self, n: int) -> "CollectiveTally":
        return CollectiveTally(self.count * n, self.bytes * n)


Tallies = dict[str, CollectiveTally]  # collective kind -> tally, every kind present


def moves_data(op: Op, num_devices: int) -> bool:
    """Whether a collective sends anything between devices: some group has two or more."""
    if op.opcode == "collective-permute":
        return any(a != b for a, b in source_target_pairs(op))
    groups = replica_groups(op, num_devices)
    return any(len(g) > 1 for g in groups) if groups else num_devices > 1


def static_collectives(hlo: Hlo, num_devices: int) -> Tallies:
    """The collective ops written in the program that move data, each counted once."""
    return {kind: _tally([op for op in hlo.ops(kind) if moves_data(op, num_devices)])
            for kind in COLLECTIVES}


def executed_collectives(hlo: Hlo, num_devices: int, *, unknown_trips: int = 1) -> Tallies:
    """What one run of the program on `num_devices` executes (see the module docstring);
    `unknown_trips` is the trip count of a loop whose count XLA does not know."""

    @functools.cache
    def run(name: str) -> tuple[tuple[str, CollectiveTally], ...]:
        total = _zero()
        for op in hlo.computations[name]:
            for kind, tally in _op_tallies(op).items():
                total[kind] += tally
        return tuple(total.items())

    def _op_tallies(op: Op) -> Tallies:
        if op.opcode in COLLECTIVES:
            moved = moves_data(op, num_devices)
            return {op.opcode: CollectiveTally(1, op.result_bytes) if moved else CollectiveTally()}
        if op.opcode == "while":
            (body,) = re.findall(r"\bbody=%([\w.\-]+)", op.text)
            trips = re.findall(r'"known_trip_count":\{"n":"(\d+)"\}', op.text)
            n = int(trips[0]) if trips else unknown_trips
            return {kind: t.times(n) for kind, t in run(body)}
        if op.opcode == "conditional":
            branches = [dict(run(c)) for c in op.called]
            return max(branches, key=lambda b: sum(t.count for t in b.values()), default={})
        total = _zero()
        for called in op.called:
            for kind, tally in run(called):
                total[kind] += tally
        return total

    return dict(run(hlo.entry))


def add_tallies(*tallies: Tallies) -> Tallies:
    total = _zero()
    for t in tallies:
        for kind, tally in t.items():
            total[kind] += tally
    return total


def _zero() -> Tallies:
    return {kind: CollectiveTally() for kind in COLLECTIVES}


def _tally(ops: list[Op]) -> CollectiveTally:
    return CollectiveTally(len(ops), sum(op.result_bytes for op in ops))


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
    is_async_start = opcode.endswith("-start") and opcode[:-len("-start")] in COLLECTIVES
    if is_async_start:
        opcode = opcode[:-len("-start")]
    return Op(name=m.group(1), opcode=opcode, shapes=shapes, operands=operands,
              called=tuple(called), text=line, is_async_start=is_async_start)


def _closing(text: str, start: int) -> int:
    """Index of the parenthesis closing the one at `text[start]`."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise ValueError(f"unbalanced parentheses in {text[:200]!r}")
