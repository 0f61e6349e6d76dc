"""The llama-server peer (`meshserve.serving.bench.llama_server` and `llama_server_build`).

Most tests need no build: the streamed `/completion` protocol and the metrics run against
`fake_llama_server` on 127.0.0.1 (in this process, or as the "binary" the peer starts, installed
by the builder with its build step replaced by `script_build` and then smoke-tested for real),
and the build path runs real cmake on a two-file project. One test runs the real llama-server on
SmolLM2; it is slow and needs the built binary (see `test_the_real_llama_server_runs_a_workload`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
from pathlib import Path

import pytest

from meshserve.serving.bench import bench, bench_command, latency, llama_server
from meshserve.serving.bench import llama_server_build as build
from meshserve.serving.bench.workloads import BenchRequest
from meshserve.serving.bench.loadgen import run_online
from meshserve.serving.bench.peers import PeerUnavailable
from meshserve.serving.engine.engine_config import EngineConfig
from tests.serving import fake_llama_server
from tests.serving.fake_llama_server import Behaviour, make_server

FAKE_SCRIPT = Path(fake_llama_server.__file__)
BUILD_ENV_VAR = "MESHSERVE_BUILD_LLAMA_SERVER"
REQUESTS = [BenchRequest(prompt_token_ids=[3, 1, 4, 1, 5], num_output_tokens=12),
            BenchRequest(prompt_token_ids=[9, 2, 6], num_output_tokens=1),
            BenchRequest(prompt_token_ids=[5, 3, 5, 8], num_output_tokens=5)]


@pytest.fixture
def fake():
    """An in-process fake llama-server; its `Behaviour` is the fixture's `.behaviour`."""
    behaviour = Behaviour()
    server = make_server(0, behaviour)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    server.behaviour = behaviour
    server.target = f"127.0.0.1:{server.server_address[1]}"
    yield server
    server.shutdown()
    server.server_close()


# -- the request and its stream -------------------------------------------------------------------

def test_each_request_is_sent_as_greedy_token_ids_with_its_exact_length(fake):
    eos = BenchRequest(prompt_token_ids=[7, 7], num_output_tokens=3, stop_at_eos=True)
    run_online(fake.target, [*REQUESTS, eos], frontend="llama-server")
    bodies = sorted(fake.behaviour.bodies, key=lambda b: b["prompt"])
    expected = sorted([{"prompt": r.prompt_token_ids, "n_predict": r.num_output_tokens,
                        "temperature": 0.0, "ignore_eos": not r.stop_at_eos, "stream": True}
                       for r in [*REQUESTS, eos]], key=lambda b: b["prompt"])
    assert bodies == expected


def test_tokens_are_counted_from_tokens_predicted_so_held_back_ones_count(fake):
    timings, _ = run_online(fake.target, REQUESTS, frontend="llama-server")
    assert [t.error for t in timings] == [None] * 3
    assert [t.output_tokens for t in timings] == [12, 1, 5]
    # Tokens 5 and 10 of the first request were held back and came with the next one.
    assert timings[0].chunk_tokens == (1, 1, 1, 1, 2, 1, 1, 1, 2, 1)
    assert timings[2].chunk_tokens == (1, 1, 1, 1, 1)


def test_ttft_is_the_first_streamed_token_and_tpot_the_mean_gap_after_it(fake):
    fake.behaviour.first_token_delay, fake.behaviour.token_delay = 0.5, 0.1
    request = BenchRequest(prompt_token_ids=[1, 2], num_output_tokens=5)
    timings, wall = run_online(fake.target, [request], frontend="llama-server")
    summary = latency.summarize(timings, wall_seconds=wall)
    # The final event comes 0.4 s after the first token: a TTFT read from it would be >= 0.9 s.
    assert 0.5 <= summary["ttft_s"]["median"] < 0.85
    # The client reads each event a little after the server writes it, so one gap can read a
    # few ms short of the server's 0.1 s sleep. TPOT counted from the request's start would
    # be 0.9 / 5 = 0.18 s.
    assert 0.09 <= summary["tpot_s"]["median"] < 0.16
    assert summary["itl_s"]["count"] == 4 and summary["output_tokens"] == 5


def test_an_http_error_and_an_error_event_are_failed_requests(fake):
    fake.behaviour.status = 503
    timings, _ = run_online(fake.target, REQUESTS[:1], frontend="llama-server")
    assert timings[0].error == "UNAVAILABLE"
    fake.behaviour.status, fake.behaviour.error_after_first = 200, True
    timings, wall = run_online(fake.target, REQUESTS[:1], frontend="llama-server")
    assert timings[0].error == "INTERNAL" and timings[0].output_tokens == 1
    assert latency.summarize(timings, wall_seconds=wall)["failed_by_code"] == {"INTERNAL": 1}


def test_a_short_output_is_a_failed_request_not_credited_throughput(fake):
    fake.behaviour.missing_tokens = 1
    timings, wall = run_online(fake.target, REQUESTS, frontend="llama-server")
    marked = llama_server.mark_short_outputs(timings, REQUESTS)
    assert [t.error for t in marked] == [llama_server.SHORT_OUTPUT] * 3
    eos = [BenchRequest(r.prompt_token_ids, r.num_output_tokens, stop_at_eos=True)
           for r in REQUESTS]
    assert [t.error for t in llama_server.mark_short_outputs(timings, eos)] == [None] * 3
    assert latency.summarize(marked, wall_seconds=wall)["output_tokens"] == 0


# -- the server process ---------------------------------------------------------------------------

RUN_FAKE = f'exec "{sys.executable}" "{FAKE_SCRIPT}" "$@"'
# Dies by SIGSEGV on a decode (llama-batched-bench's `-npp`), as llama.cpp built with AMX does on
# some CPUs that report it; `--version` still answers.
SEGFAULT_ON_DECODE = 'case " $* " in *" -npp "*) kill -SEGV $$;; esac\n' + RUN_FAKE


def script_build(body, builds: list):
    """A build step that installs, as each binary of a variant, a shell script whose body is
    `body(variant)`; it appends each variant's name to `builds`."""
    def build_variant(directory: Path, variant: build.BuildVariant, *, log, jobs) -> None:
        builds.append(variant.name)
        for name in build.BUILD_TARGETS:
            path = build._bin_directory(directory, variant) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"#!/bin/sh\n{body(variant)}\n")
            path.chmod(0o755)
    return build_variant


def no_amx(variant: build.BuildVariant) -> bool:
    """Whether the variant's cmake arguments turn AMX off in both C and C++."""
    flags = " ".join(build.NO_AMX_FLAGS)
    arguments = variant.cmake_arguments()
    return {f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"} <= set(arguments)


@pytest.fixture
def fake_gguf(tmp_path) -> Path:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    return gguf


@pytest.fixture
def fake_binary(tmp_path, monkeypatch, fake_gguf):
    """The fake installed by the builder in a private cache, having passed its smoke test."""
    cache = tmp_path / "cache"
    monkeypatch.setattr(build, "_build_variant", script_build(lambda _: RUN_FAKE, []))
    build.ensure_built(cache, model=fake_gguf, log=lambda _: None)
    argv_file = tmp_path / "argv.json"
    monkeypatch.setenv("FAKE_LLAMA_SERVER_ARGV", str(argv_file))
    return {"cache": cache, "argv": argv_file, "model": str(fake_gguf)}


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_run_peer_serves_the_workload_from_a_server_shaped_like_the_engine(fake_binary):
    config = EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32,
                          prefill_chunk=32, enable_prefix_caching=False)
    shape = llama_server.ServerShape.matching(config, threads=2)
    result = llama_server.run_peer(fake_binary["model"], REQUESTS, shape=shape,
                                   cache_dir=fake_binary["cache"], log=lambda _: None)
    assert result["completed"] == 3 and result["output_tokens"] == 18
    assert result["output_tokens_per_s"] == result["output_throughput"] > 0
    assert result["ttft_s"]["count"] == 3 and result["tpot_s"]["count"] == 2
    assert "fake" in result["version"]
    assert result["build"]["variant"] == "native" and result["build"]["c_flags"] == []
    assert result["build"]["smoke_test"]["outcome"] == "passed"
    assert result["build"]["cmake_options"] == list(build.CMAKE_OPTIONS)
    assert len(result["load_average"]["before"]) == len(result["load_average"]["after"]) == 3
    assert result["peak_rss_bytes"] > 0  # the fake server process's own, read before it stops
    argv = json.loads(fake_binary["argv"].read_text())
    assert {name: flag(argv, name) for name in ("-np", "-c", "-b", "-ub", "-t", "-tb",
                                                "--cache-ram", "--host", "-m")} == {
        "-np": "4", "-c": "256", "-b": "32", "-ub": "32", "-t": "2", "-tb": "2",
        "--cache-ram": "0", "--host": "127.0.0.1", "-m": fake_binary["model"]}
    assert not listening(int(flag(argv, "--port")))  # stopped


def test_prefix_caching_on_leaves_llama_servers_prompt_cache_on():
    shape = llama_server.ServerShape.matching(
        EngineConfig(max_num_seqs=2, max_model_len=32), threads=None)
    assert shape.cache_prompt and "--cache-ram" not in shape.arguments()
    assert "-t" not in shape.arguments()


def test_prompt_lookup_in_the_engine_turns_on_llama_servers_own_lookup():
    ngram = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
             "prompt_lookup_max": 4}
    argv = llama_server.ServerShape.matching(
        EngineConfig(max_num_seqs=6, max_model_len=32, speculative_config=ngram)).arguments()
    assert {name: flag(argv, name) for name in (
        "--spec-type", "--spec-ngram-simple-size-n", "--spec-ngram-simple-size-m",
        "--spec-draft-n-max")} == {"--spec-type": "ngram-simple",
                                   "--spec-ngram-simple-size-n": "2",
                                   "--spec-ngram-simple-size-m": "5", "--spec-draft-n-max": "5"}
    draft = {"method": "draft_model", "model": "smollm2-135m-instruct",
             "num_speculative_tokens": 3}
    for spec in (None, draft):  # no lookup of its own: the peer decodes plainly
        shape = llama_server.ServerShape.matching(
            EngineConfig(max_num_seqs=6, max_model_len=32, speculative_config=spec))
        assert shape.lookup is None and "--spec-type" not in shape.arguments()
    with pytest.raises(ValueError, match="lookup must be"):
        llama_server.ServerShape(slots=1, context_per_slot=32, lookup=(0, 4))


def test_the_server_is_stopped_when_the_run_fails(fake_binary):
    binary = build.cached_binary(cache_dir=fake_binary["cache"])
    shape = llama_server.ServerShape(slots=1, context_per_slot=32)
    with pytest.raises(RuntimeError, match="interrupted"):
        with llama_server.serve(binary, Path(fake_binary["model"]), shape) as target:
            port = int(target.rsplit(":", 1)[1])
            assert listening(port)
            raise RuntimeError("interrupted")
    assert not listening(port)


def test_a_server_that_dies_at_start_is_unavailable_with_its_log(fake_binary, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_SERVER_FAIL", "1")
    shape = llama_server.ServerShape(slots=1, context_per_slot=32)
    with pytest.raises(PeerUnavailable, match=r"exited with status 3(.|\n)*failed to load model"):
        llama_server.run_peer(fake_binary["model"], REQUESTS, shape=shape,
                              cache_dir=fake_binary["cache"], log=lambda _: None)


def test_a_server_that_dies_by_a_signal_while_serving_is_unavailable(fake_binary, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_SERVER_SEGFAULT", "1")
    shape = llama_server.ServerShape(slots=1, context_per_slot=32)
    with pytest.raises(PeerUnavailable, match="died of SIGSEGV .* while it served"):
        llama_server.run_peer(fake_binary["model"], REQUESTS, shape=shape,
                              cache_dir=fake_binary["cache"], log=lambda _: None)


def test_a_request_longer_than_a_slot_is_refused_before_anything_starts(fake_binary):
    shape = llama_server.ServerShape(slots=1, context_per_slot=16)
    with pytest.raises(ValueError, match="context per slot"):
        llama_server.run_peer(fake_binary["model"], REQUESTS, shape=shape,
                              cache_dir=fake_binary["cache"])
    assert not fake_binary["argv"].exists()


def test_missing_build_tools_skip_the_peer_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no cmake, no compiler
    monkeypatch.setenv("MESHSERVE_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("CC", "CXX"):
        monkeypatch.delenv(name, raising=False)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    results = bench.run_peers(["llama-server"], str(gguf), REQUESTS, max_batch_size=4,
                              log=lambda _: None)
    assert results["llama-server"]["skipped"].startswith(
        "building llama-server needs cmake, a C compiler, a C++ compiler, not found on PATH")


def test_online_comparison_with_llama_server_drives_meshserves_http_api():
    parser = argparse.ArgumentParser()
    bench_command.add_arguments(parser)
    chosen = {}
    for argv in (["--mode", "online", "--compare", "llama-server"], ["--mode", "online"],
                 ["--mode", "online", "--compare", "llama-server", "--frontend", "grpc"]):
        args = parser.parse_args(argv)
        bench_command._check_bench_args(args)
        chosen[" ".join(argv[2:])] = args.frontend
    assert chosen == {"--compare llama-server": "http", "": "grpc",
                      "--compare llama-server --frontend grpc": "grpc"}


# -- the build ------------------------------------------------------------------------------------

NATIVE, NO_AMX = build.BUILD_VARIANTS[0], build.BUILD_VARIANTS[1]


def test_a_build_that_segfaults_on_decode_falls_back_to_amx_off_and_records_it(
        tmp_path, monkeypatch, fake_gguf):
    builds: list = []
    monkeypatch.setattr(build, "_build_variant", script_build(
        lambda variant: RUN_FAKE if no_amx(variant) else SEGFAULT_ON_DECODE, builds))
    server = build.ensure_built(tmp_path, model=fake_gguf, log=lambda _: None)
    assert builds == ["native", "native-no-amx"]
    assert server == build.binary_path("llama-server", NO_AMX, tmp_path)
    assert build.cached_binary(cache_dir=tmp_path) == server
    assert not build.binary_path("llama-server", NATIVE, tmp_path).exists()  # never reused
    info = build.build_info(tmp_path)
    assert info["variant"] == "native-no-amx"
    assert info["c_flags"] == info["cxx_flags"] == list(build.NO_AMX_FLAGS)
    assert info["smoke_test"]["outcome"] == "passed"
    assert "-npp" in info["smoke_test"]["command"] and str(fake_gguf) in info["smoke_test"][
        "command"]
    assert info["attempts"] == [
        {"variant": "native", "c_flags": [], "outcome": "crashed", "signal": "SIGSEGV"},
        {"variant": "native-no-amx", "c_flags": list(build.NO_AMX_FLAGS), "outcome": "passed",
         "signal": None}]
    record = json.loads((build.build_directory(tmp_path) / build.RECORD_NAME).read_text())
    assert record["attempts"][0]["smoke_test"]["steps"][-1]["returncode"] == -11
    assert build.ensure_built(tmp_path, model=fake_gguf, log=lambda _: None) == server
    assert builds == ["native", "native-no-amx"]  # nothing built or tested again


def test_when_every_build_crashes_the_peer_is_unavailable_naming_signal_and_flags(
        tmp_path, monkeypatch, fake_gguf):
    builds: list = []
    monkeypatch.setattr(build, "_build_variant",
                        script_build(lambda _: SEGFAULT_ON_DECODE, builds))
    monkeypatch.setenv("MESHSERVE_CACHE_DIR", str(tmp_path))
    results = bench.run_peers(["llama-server"], str(fake_gguf), REQUESTS, max_batch_size=4,
                              log=lambda _: None)
    reason = results["llama-server"]["skipped"]
    assert reason.startswith("every llama.cpp build died by a signal in its smoke test")
    assert "native with C/C++ flags '(none)': SIGSEGV" in reason
    assert f"native-no-amx with C/C++ flags '{' '.join(build.NO_AMX_FLAGS)}': SIGSEGV" in reason
    assert builds == ["native", "native-no-amx"]
    with pytest.raises(build.EveryBuildCrashed, match="SIGSEGV"):
        build.ensure_built(model=fake_gguf, log=lambda _: None)
    assert builds == ["native", "native-no-amx"]  # a crashed build is not built again
    assert build.cached_binary() is None and build.build_info() is None


def test_a_build_that_cannot_decode_without_a_signal_does_not_fall_back(
        tmp_path, monkeypatch, fake_gguf):
    builds: list = []
    monkeypatch.setattr(build, "_build_variant", script_build(lambda _: RUN_FAKE, builds))
    monkeypatch.setenv("FAKE_LLAMA_SERVER_FAIL", "1")  # exits with status 3, as on a bad model
    failure = r"llama-batched-bench exited with status 3(.|\n)*failed to load model"
    with pytest.raises(build.SmokeTestFailed, match=failure):
        build.ensure_built(tmp_path, model=fake_gguf, log=lambda _: None)
    assert builds == ["native"] and build.cached_binary(cache_dir=tmp_path) is None
    monkeypatch.delenv("FAKE_LLAMA_SERVER_FAIL")
    assert build.ensure_built(tmp_path, model=fake_gguf, log=lambda _: None) == \
        build.binary_path("llama-server", NATIVE, tmp_path)
    assert builds == ["native"]  # tested again, not built again


def test_a_binary_from_before_smoke_tests_is_never_used(tmp_path):
    legacy = build.build_directory(tmp_path) / "bin" / "llama-server"  # the former layout
    legacy.parent.mkdir(parents=True)
    legacy.write_text("#!/bin/sh\nkill -SEGV $$\n")
    legacy.chmod(0o755)
    assert build.cached_binary(cache_dir=tmp_path) is None


needs_build_tools = pytest.mark.skipif(bool(build.missing_build_tools()),
                                       reason=f"no {', '.join(build.missing_build_tools())}")
# A real cmake project whose binaries, built without the AMX-off C flags, die by SIGSEGV when
# asked to decode (`-npp`), as llama.cpp does on some CPUs that report AMX.
TINY_PROJECT = """cmake_minimum_required(VERSION 3.10)
project(tiny C)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
if(CMAKE_C_FLAGS MATCHES "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
  add_compile_definitions(AMX_OFF)
endif()
add_executable(llama-server main.c)
add_executable(llama-batched-bench main.c)
"""
TINY_MAIN = """#include <signal.h>
#include <stdio.h>
#include <string.h>
int main(int argc, char **argv) {
#ifndef AMX_OFF
    for (int i = 1; i < argc; i++) if (CRASHES && strcmp(argv[i], "-npp") == 0) raise(SIGSEGV);
#endif
    puts("tiny");
    return 0;
}
"""


def tiny_source(body: str, fetches: list):
    def fetch(work_dir: Path, log_file, log_path: Path) -> Path:
        fetches.append(work_dir)
        source = work_dir / "source"
        source.mkdir()
        (source / "CMakeLists.txt").write_text(TINY_PROJECT)
        (source / "main.c").write_text(body)
        return source
    return fetch


@needs_build_tools
def test_ensure_built_builds_once_under_a_lock_and_then_reuses_the_cache(tmp_path,
                                                                          monkeypatch, fake_gguf):
    fetches: list = []
    monkeypatch.setattr(build, "_fetch_source",
                        tiny_source("#define CRASHES 0\n" + TINY_MAIN, fetches))
    paths: list = []
    racers = [threading.Thread(target=lambda: paths.append(
        build.ensure_built(tmp_path, model=fake_gguf, log=lambda _: None, jobs=1)))
        for _ in range(2)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join()
    assert len(fetches) == 1 and paths == [build.binary_path("llama-server", NATIVE, tmp_path)] * 2
    assert all(build.cached_binary(name, tmp_path) for name in build.BUILD_TARGETS)
    assert os.popen(str(paths[0])).read() == "tiny\n"
    assert not list(build.build_directory(tmp_path).glob("*/.build-*"))  # the sources are gone
    lock = build.build_directory(tmp_path).parent / f"{build.build_directory(tmp_path).name}.lock"
    assert lock.is_file()  # one lock per build key, named after it
    build.ensure_built(tmp_path, model=fake_gguf, log=lambda _: None)
    assert len(fetches) == 1


@needs_build_tools
def test_the_fallback_flags_reach_the_compiler(tmp_path, monkeypatch, fake_gguf):
    fetches: list = []
    monkeypatch.setattr(build, "_fetch_source",
                        tiny_source("#define CRASHES 1\n" + TINY_MAIN, fetches))
    server = build.ensure_built(tmp_path, model=fake_gguf, log=lambda _: None, jobs=1)
    assert len(fetches) == 2 and server == build.binary_path("llama-server", NO_AMX, tmp_path)
    assert [a["outcome"] for a in build.build_info(tmp_path)["attempts"]] == ["crashed", "passed"]
    assert "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in (
        build.build_directory(tmp_path) / "native-no-amx" / "build.log").read_text()


@needs_build_tools
def test_a_failed_build_raises_with_the_logs_tail_and_installs_nothing(tmp_path, monkeypatch,
                                                                       fake_gguf):
    monkeypatch.setattr(build, "_fetch_source", tiny_source("int main(void) { return }\n", []))
    with pytest.raises(build.BuildFailed, match=r"could not build(.|\n)*main\.c.*error"):
        build.ensure_built(tmp_path, model=fake_gguf, log=lambda _: None, jobs=1)
    assert build.cached_binary(cache_dir=tmp_path) is None
    assert (build.build_directory(tmp_path) / "native" / "build.log").is_file()


# -- the real server ------------------------------------------------------------------------------

def real_server_or_skip() -> None:
    """Runs where the binary is cached, or with $MESHSERVE_BUILD_LLAMA_SERVER=1 (it builds it,
    about 9 minutes on 2 cores, once per machine); skips where the build tools are missing."""
    if build.cached_binary() is not None:
        return
    if build.missing_build_tools():
        missing = ", ".join(build.missing_build_tools())
        pytest.skip(f"llama-server cannot be built here: no {missing}")
    if os.environ.get(BUILD_ENV_VAR) != "1":
        pytest.skip(f"llama-server is not built under {build.build_directory()}; set "
                    f"{BUILD_ENV_VAR}=1 to build it (about 9 minutes on 2 cores, once)")


@pytest.mark.slow
def test_the_real_llama_server_runs_a_workload():
    real_server_or_skip()
    requests = [BenchRequest(prompt_token_ids=list(range(100 + i, 116 + i)), num_output_tokens=8)
                for i in range(4)]
    shape = llama_server.ServerShape(slots=2, context_per_slot=64, batch_tokens=64, threads=2)
    result = llama_server.run_peer("smollm2-135m-instruct", requests, shape=shape,
                                   rate=20.0, seed=1)
    assert result["failed"] == 0 and result["completed"] == 4
    assert result["output_tokens"] == 32 and result["output_tokens_per_s"] > 0
    assert result["ttft_s"]["count"] == 4 and result["tpot_s"]["count"] == 4
    assert 0 < result["ttft_s"]["median"] < result["e2el_s"]["median"]
    assert result["version"].startswith("llama.cpp from llama-cpp-python")
