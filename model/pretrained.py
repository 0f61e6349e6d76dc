"""One call from a model name or path to a ready model and its tokenizer.

`load_pretrained` accepts:
- a known name (`smollm2-135m-instruct`), fetched once into the cache;
- a local `.gguf` file, or an HF directory (`config.json` + safetensors);
- a meshserve checkpoint directory (`meshserve convert`), restored with its tokenizer;
- a preset name (`tiny-llama`, `llama-2-7b`, ...), which gives random weights and no tokenizer,
  for tests, benchmarks and planning.

`quantization` (`meshserve.model.quantization.SCHEMES`) is what float kernels become: quantized
as they load (GGUF blocks that fit are kept as they are); kernels a checkpoint already holds
quantized stay so whatever it says.
"""

from __future__ import annotations

import dataclasses
import os

from flax import nnx

from meshserve.model.checkpoint import load_checkpoint
from meshserve.model.config import PRESETS, ModelConfig
from meshserve.model.hub import ModelFiles, resolve_model
from meshserve.model.loaders import load_weights
from meshserve.model.quant import quantize_model, scheme_plans
from meshserve.model.tokenizer import Tokenizer
from meshserve.model.transformer import create_model, model_from_params


@dataclasses.dataclass(frozen=True)
class Pretrained:
    config: ModelConfig
    model: nnx.Module
    tokenizer: Tokenizer | None


def load_pretrained(name_or_path: str, *, dtype: str = "float32", seed: int = 0,
                    cache_dir: str | os.PathLike | None = None,
                    quantization: str = "none") -> Pretrained:
    plans = scheme_plans(quantization)
    if name_or_path in PRESETS:
        config = ModelConfig.preset(name_or_path, dtype=dtype)
        model = quantize_model(create_model(config, seed=seed), quantization)
        return Pretrained(config=config, model=model, tokenizer=None)
    files = resolve_model(name_or_path, cache_dir=cache_dir)
    if files.kind == "orbax":
        config, model, tokenizer = load_checkpoint(files.path, dtype=dtype)
        return Pretrained(config=config, model=quantize_model(model, quantization),
                          tokenizer=tokenizer)
    config, params = load_weights(files, dtype=dtype, plans=plans)
    return Pretrained(config=config, model=model_from_params(config, params),
                      tokenizer=load_tokenizer(files))


def load_tokenizer(files: ModelFiles) -> Tokenizer | None:
    if files.kind == "gguf":
        return Tokenizer.from_gguf(files.path)
    if files.tokenizer_path is not None:
        return Tokenizer.from_file(files.tokenizer_path)
    return None
