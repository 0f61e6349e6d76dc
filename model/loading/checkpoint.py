"""Sharded orbax checkpoints of a model, its config and its tokenizer, in one directory.

Layout of a checkpoint directory DIR:

    DIR/meshserve.json          manifest: format name and version, model name, dtype, every
                                weight's canonical path and shape, and the format of each
                                quantized kernel (its arrays are stored under the kernel's path:
                                `.../kernel/values`, `/scales`, `/mins`, `/super_scales`,
                                `/super_mins`; a mixed stack's per part,
                                `.../kernel/parts/0/values`, with which layers each part
                                holds); written last
    DIR/model_config.json       every `ModelConfig` field (`config_to_json`)
    DIR/params/                 orbax `StandardCheckpointer` data: a flat {canonical path: array}
    DIR/tokenizer.json          only when the model has a tokenizer: the `tokenizers` backend,
    DIR/tokenizer_config.json   and its special tokens (exact ids) and chat template

Saving writes into a sibling staging directory and renames it into place, so DIR is either the
complete new checkpoint or untouched (an interrupted save leaves no manifest in DIR). Weights are
saved from the model's own arrays, shard by shard, without gathering them.

Restoring checks the directory against the expected config before reading any weight: every
failure is a `ValueError` naming the directory and what is wrong. The weights are restored
straight into the target shardings, one per canonical path, on any mesh: orbax reads only the
part of each array that a device holds, so no device ever holds a full copy it does not need.
A dtype different from the saved one is applied by the cast during the read; quantized kernels
keep their stored dtypes (codes, scales).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from tokenizers import Tokenizer as BackendTokenizer

from meshserve.model.config import DTYPES, ModelConfig, MoeConfig, RopeScaling
from meshserve.model.quant_formats import LayerMix, QuantFormat, format_from_json
from meshserve.model.quantized_weights import grouped_params, quantized_arrays, stored_weights
from meshserve.model.tokenizer import SpecialTokens, Tokenizer
from meshserve.model.transformer import abstract_model, model_from_params

FORMAT = "meshserve-checkpoint"
VERSION = 1
MANIFEST = "meshserve.json"
CONFIG_FILE = "model_config.json"
PARAMS_DIR = "params"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manifest:
    """What a checkpoint holds. `params` maps every stored array's path to its shape, all at
    `dtype` except the arrays of the kernels in `quantized` (kernel path -> its format)."""

    model: str
    dtype: str
    params: Mapping[str, tuple[int, ...]]
    has_tokenizer: bool
    quantized: Mapping[str, QuantFormat | LayerMix] = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        """Pretty JSON with one line per weight."""
        head = json.dumps({"format": FORMAT, "version": VERSION, "model": self.model,
                           "dtype": self.dtype, "has_tokenizer": self.has_tokenizer,
                           "quantized": {k: f.to_json() for k, f in self.quantized.items()}},
                          indent=2)
        params = ",\n".join(f"    {json.dumps(path)}: {json.dumps(list(shape))}"
                             for path, shape in self.params.items())
        return f'{head[:-2]},\n  "params": {{\n{params}\n  }}\n}}\n'


# -- config as JSON ------------------------------------------------------------------------------

def config_to_json(config: ModelConfig) -> str:
    """Every field of `config`, nested `RopeScaling` and `MoeConfig` included; `config_from_json`
    inverts it."""
    return json.dumps(dataclasses.asdict(config), indent=2)


def config_from_json(text: str) -> ModelConfig:
    """The `ModelConfig` that `config_to_json` wrote. Unknown fields, and missing fields that
    have no default, are refused. A field added since the file was written (the family
    switches, `moe`, LongRoPE's factors) takes its default, Llama's behaviour, so checkpoints
    saved before it existed still load as what they were."""
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("a model config must be a JSON object")
    _check_fields(ModelConfig, data, "model config")
    scaling = data.get("rope_scaling", {})
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be an object of RopeScaling fields, got {scaling!r}")
    _check_fields(RopeScaling, scaling, "rope_scaling")
    moe = data.get("moe")
    if moe is not None:
        if not isinstance(moe, dict):
            raise ValueError(f"moe must be null or an object of MoeConfig fields, got {moe!r}")
        _check_fields(MoeConfig, moe, "moe")
    try:
        scaling = RopeScaling(**_tuples(scaling))
        return ModelConfig(**(_tuples(data) | {"rope_scaling": scaling,
                                               "moe": None if moe is None else MoeConfig(**moe)}))
    except TypeError as err:
        raise ValueError(f"a model config field has the wrong type: {err}") from None


def _check_fields(cls: type, data: Mapping[str, Any], what: str) -> None:
    """Refuses fields `cls` does not have, and missing ones that have no default."""
    fields = dataclasses.fields(cls)
    required = {f.name for f in fields if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING}
    unknown = sorted(set(data) - {f.name for f in fields})
    missing = sorted(required - set(data))
    if unknown or missing:
        raise ValueError(f"{what} fields do not match {cls.__name__}: unknown {unknown}, "
                         f"missing {missing}")


def _tuples(fields: dict) -> dict:
    """JSON's lists back as the tuples the frozen configs hold."""
    return {key: tuple(value) if isinstance(value, list) else value
            for key, value in fields.items()}


# -- saving --------------------------------------------------------------------------------------

def check_destination(directory: str | os.PathLike, *, force: bool = False) -> Path:
    """The absolute path to save to; fails if it is a file, or a non-empty directory unless `force`."""
    path = Path(directory).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"cannot write a checkpoint to {path}: it is a file, not a directory")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise ValueError(f"{path} is not empty; refusing to overwrite it (pass force=True, or "
                         "--force on the command line, to replace it)")
    return path


def model_params(model: nnx.Module) -> dict[str, jax.Array]:
    """Canonical path -> the model's own array (no copy, sharding kept)."""
    _, state = nnx.split(model)
    return {"/".join(map(str, path)): var.get_value() for path, var in nnx.to_flat_state(state)}


def save_checkpoint(model: nnx.Module, tokenizer: Tokenizer | None, directory: str | os.PathLike,
                    *, force: bool = False) -> Path:
    """Writes `model` (and `tokenizer`, if any) as a checkpoint directory; returns its path.

    A non-empty `directory` is replaced only with `force`, and only once the new checkpoint is
    complete.
    """
    path = check_destination(directory, force=force)
    config: ModelConfig = model.config
    params = model_params(model)
    quantized = {key: q.format for key, q in quantized_arrays(model).items()}
    wrong_dtype = sorted(k for k, v in params.items() if v.dtype != jnp.dtype(config.dtype)
                         and not any(k.startswith(f"{q}/") for q in quantized))
    if wrong_dtype:
        raise ValueError(f"model {config.name} has dtype {config.dtype}, but these weights are "
                         f"not: {wrong_dtype[:5]}")
    manifest = Manifest(model=config.name, dtype=config.dtype,
                        params={k: tuple(v.shape) for k, v in params.items()},
                        has_tokenizer=tokenizer is not None, quantized=quantized)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.partial-"))
    staging.chmod(0o755)  # mkdtemp's 0o700 would become the checkpoint's mode
    try:
        with _checkpointer() as checkpointer:
            checkpointer.save(staging / PARAMS_DIR, params)
            checkpointer.wait_until_finished()
        (staging / CONFIG_FILE).write_text(config_to_json(config), encoding="utf-8")
        if tokenizer is not None:
            write_tokenizer(tokenizer, staging)
        (staging / MANIFEST).write_text(manifest.to_json(), encoding="utf-8")
        _replace_directory(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def write_tokenizer(tokenizer: Tokenizer, directory: Path) -> None:
    """`tokenizer.json` and a `tokenizer_config.json` that holds the exact special ids.

    The HF keys (`bos_token`, `eos_token`, `pad_token`, `chat_template`) let
    `Tokenizer.from_file` read the pair too; `read_tokenizer` restores the ids as they were.
    """
    # Tokenizer exposes no serialisation of its backend; the backend's JSON is the tokenizer.
    (directory / TOKENIZER_FILE).write_text(tokenizer._backend.to_str(), encoding="utf-8")
    token = lambda i: None if i is None else tokenizer.id_to_token(i)  # noqa: E731
    eos = tokenizer.eos_token_ids
    tokenizer_config = {
        "bos_token": token(tokenizer.bos_token_id),
        "eos_token": token(eos[0]) if eos else None,
        "pad_token": token(tokenizer.pad_token_id),
        "chat_template": tokenizer.chat_template,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_ids": list(eos),
        "pad_token_id": tokenizer.pad_token_id,
        "space_prefix": tokenizer.space_prefix,
    }
    (directory / TOKENIZER_CONFIG_FILE).write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False), encoding="utf-8")


def _replace_directory(staging: Path, path: Path) -> None:
    """Renames `staging` to `path`; an existing `path` is moved aside first, then deleted."""
    if not path.exists():
        staging.rename(path)
        return
    aside = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.old-"))
    path.rename(aside / path.name)
    staging.rename(path)
    shutil.rmtree(aside)


# -- reading -------------------------------------------------------------------------------------

def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` is a directory with a meshserve checkpoint manifest."""
    manifest = Path(path) / MANIFEST
    if not manifest.is_file():
        return False
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """The manifest of a checkpoint directory, after checking that it is one."""
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"no checkpoint at {path}: the directory does not exist")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise ValueError(f"{path} is not a meshserve checkpoint: it has no {MANIFEST} "
                         "(write one with `meshserve convert`)")
    try:
        data = json.loads(manifest_path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ValueError(f"checkpoint {path}: {MANIFEST} is not valid JSON ({err})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a meshserve checkpoint: {MANIFEST} does not declare "
                         f"format {FORMAT!r}")
    if data.get("version") != VERSION:
        raise ValueError(f"checkpoint {path} has format version {data.get('version')!r}; this "
                         f"meshserve reads version {VERSION}")
    try:
        return Manifest(model=str(data["model"]), dtype=str(data["dtype"]),
                        params={k: tuple(v) for k, v in data["params"].items()},
                        has_tokenizer=bool(data["has_tokenizer"]),
                        quantized={k: format_from_json(f)
                                   for k, f in data.get("quantized", {}).items()})
    except (KeyError, TypeError, AttributeError, AssertionError) as err:
        raise ValueError(f"checkpoint {path}: {MANIFEST} is malformed ({err!r})") from None


def read_checkpoint_config(directory: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` a checkpoint was saved with (its saved dtype included)."""
    path = Path(directory)
    read_manifest(path)
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"checkpoint {path} is incomplete: {CONFIG_FILE} is missing")
    try:
        return config_from_json(config_path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ValueError(f"checkpoint {path}: {CONFIG_FILE} is not a valid model config: "
                         f"{err}") from None


def check_compatible(directory: str | os.PathLike, config: ModelConfig) -> None:
    """Fails unless the checkpoint holds the model `config` describes (any dtype).

    The saved config must equal `config` in every field but `dtype`, and the manifest must list
    exactly the weights of that model, with its shapes.
    """
    path = Path(directory)
    saved = read_checkpoint_config(path)
    differ = [f.name for f in dataclasses.fields(ModelConfig)
              if f.name != "dtype" and getattr(saved, f.name) != getattr(config, f.name)]
    if differ:
        details = ", ".join(f"{name} {getattr(saved, name)!r} (expected "
                            f"{getattr(config, name)!r})" for name in differ)
        raise ValueError(f"checkpoint {path} holds another model: {details}")
    manifest = read_manifest(path)
    expected = {k: shape for k, (_, shape, _) in
                stored_weights(abstract_model(config), manifest.quantized).items()}
    listed = manifest.params
    missing, unexpected = sorted(set(expected) - set(listed)), sorted(set(listed) - set(expected))
    wrong = sorted(k for k in set(expected) & set(listed) if listed[k] != expected[k])
    if missing or unexpected or wrong:
        shapes = [f"{k} {listed[k]} (expected {expected[k]})" for k in wrong[:5]]
        raise ValueError(f"checkpoint {path} holds another model than {config.name}: its "
                         f"{MANIFEST} lacks {missing[:5]}, adds {unexpected[:5]}, has shapes "
                         f"{shapes}")


def restore_params(directory: str | os.PathLike, config: ModelConfig,
                   shardings: Mapping[str, jax.sharding.Sharding] | None, *,
                   dtype: str | None = None) -> dict[str, jax.Array]:
    """Canonical path -> array, each placed with `shardings[path]` (None: the default device).

    Arrays come back at `dtype`, else `config.dtype`, cast from the saved dtype if they differ;
    those of quantized kernels at their stored dtypes. The checkpoint must hold the model
    `config` describes (`check_compatible`).
    """
    path = Path(directory)
    target_dtype = dtype or config.dtype
    if target_dtype not in DTYPES:
        raise ValueError(f"dtype {target_dtype!r} is not supported; use one of {DTYPES}")
    check_compatible(path, config)
    manifest = read_manifest(path)
    shapes = manifest.params
    _require_orbax_data(path, shapes)
    placement = _placement(shardings, shapes)
    stored = stored_weights(abstract_model(config), manifest.quantized)
    target = {k: jax.ShapeDtypeStruct(shape, jnp.dtype(stored[k][2] or target_dtype),
                                      sharding=placement[k])
              for k, shape in shapes.items()}
    with _checkpointer() as checkpointer:
        try:
            return checkpointer.restore((path / PARAMS_DIR).absolute(), target)
        except Exception as err:  # orbax and tensorstore raise bare Exceptions on bad data
            raise ValueError(f"checkpoint {path}: its orbax data in {PARAMS_DIR}/ cannot be "
                             f"read: {str(err)[:300]}") from err


def read_tokenizer(directory: str | os.PathLike) -> Tokenizer | None:
    """The checkpoint's tokenizer, with the special ids it was saved with; None if it has none."""
    path = Path(directory)
    if not read_manifest(path).has_tokenizer:
        return None
    missing = [n for n in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE) if not (path / n).is_file()]
    if missing:
        raise ValueError(f"checkpoint {path} is incomplete: its manifest lists a tokenizer, "
                         f"but {missing} are missing")
    saved = json.loads((path / TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8"))
    try:
        special = SpecialTokens(bos_token_id=saved["bos_token_id"],
                                eos_token_ids=tuple(saved["eos_token_ids"]),
                                pad_token_id=saved["pad_token_id"])
    except KeyError as err:
        raise ValueError(f"checkpoint {path}: {TOKENIZER_CONFIG_FILE} lacks {err}") from None
    backend = BackendTokenizer.from_file(str(path / TOKENIZER_FILE))
    return Tokenizer(backend, special=special, chat_template=saved.get("chat_template"),
                     space_prefix=bool(saved.get("space_prefix", False)))


def load_checkpoint(directory: str | os.PathLike, *, dtype: str | None = None,
                    shardings: Mapping[str, jax.sharding.Sharding] | None = None
                    ) -> tuple[ModelConfig, nnx.Module, Tokenizer | None]:
    """(config, model, tokenizer) from a checkpoint; `dtype` (default: the saved one) becomes
    the config's dtype, and `shardings` places the weights as in `restore_params`."""
    config = read_checkpoint_config(directory)
    if dtype is not None:
        config = config.replace(dtype=dtype)
    params = grouped_params(restore_params(directory, config, shardings),
                            read_manifest(directory).quantized)
    return config, model_from_params(config, params), read_tokenizer(directory)


def _checkpointer() -> Any:
    """orbax's `StandardCheckpointer`, imported here: orbax costs ~25 MB of memory, which an
    engine that never reads or writes a checkpoint does not pay."""
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def _require_orbax_data(path: Path, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Fails unless the orbax data holds every weight the manifest lists, at its shape."""
    params_dir = path / PARAMS_DIR
    if not params_dir.is_dir():
        raise ValueError(f"checkpoint {path} is incomplete: its orbax data {PARAMS_DIR}/ is "
                         "missing")
    try:
        with _checkpointer() as checkpointer:
            item = checkpointer.metadata(params_dir.absolute()).item_metadata
    except (OSError, ValueError) as err:
        raise ValueError(f"checkpoint {path} is incomplete: the metadata of {PARAMS_DIR}/ "
                         f"cannot be read ({str(err)[:300]})") from None
    if item is None:
        raise ValueError(f"checkpoint {path} is incomplete: {PARAMS_DIR}/ has no readable "
                         "array metadata")
    stored = dict(item.tree)
    missing = sorted(set(shapes) - set(stored))
    if missing:
        raise ValueError(f"checkpoint {path} is incomplete: {PARAMS_DIR}/ lacks the weights "
                         f"{missing[:5]}" + (f" and {len(missing) - 5} more" if len(missing) > 5
                                             else ""))
    wrong = [f"{k} {tuple(stored[k].shape)} (manifest {shapes[k]})" for k in sorted(shapes)
             if tuple(stored[k].shape) != tuple(shapes[k])]
    if wrong:
        raise ValueError(f"checkpoint {path}: {PARAMS_DIR}/ disagrees with {MANIFEST} on "
                         f"shapes: {wrong[:5]}")


def _placement(shardings: Mapping[str, jax.sharding.Sharding] | None,
               shapes: Mapping[str, Any]) -> dict[str, jax.sharding.Sharding]:
    """One sharding per weight: `shardings` must name exactly the weights."""
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return dict.fromkeys(shapes, device)
    missing = sorted(set(shapes) - set(shardings))
    unexpected = sorted(set(shardings) - set(shapes))
    if missing or unexpected:
        raise ValueError(f"shardings must name every weight exactly once: missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}")
    return dict(shardings)
