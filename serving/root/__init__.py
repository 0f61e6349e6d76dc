"""meshserve: LLM inference on JAX/XLA.

The import root. `meshserve.LLM`, `meshserve.AsyncLLM`, `meshserve.SamplingParams`,
`meshserve.LoRARequest`, `meshserve.StructuredOutput` and `meshserve.EngineConfig` are loaded on
first use, so `import meshserve.batching` stays free of jax.
"""

_EXPORTS = {
    "LLM": "meshserve.serving.python_api.llm",
    "AsyncLLM": "meshserve.serving.python_api.async_llm",
    "SamplingParams": "meshserve.batching.sampling",
    "LoRARequest": "meshserve.batching.adapters",
    "StructuredOutput": "meshserve.batching.structured",
    "EngineConfig": "meshserve.serving.engine.engine_config",
    "RequestOutput": "meshserve.serving.engine.outputs",
    "CompletionOutput": "meshserve.serving.engine.outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'meshserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
