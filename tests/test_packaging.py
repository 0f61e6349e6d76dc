"""The build: a wheel builds without a setuptools warning and ships every declared data file; the
offline GPU check puts the model where the hub finds it, or refuses parts that do not make it."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
# What a build reads: the project table, the readme it names, and the package folders.
SOURCES = ("pyproject.toml", "README.md", "batching", "model", "serving", "sharding")
# Files a user of the wheel needs at run time; each must ship whatever the globs say.
REQUIRED = (
    "meshserve/serving/bench/data/json_schemas.json",
    "meshserve/serving/examples/demo_prompts.jsonl",
    "meshserve/serving/grpc_api/proto/meshserve/v1/generation.proto",
)


def _copy_sources(dest: Path) -> Path:
    """A clean copy of the project (no build/ or egg-info left by an earlier build)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)
    return dest


def _declared_data(project: dict) -> set[str]:
    """The wheel paths of the files [tool.setuptools.package-data] selects in the source tree."""
    setup = project["tool"]["setuptools"]
    files = set()
    for key, globs in setup["package-data"].items():
        packages = setup["packages"] if key == "*" else [key]  # "*": every package
        for package in packages:
            folder = ROOT / setup["package-dir"][package]
            for glob in globs:
                for path in folder.glob(glob):
                    rel = path.relative_to(folder).as_posix()
                    files.add(f"{package.replace('.', '/')}/{rel}")
    return files


# Builds a wheel with setuptools' own build hook, recording every warning it raises (pip shows
# a backend's warnings or hides them depending on its version; the hook itself does not vary).
BUILD = """
import json, sys, warnings
import setuptools.build_meta as backend
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    name = backend.build_wheel(sys.argv[1])
print(json.dumps({"wheel": name, "warnings": [
    f"{w.category.__name__}: {str(w.message).splitlines()[0]}" for w in caught]}))
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(the build's warnings, the wheel's file names, its METADATA), built from a clean copy."""
    src = _copy_sources(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("wheel")
    run = subprocess.run([sys.executable, "-c", BUILD, str(out)], cwd=src,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    archive = zipfile.ZipFile(out / result["wheel"])
    metadata = archive.read(f"{result['wheel'].split('-py3')[0]}.dist-info/METADATA").decode()
    return result["warnings"], set(archive.namelist()), metadata


def test_wheel_builds_without_a_warning(built):
    warnings, _, _ = built
    assert not warnings, "\n".join(warnings)


def test_wheel_ships_every_declared_data_file(built):
    _, names, _ = built
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = _declared_data(project)
    assert set(REQUIRED) <= declared, sorted(set(REQUIRED) - declared)
    assert declared <= names, sorted(declared - names)


def test_license_is_an_spdx_expression(built):
    _, _, metadata = built
    assert "License-Expression: Apache-2.0" in metadata.splitlines()


# -- The offline GPU check: the model travels in parts (scripts/gpu_wheels.sh), and
# scripts/gpu_check.sh joins them where meshserve's hub looks before it installs anything.

MODEL = "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"


def _parted(offline: Path, data: bytes, count: int) -> None:
    """`data` laid out as gpu_wheels.sh lays out the model: a folder per part, each with the
    whole file's SHA-256 and its path under the cache."""
    size = -(-len(data) // count)
    for index in range(1, count + 1):
        folder = offline / f"model-{index}"
        folder.mkdir(parents=True)
        name = Path(MODEL).name
        chunk = data[(index - 1) * size:index * size]
        (folder / f"{name}.part-{index}-of-{count}").write_bytes(chunk)
        (folder / f"{name}.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}  {MODEL}\n")


def _gpu_check_install_only(offline: Path, cache: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"MESHSERVE_OFFLINE_DIR": str(offline), "MESHSERVE_CACHE_DIR": str(cache),
                        "PYTHON": sys.executable}
    return subprocess.run(["bash", "scripts/gpu_check.sh", "--install-only"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_gpu_check_joins_the_model_parts_where_the_hub_finds_them(tmp_path):
    from meshserve.model.loading.hub import DEFAULT_MODEL, resolve_model

    data = b"GGUF" + os.urandom(50_001)
    _parted(tmp_path / "offline", data, 3)
    run = _gpu_check_install_only(tmp_path / "offline", tmp_path / "cache")
    # No wheel folder here, so it stops before pip, with the model already in place.
    assert run.returncode == 2 and "no wheel folder" in run.stdout + run.stderr, run.stdout
    assert "joined from 3 parts" in run.stdout
    joined = tmp_path / "cache" / MODEL
    assert joined.read_bytes() == data
    assert resolve_model(DEFAULT_MODEL, cache_dir=tmp_path / "cache").path == joined


@pytest.mark.parametrize("damage", ["a part missing", "a part changed"])
def test_gpu_check_refuses_parts_that_do_not_make_the_model(tmp_path, damage):
    _parted(tmp_path / "offline", b"GGUF" + os.urandom(50_001), 3)
    part = next((tmp_path / "offline" / "model-2").glob("*.part-*"))
    if damage == "a part missing":
        shutil.rmtree(part.parent)
        expected = "part(s) [2] of 3 are not in"
    else:
        part.write_bytes(b"x" + part.read_bytes()[1:])
        expected = "do not have the SHA-256"
    run = _gpu_check_install_only(tmp_path / "offline", tmp_path / "cache")
    assert run.returncode == 1 and expected in run.stdout + run.stderr, run.stdout + run.stderr
    assert not (tmp_path / "cache" / MODEL).exists()
