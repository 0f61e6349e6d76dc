"""`meshserve.serving.bench.peers`: optional peers run when installed and are skipped cleanly if
not. The missing-library branch runs everywhere, with the peer's modules hidden from import
(`hide_modules`), whether or not they are installed; the installed branch needs the extras and
skips without them."""

import importlib
import importlib.util
import json
import sys

import pytest

from meshserve.serving.bench.bench import BenchRequest
from meshserve.serving.bench.peers import PEERS, PeerUnavailable, run_peer

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
    if not installed("hf"):
        pytest.skip("hf is not installed; pip install 'meshserve[peers-hf]'")
    result = run_peer("hf", str(golden_dir / "tiny-llama"), REQUESTS, max_batch_size=2,
                      threads=1)
    assert result["peer"] == "hf" and result["output_tokens"] == 8 and result["wall_s"] > 0
    assert result["version"] == importlib.import_module("transformers").__version__


@pytest.mark.slow
@pytest.mark.parametrize("peer", PEERS)
def test_an_installed_peer_generates_every_requested_token_on_smollm2(peer):
    if not installed(peer):
        pytest.skip(f"{peer} is not installed; pip install 'meshserve[{EXTRAS[peer]}]'")
    result = run_peer(peer, "smollm2-135m-instruct", REQUESTS, max_batch_size=2, threads=1)
    assert result["peer"] == peer and result["num_requests"] == 2
    assert result["output_tokens"] == 8 and result["threads"] == 1
    assert result["wall_s"] > 0
    assert result["output_tokens_per_s"] == pytest.approx(8 / result["wall_s"])
    assert result["requests_per_s"] == pytest.approx(2 / result["wall_s"])
    assert isinstance(result["version"], str) and result["version"]
