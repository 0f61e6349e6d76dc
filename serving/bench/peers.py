"""Peer baselines for `meshserve bench --compare`: the same requests through another engine.

Two peers, both on the CPU and both optional:

  hf          HF transformers `generate` on torch, in static batches
              (`pip install 'meshserve[peers-hf]'`);
  llama-cpp   llama.cpp through `llama-cpp-python`, on the same GGUF file
              (`pip install 'meshserve[peers-llama-cpp]'`).

A third, llama.cpp's own `llama-server` with parallel slots, is built from source and driven over
HTTP like meshserve's online run; it lives in `meshserve.serving.bench.llama_server`.

`run_peer` raises `PeerUnavailable` when the peer's library is not installed or the peer cannot
load the model (a random-weight preset, a meshserve checkpoint, a file the library rejects), so
the caller can skip it with the message.

Every request produces exactly its `num_output_tokens`, greedily, whatever the model says about
end of sequence, so a peer does the same work as meshserve:

* hf batches up to `max_batch_size` requests in arrival order, left-pads their prompts to the
  longest, and decodes with `min_new_tokens = max_new_tokens` until the batch's longest request
  ends, as the static baseline does. Only each request's own `num_output_tokens` count. An HF
  directory loads directly; a GGUF file is dequantized by transformers (`gguf_file=`) to float32.
* llama-cpp has no batched generation in its Python API, so it serves requests one at a time,
  evaluating each prompt and then one sampled token per step. It runs in a child process
  (`_llama_cpp_child`), since llama.cpp's native code can die by a signal (built with AMX, it
  dies by SIGSEGV or SIGILL on its first decode on some CPUs that report AMX): a death by a
  signal becomes `LlamaCppCrashed`, naming the signal and the reinstall with AMX off, never a
  crash of the caller. Its result's `build` has llama-cpp-python's version and llama.cpp's
  system info (the CPU features it was compiled with).

Model loading is not timed. One short warm-up generation runs before the clock starts.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from meshserve.model.config import PRESETS
from meshserve.model.loading.hub import ModelFiles, ModelNotFoundError, known_models, resolve_model
from meshserve.serving.bench import memory

PEERS = ("hf", "llama-cpp")
GGUF_PEERS = ("llama-cpp", "llama-server")  # llama-server: `meshserve.serving.bench.llama_server`
WARMUP_TOKENS = 4
PAD_TOKEN_ID = 0  # masked out by the attention mask, so any id in the vocabulary serves

# Errors a library raises when it cannot read or does not support a model file.
LOAD_ERRORS = (OSError, ValueError, KeyError, ImportError, NotImplementedError, RuntimeError)
# C and C++ flags that build llama.cpp without AMX, which crashes on some CPUs that report it.
NO_AMX_FLAGS = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
LLAMA_CPP_CHILD_LOG_LINES = 20


class PeerUnavailable(RuntimeError):
    """A peer cannot run here: its library is missing or it cannot load the model."""


class LlamaCppCrashed(PeerUnavailable):
    """llama-cpp-python's process died by a signal; the message names it and the fix."""


class PeerRequest(Protocol):
    prompt_token_ids: list[int]
    num_output_tokens: int


def run_peer(name: str, model: str, requests: Sequence[PeerRequest], *,
             max_batch_size: int = 16, threads: int | None = None) -> dict[str, Any]:
    """Run `requests` through the peer `name` on `model` and return its throughput.

    The result has the keys peer, wall_s, output_tokens, output_tokens_per_s, requests_per_s,
    num_requests, version (the peer library's), threads (the CPU threads it used) and
    peak_rss_bytes (llama.cpp's process's; None for HF, which runs in this process).
    """
    if name not in PEERS:
        raise ValueError(f"Unknown peer {name!r}; choose one of {', '.join(PEERS)}")
    if not requests:
        raise ValueError("run_peer needs at least one request")
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
    files = model_files(name, model)
    build = None  # what the peer's native library was built with, where it can say
    # Peak resident memory: llama.cpp's child process reports its own; HF runs in this process,
    # whose peak also holds meshserve's, so none is recorded for it.
    peak_rss = None
    if name == "hf":
        wall_s, version, used_threads = _run_hf(files, requests, max_batch_size, threads)
    else:
        wall_s, version, used_threads, build, peak_rss = _run_llama_cpp(files, requests,
                                                                         threads)
    output_tokens = sum(r.num_output_tokens for r in requests)
    return {
        "peer": name,
        "wall_s": wall_s,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / wall_s,
        "requests_per_s": len(requests) / wall_s,
        "num_requests": len(requests),
        "version": version,
        "threads": used_threads,
        "peak_rss_bytes": peak_rss,
    } | ({"build": build} if build is not None else {})


def model_files(peer: str, model: str) -> ModelFiles:
    """The files of `model` that the peer `peer` loads; `PeerUnavailable` when it cannot."""
    if model in PRESETS:
        raise PeerUnavailable(
            f"The {peer} peer needs real weights, but {model!r} is a random-weight preset; pass a "
            f".gguf file, an HF directory or a known model ({', '.join(known_models())})."
        )
    try:
        files = resolve_model(model)
    except ModelNotFoundError as err:
        raise PeerUnavailable(f"The {peer} peer cannot find the model: {err}") from err
    if files.kind == "orbax":
        raise PeerUnavailable(
            f"The {peer} peer cannot load the meshserve checkpoint {files.path}; pass the .gguf "
            "file or HF directory it was converted from."
        )
    if peer in GGUF_PEERS and files.kind != "gguf":
        raise PeerUnavailable(f"The {peer} peer needs a GGUF file, but {files.path} is an HF "
                              "directory; pass the model as a .gguf file.")
    return files


def _require(module: str, extra: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise PeerUnavailable(f"{module} is not installed ({err}); "
                              f"pip install 'meshserve[{extra}]'") from err


def _run_hf(files: ModelFiles, requests: Sequence[PeerRequest], max_batch_size: int,
            threads: int | None) -> tuple[float, str, int]:
    torch = _require("torch", "peers-hf")
    transformers = _require("transformers", "peers-hf")
    model = _load_hf(torch, transformers, files)
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        used_threads = torch.get_num_threads()
        with torch.inference_mode():
            _hf_generate(torch, model, [requests[0].prompt_token_ids],
                         min(WARMUP_TOKENS, requests[0].num_output_tokens))
            start = time.perf_counter()
            for i in range(0, len(requests), max_batch_size):
                batch = requests[i:i + max_batch_size]
                _hf_generate(torch, model, [r.prompt_token_ids for r in batch],
                             max(r.num_output_tokens for r in batch))
            wall_s = time.perf_counter() - start
    finally:
        torch.set_num_threads(previous_threads)
    return wall_s, transformers.__version__, used_threads


def _load_hf(torch: ModuleType, transformers: ModuleType, files: ModelFiles) -> Any:
    path = files.path
    if files.kind == "gguf":
        source, extra = str(path.parent), {"gguf_file": path.name}
    else:
        source, extra = str(path), {}
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(source, **extra)
    except LOAD_ERRORS as err:
        raise PeerUnavailable(f"transformers cannot load {path}: {err}") from err
    if model.dtype != torch.float32:
        # float32 like meshserve on the CPU. A GGUF is dequantized to float32 already, and
        # transformers 5 refuses `.float()` on such a model.
        model = model.float()
    return model.eval()


def _hf_generate(torch: ModuleType, model: Any, prompts: list[list[int]], new_tokens: int) -> None:
    """Generate exactly `new_tokens` tokens for every prompt, left-padded into one batch."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[PAD_TOKEN_ID] * (width - len(p)) + list(p) for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    output = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                            max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            do_sample=False, pad_token_id=PAD_TOKEN_ID)
    if output.shape[1] - width != new_tokens:
        raise RuntimeError(f"transformers generated {output.shape[1] - width} tokens per "
                           f"sequence, expected {new_tokens}")


def _run_llama_cpp(files: ModelFiles, requests: Sequence[PeerRequest],
                   threads: int | None) -> tuple[float, str, int, dict[str, Any]]:
    """The llama-cpp peer, run in a child process; returns its wall time, llama-cpp-python's
    version, the threads llama.cpp used and its build information."""
    _require_installed("llama_cpp", "peers-llama-cpp")
    job = {"model": str(files.path), "threads": threads, "warmup_tokens": WARMUP_TOKENS,
           "n_ctx": max(len(r.prompt_token_ids) + r.num_output_tokens for r in requests),
           "requests": [[list(r.prompt_token_ids), r.num_output_tokens] for r in requests]}
    with tempfile.TemporaryDirectory(prefix="meshserve-llama-cpp-") as scratch:
        result = _run_llama_cpp_child(Path(scratch), job)
    build = {"library": "llama-cpp-python", "version": result["version"],
             "system_info": result["system_info"]}
    return result["wall_s"], result["version"], result["threads"], build, result.get(
        "peak_rss_bytes")


def _require_installed(module: str, extra: str) -> None:
    """`PeerUnavailable` unless `module` can be imported; it is not imported here."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise PeerUnavailable(f"{module} is not installed (no module named {module!r}); "
                              f"pip install 'meshserve[{extra}]'")


def _llama_cpp_child_command(scratch: Path) -> list[str]:
    return [sys.executable, "-c", "import sys; from meshserve.serving.bench.peers import "
            "_llama_cpp_child; sys.exit(_llama_cpp_child(sys.argv[1]))", str(scratch)]


def _run_llama_cpp_child(scratch: Path, job: dict[str, Any]) -> dict[str, Any]:
    """Runs `_llama_cpp_child` on `job` in `scratch` and returns its result; every way it can
    fail is a `PeerUnavailable` with the reason and the tail of its output. The child is
    killed if this process is interrupted."""
    (scratch / "job.json").write_text(json.dumps(job))
    log_path = scratch / "child.log"
    with log_path.open("w") as log_file:
        process = subprocess.Popen(_llama_cpp_child_command(scratch), stdin=subprocess.DEVNULL,
                                   stdout=log_file, stderr=subprocess.STDOUT)
    try:
        returncode = process.wait()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    info, result = _read_json(scratch / "info.json"), _read_json(scratch / "result.json")
    tail = _tail(log_path)
    if returncode < 0:
        raise LlamaCppCrashed(_crash_message(-returncode, info, tail))
    if result is not None and "unavailable" in result:
        raise PeerUnavailable(result["unavailable"])
    if returncode != 0 or result is None:
        raise PeerUnavailable(f"the llama-cpp peer's process exited with status {returncode}; "
                              f"its last output:\n{tail}")
    return result


def _crash_message(number: int, info: dict[str, Any] | None, tail: str) -> str:
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    version = info["version"] if info else "(version unknown)"
    flags = " ".join(NO_AMX_FLAGS)
    system = f" llama.cpp's system info: {info['system_info']}." if info else ""
    return (f"llama-cpp-python {version} died of {name} (signal {number}) in the llama-cpp "
            f"peer's process, so it cannot run here.{system} On CPUs that report AMX, llama.cpp "
            "built with it dies like this on its first decode; reinstall it with AMX off: "
            f"CMAKE_ARGS=\"-DCMAKE_C_FLAGS='{flags}' -DCMAKE_CXX_FLAGS='{flags}'\" pip install "
            "--force-reinstall --no-deps --no-cache-dir llama-cpp-python"
            f"{'==' + version if info else ''}. Its last output:\n{tail}")


def _llama_cpp_child(scratch: str) -> int:
    """The llama-cpp peer's process. Reads `job.json` in `scratch`; writes `info.json`
    (version, system info) before it loads the model, so a crash still names them, then
    `result.json`: the timed run, or `{"unavailable": reason}` when the model does not load."""
    directory = Path(scratch)
    job = json.loads((directory / "job.json").read_text())
    llama_cpp = importlib.import_module("llama_cpp")
    info = {"version": llama_cpp.__version__, "system_info": _system_info(llama_cpp)}
    _write_json(directory / "info.json", info)
    try:
        llama = llama_cpp.Llama(model_path=job["model"], n_ctx=job["n_ctx"],
                                n_threads=job["threads"], n_threads_batch=job["threads"],
                                verbose=False)
    except LOAD_ERRORS as err:
        _write_json(directory / "result.json",
                    {"unavailable": f"llama.cpp cannot load {job['model']}: {err}"})
        return 0
    (prompt, length), *_ = job["requests"]
    _llama_generate(llama, prompt, min(job["warmup_tokens"], length))
    start = time.perf_counter()
    for prompt, length in job["requests"]:
        _llama_generate(llama, prompt, length)
    wall_s = time.perf_counter() - start
    _write_json(directory / "result.json",
                info | {"wall_s": wall_s, "threads": llama.n_threads,
                        "peak_rss_bytes": memory.own_peak_rss_bytes()})
    return 0


def _system_info(llama_cpp: ModuleType) -> str:
    """llama.cpp's `llama_print_system_info`: the CPU features it was compiled with."""
    said = llama_cpp.llama_print_system_info()
    return (said.decode(errors="replace") if isinstance(said, bytes) else str(said)).strip()


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(payload))
    partial.replace(path)


def _tail(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(lines[-LLAMA_CPP_CHILD_LOG_LINES:]) or "(no output)"


def _llama_generate(llama: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedily generate exactly `new_tokens` tokens after `prompt`, from an empty cache.

    `reset` drops the previous request's tokens, so no prompt prefix is reused across requests.
    End of sequence does not stop the loop; the last sampled token is never evaluated.
    """
    llama.reset()
    llama.eval(prompt)
    tokens: list[int] = []
    while len(tokens) < new_tokens:
        if tokens:
            llama.eval(tokens[-1:])
        tokens.append(llama.sample(temp=0.0))
    return tokens
