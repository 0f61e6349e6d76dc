"""`meshserve.serving.bench.peers`: optional peers run when installed and are skipped cleanly if
not. The missing-library branch runs everywhere, with the peer's modules hidden from import
(`hide_modules`), whether or not they are installed; the installed branch needs the extras and
skips without them, except HF's: torch, transformers and accelerate are in the `[test]` extra, so
its tests run under `make test` and fail where they are missing."""

import importlib
import importlib.util
import json
import os
import sys

import pytest

from meshserve.serving.bench.workloads import BenchRequest
from meshserve.serving.bench.peers import PEERS, LlamaCppCrashed, PeerUnavailable, run_peer

MODULES = {"hf": ("torch", "transformers"), "llama-cpp": ("llama_cpp",)}
EXTRAS = {"hf": "peers-hf", "llama-cpp": "peers-llama-cpp"}
REQUESTS = [BenchRequest(prompt_token_ids=[1, 2, 3, 4, 5, 6, 7, 8], num_output_tokens=3),
            BenchRequest(prompt_token_ids=[9, 10, 11, 12], num_output_tokens=5)]


def installed(peer: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in MODULES[peer])


def hide_modules(monkeypatch, *names: str) -> None:
    """Makes `import name` fail as if the module were not installed, for one test (a None in
    sys.modules stops the import system, installed or not, loaded before or not)."""
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.fixture
def fake_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(64))
    return path


def test_an_unknown_peer_names_the_known_ones():
    with pytest.raises(ValueError, match="hf, llama-cpp"):
        run_peer("vllm", "tiny-llama", REQUESTS)


@pytest.mark.parametrize("peer", PEERS)
def test_a_missing_library_says_what_to_install(peer, fake_gguf, monkeypatch):
    hide_modules(monkeypatch, *MODULES[peer])
    hint = rf"{MODULES[peer][0]} is not installed.*pip install 'meshserve\[{EXTRAS[peer]}\]'"
    with pytest.raises(PeerUnavailable, match=hint):
        run_peer(peer, str(fake_gguf), REQUESTS)


@pytest.mark.parametrize("peer", PEERS)
def test_a_random_weight_preset_is_unavailable(peer):
    with pytest.raises(PeerUnavailable, match="random-weight preset"):
        run_peer(peer, "tiny-llama", REQUESTS)


@pytest.mark.parametrize("peer", PEERS)
def test_a_missing_model_is_unavailable(peer, tmp_path):
    with pytest.raises(PeerUnavailable, match="cannot find the model"):
        run_peer(peer, str(tmp_path / "absent.gguf"), REQUESTS)


# Stands in for llama-cpp-python as built with AMX on a CPU where that crashes: it imports and
# loads, and its first decode kills the process with SIGSEGV.
CRASHING_LLAMA_CPP = """import os, signal
__version__ = "0.3.36"
def llama_print_system_info():
    return b"CPU : AVX512 = 1 | AMX_INT8 = 1 |"
class Llama:
    def __init__(self, model_path, **kwargs):
        self.n_threads = kwargs.get("n_threads") or 1
    def reset(self):
        pass
    def eval(self, tokens):
        os.kill(os.getpid(), signal.SIGSEGV)
"""


@pytest.fixture
def crashing_llama_cpp(tmp_path, monkeypatch):
    """`import llama_cpp` finds `CRASHING_LLAMA_CPP`, here and in child processes."""
    package = tmp_path / "site" / "llama_cpp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(CRASHING_LLAMA_CPP)
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(package.parent), os.environ.get("PYTHONPATH")])))
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)


def test_llama_cpp_dying_by_a_signal_is_unavailable_with_the_fix(crashing_llama_cpp, fake_gguf):
    with pytest.raises(LlamaCppCrashed) as raised:
        run_peer("llama-cpp", str(fake_gguf), REQUESTS)
    message = str(raised.value)
    assert "llama-cpp-python 0.3.36 died of SIGSEGV (signal 11)" in message
    assert "AMX_INT8 = 1" in message  # llama.cpp's system info, read before it crashed
    assert "CMAKE_ARGS=\"-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' " in message


def test_bench_records_a_crashing_llama_cpp_as_skipped(crashing_llama_cpp, fake_gguf):
    from meshserve.serving.bench import bench

    results = bench.run_peers(["llama-cpp"], str(fake_gguf), REQUESTS, max_batch_size=2,
                              log=lambda _: None)
    assert results["llama-cpp"]["skipped"].startswith("llama-cpp-python 0.3.36 died of SIGSEGV")


def test_llama_cpp_needs_a_gguf_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(PeerUnavailable, match="needs a GGUF file"):
        run_peer("llama-cpp", str(tmp_path), REQUESTS)


@pytest.mark.parametrize("peer", PEERS)
def test_a_meshserve_checkpoint_is_unavailable(peer, tmp_path):
    (tmp_path / "meshserve.json").write_text("{}")
    with pytest.raises(PeerUnavailable, match="meshserve checkpoint"):
        run_peer(peer, str(tmp_path), REQUESTS)


def test_empty_requests_are_rejected():
    with pytest.raises(ValueError, match="at least one request"):
        run_peer("hf", "tiny-llama", [])


def test_an_installed_hf_peer_runs_a_real_checkpoint(golden_dir):
    """Runs wherever the tests run: torch and transformers are in the `[test]` extra."""
    result = run_peer("hf", str(golden_dir / "tiny-llama"), REQUESTS, max_batch_size=2,
                      threads=1)
    assert result["peer"] == "hf" and result["output_tokens"] == 8 and result["wall_s"] > 0
    assert result["version"] == importlib.import_module("transformers").__version__


@pytest.mark.slow
@pytest.mark.parametrize("peer", PEERS)
def test_an_installed_peer_generates_every_requested_token_on_smollm2(peer):
    if peer != "hf" and not installed(peer):  # hf's libraries are test dependencies
        pytest.skip(f"{peer} is not installed; pip install 'meshserve[{EXTRAS[peer]}]'")
    result = run_peer(peer, "smollm2-135m-instruct", REQUESTS, max_batch_size=2, threads=1)
    assert result["peer"] == peer and result["num_requests"] == 2
    assert result["output_tokens"] == 8 and result["threads"] == 1
    assert result["wall_s"] > 0
    assert result["output_tokens_per_s"] == pytest.approx(8 / result["wall_s"])
    assert result["requests_per_s"] == pytest.approx(2 / result["wall_s"])
    assert isinstance(result["version"], str) and result["version"]
    if peer == "llama-cpp":  # what the library was built with, and its process's peak memory
        assert result["build"]["version"] == result["version"]
        assert "CPU :" in result["build"]["system_info"]
        assert result["peak_rss_bytes"] > 50 * 2**20  # the 98 MB file is mapped and read
    else:  # runs in this process, whose peak holds meshserve's too
        assert result["peak_rss_bytes"] is None
