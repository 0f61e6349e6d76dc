"""The package layout: import direction, the jax-free host side, and a plain install."""

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
FOLDERS = ("batching", "model", "sharding", "serving")

# The rooms, from the bottom up, and the rooms each may import (besides itself). A room is a
# folder's own files, or one of its sub-packages named here; every import of another room must be
# listed, and each room lists only rooms below it, so no two rooms import each other.
ROOMS = {
    "batching": set(),  # host-side decisions: plain Python and numpy, no jax, no model
    "model": {"batching"},  # the network, its config, weights' formats, the tokenizer
    "model.families": {"model"},  # one file per family: config readers, tensor names
    "model.loading": {"model", "model.families"},  # files (GGUF, HF, orbax, the hub) to a model
    "model.executor": {"model", "batching"},  # the runner, steps, sampler, pipeline executor
    "sharding": {"batching", "model", "model.families", "model.loading", "model.executor"},
    "serving.engine": {"batching", "model", "model.loading", "model.executor", "sharding"},
    "serving.openai_api": {"batching", "model", "serving.engine"},
    "serving.python_api": {"batching", "model", "model.loading", "sharding", "serving.engine",
                           "serving.openai_api"},
    # serving's own files: the api key check the servers share, the command lines' options
    "serving": {"batching", "model", "model.loading", "serving.engine", "serving.python_api"},
    "serving.http_api": {"batching", "model", "serving", "serving.engine", "serving.openai_api"},
    # the gRPC server starts the HTTP port beside it, on the same engine loop, when asked
    "serving.grpc_api": {"batching", "model", "serving", "serving.engine", "serving.http_api"},
    "serving.bench": {"batching", "model", "model.loading", "model.executor", "sharding",
                      "serving", "serving.engine", "serving.python_api", "serving.grpc_api"},
    "serving.cli": {"batching", "model", "model.loading", "serving", "serving.engine",
                    "serving.python_api", "serving.grpc_api", "serving.bench"},
}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[:2] == ["serving", "root"]:
        return "meshserve"  # serving/root is the import root itself
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["meshserve", *parts])


def _sources() -> dict[str, Path]:
    """Every source module by its import name; the generated gRPC stubs are left out."""
    return {_module(path): path for folder in FOLDERS for path in (ROOT / folder).rglob("*.py")
            if "stubs" not in path.parts}


def _room(module: str) -> str:
    parts = module.split(".")[1:3]
    if len(parts) == 2 and ".".join(parts) in ROOMS:
        return ".".join(parts)
    return parts[0] if parts else "meshserve"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _graph() -> dict[str, set[str]]:
    """module -> the meshserve modules it imports, anywhere in it (inside functions too)."""
    sources = _sources()
    return {module: {name for name in _imports(path) if name in sources and name != module}
            for module, path in sources.items()}


def test_each_room_lists_only_rooms_below_it():
    order = list(ROOMS)
    for room, allowed in ROOMS.items():
        assert all(order.index(other) < order.index(room) for other in allowed), room


def test_every_source_file_is_in_a_room():
    for module in _sources():
        assert module == "meshserve" or _room(module) in ROOMS, module


@pytest.mark.parametrize("room", list(ROOMS))
def test_imports_follow_the_room_direction(room):
    for module, targets in _graph().items():
        if module == "meshserve" or _room(module) != room:
            continue
        for target in targets:
            other = _room(target)
            assert other == room or other in ROOMS[room], f"{module} imports {target}"


def test_no_module_imports_itself_round_a_circle():
    """Strongly connected modules, counting imports inside functions: none, so no import inside a
    function is there to dodge a circle."""
    graph, index, low, stack, on_stack, circles = _graph(), {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert circles == []


def test_no_two_modules_share_a_name():
    """A reader who sees a module's name knows which one it is (packages' `__init__` aside)."""
    names = [path.stem for path in _sources().values() if path.stem not in ("__init__", "__main__")]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_every_source_file_is_short_or_says_why_it_is_one_piece():
    for module, path in _sources().items():
        text = path.read_text()
        if text.count("\n") >= 600:
            docstring = ast.get_docstring(ast.parse(text)) or ""
            assert "one file past 600 lines" in docstring, f"{path}: {text.count(chr(10))} lines"


def test_batching_never_imports_jax():
    for path in (ROOT / "batching").rglob("*.py"):
        for name in _imports(path):
            assert name.split(".")[0] not in ("jax", "jaxlib", "flax", "optax"), (path, name)
    code = ("import sys, pkgutil, importlib, meshserve.batching as b\n"
            "for m in pkgutil.walk_packages(b.__path__, 'meshserve.batching.'):\n"
            "    importlib.import_module(m.name)\n"
            "assert 'jax' not in sys.modules, 'jax was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_plain_wheel_holds_every_package(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(ROOT)], check=True)
    (wheel,) = tmp_path.glob("meshserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "meshserve/__init__.py" in names  # the import root, from serving/root
    assert "meshserve/serving/examples/demo_prompts.jsonl" in names
    for package in FOLDERS:
        sources = {f"meshserve/{package}/{p.relative_to(ROOT / package)}"
                   for p in (ROOT / package).rglob("*.py")
                   if p.parent.name != "root"}
        assert sources <= names, sorted(sources - names)[:3]
