"""Shared fixtures. Fake CPU devices must be requested before jax is first imported."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()


def _faster_cpu_compiles() -> None:
    """Most of the suite's time is XLA:CPU compiling small programs (tiny models on fake meshes),
    and most of each compile is LLVM code generation for fusions. XLA's older elemental emitters
    generate the same arithmetic about 40% faster, and the real model's steps run no slower with
    them (SmolLM2's greedy parity takes the same 32 s). The flag is read by jaxlib 0.10's XLA (the
    version this was measured on); other versions, or MESHSERVE_TEST_XLA_DEFAULTS=1, keep XLA's
    defaults. Serving and benchmarks never set it."""
    from importlib.metadata import PackageNotFoundError, version

    if os.environ.get("MESHSERVE_TEST_XLA_DEFAULTS") == "1":
        return
    try:
        if not version("jaxlib").startswith("0.10."):
            return
    except PackageNotFoundError:
        return
    if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"


_faster_cpu_compiles()

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

GOLDEN = Path(__file__).parent / "golden"


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    return GOLDEN


@pytest.fixture(scope="session")
def smollm2_files():
    from meshserve.model.loading.hub import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_pretrained(smollm2_files):
    """The real SmolLM2-135M-Instruct (config, model, tokenizer) in float32, loaded once."""
    from meshserve.model.loading.pretrained import load_pretrained

    return load_pretrained(str(smollm2_files.path))


def random_params(config, *, seed: int = 0, scale: float = 0.12) -> dict[str, np.ndarray]:
    """Random weights large enough that logits differ clearly between tokens."""
    from meshserve.model.transformer import abstract_model, param_paths

    rng = np.random.default_rng(seed)
    params = {}
    for key, shape in param_paths(abstract_model(config)).items():
        noise = rng.standard_normal(shape).astype(np.float32)
        is_norm = "norm" in key
        params[key] = 1.0 + 0.1 * noise if is_norm and key.endswith("scale") else scale * noise
    return params


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    """One persistent XLA compilation cache for the session, set before anything compiles: the
    same program (the same tiny model and settings, in test after test) is compiled once and then
    loaded. jax reads the setting when it first compiles, so it must come first; the engines'
    own `compilation_cache` setting cannot turn it on later in a process."""
    import jax

    directory = tmp_path_factory.getbasetemp().parent / "xla-cache"
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return directory
