"""The package layout: import direction, the jax-free host side, and a plain install."""

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
# Which meshserve packages each package may import. batching is host-only: no jax, no model.
ALLOWED = {
    "batching": {"batching"},
    "sharding": {"sharding", "model", "batching"},
    "model": {"model", "batching"},
    "serving": {"serving", "model", "sharding", "batching"},
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_follow_the_package_direction(package):
    for path in (ROOT / package).rglob("*.py"):
        for name in _imports(path):
            if name.startswith("meshserve."):
                target = name.split(".")[1]
                assert target in ALLOWED[package], f"{path} imports {name}"


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
    for package in ALLOWED:
        sources = {f"meshserve/{package}/{p.relative_to(ROOT / package)}"
                   for p in (ROOT / package).rglob("*.py")
                   if p.parent.name != "root"}
        assert sources <= names, sorted(sources - names)[:3]
