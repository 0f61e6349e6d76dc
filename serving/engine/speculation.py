"""The engine's speculator, built from its config: prompt lookup on the host, or a draft model
loaded here and run by a runner of its own (`meshserve.model.executor.draft_proposer`).

A draft model is any model meshserve loads (a known name, a GGUF file, an HF or checkpoint
directory, a preset), with the target's vocabulary; a quantized copy of the target is a legal
draft. It is loaded in float32 with the engine's quantization, onto one device, and refused by
name where it cannot serve: another vocabulary, a shorter context than `max_model_len`, a
sliding window (its pages would be freed behind the target's window, not its own), a mesh of
more than one device (`EngineConfig` refuses that before anything loads).
"""

from __future__ import annotations

from meshserve.batching.speculative import Speculator
from meshserve.model.executor.draft_proposer import DraftModelProposer
from meshserve.model.executor.runner import ModelRunner
from meshserve.model.loading.pretrained import load_pretrained
from meshserve.model.transformer import for_context


def make_speculator(config, runner) -> Speculator | None:
    """The speculator of `config` (a settled `EngineConfig`) for an engine on `runner`; None
    without a `speculative_config`."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method != "draft_model":
        return Speculator(spec)
    return Speculator(spec, DraftModelProposer(_draft_runner(spec.model, config, runner)))


def _draft_runner(name: str, config, runner) -> ModelRunner:
    target = runner.model_config
    draft = load_pretrained(name, quantization=config.quantization,
                            native_kernels=bool(getattr(runner, "native_kernels", False))).model
    problem = _mismatch(draft.config, target, config.max_model_len)
    if problem:
        raise ValueError(f"speculative_config.model {name!r} cannot draft for "
                         f"{target.name}: {problem}")
    return ModelRunner(for_context(draft, config.max_model_len), runner.config)


def _mismatch(draft, target, max_model_len: int) -> str | None:
    if draft.vocab_size != target.vocab_size:
        return (f"its vocabulary has {draft.vocab_size} tokens, the target's "
                f"{target.vocab_size}")
    if draft.max_position_embeddings < max_model_len:
        return (f"its context ({draft.max_position_embeddings}) is shorter than max_model_len "
                f"({max_model_len})")
    if draft.attention_window or any(draft.sliding_layers):
        return "it has a sliding window"
    return None
