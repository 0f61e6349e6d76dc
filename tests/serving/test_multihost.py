"""Two processes on 127.0.0.1 make one mesh over their fake CPU devices (jax.distributed, gloo).

Process 0 schedules and broadcasts each step's plan; process 1 follows. Greedy and seeded tokens
must equal those of one process on the same mesh shape. Then the failure paths: a process that
breaks the rules or dies takes the job down within a bounded time, with a message naming it.

Every run is a pair of real subprocesses with a hard timeout, so no test can hang.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshserve.batching.sampling import SamplingParams
from meshserve.serving.grpc_api.client import Client, ClientError
from meshserve.serving.python_api.llm import LLM
from tests.model.test_loaders import LLAMA_HF, hf_llama_tensors, write_hf
from tests.serving.multihost_worker import ENGINE, GREEDY, PROMPTS, SAMPLED

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
WORKER = Path(__file__).with_name("multihost_worker.py")
# (1,2,2): stages across the processes, (2,1,2): replicas across them; tensor parallelism across
# them, model=4, is SmolLM2's served run below (and the mismatch test's job).
MESHES = ["stage=2,model=2", "data=2,model=2"]
TIMEOUT = 300  # seconds a two-process run of one mesh may take, start-up and compiles included
SERVE_OPTIONS = ["--num-pages", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                 "--prefill-chunk", "32", "--max-model-len", "256", "--no-warmup",
                 "--no-compilation-cache"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int = 2) -> dict[str, str]:
    """The suite's XLA flags (tests/conftest.py) with the processes' own device count."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ["XLA_FLAGS"])
    return os.environ | {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {flags}",
                         "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A small llama checkpoint with unit-variance weights, so greedy choices are clear-cut."""
    hf = LLAMA_HF | {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                     "num_attention_heads": 4, "num_key_value_heads": 4,
                     "max_position_embeddings": 256}
    return write_hf(tmp_path_factory.mktemp("tiny-multihost"), hf, hf_llama_tensors(hf, seed=3))


def _run_workers(model: Path, meshes: list[str], out: Path, *extra: str
                 ) -> list[tuple[int, str]]:
    """Runs one job of two worker processes over `meshes`, within TIMEOUT a mesh."""
    port = _free_port()
    mesh_flags = [flag for mesh in meshes for flag in ("--mesh", mesh)]
    procs = [subprocess.Popen(
        [sys.executable, str(WORKER), "--coordinator", f"127.0.0.1:{port}", "--num-processes",
         "2", "--process-id", str(i), "--devices", "2", "--model", str(model), *mesh_flags,
         "--out", str(out), *extra],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)]
    try:
        outputs = [p.communicate(timeout=TIMEOUT * len(meshes))[0] for p in procs]
        return [(p.returncode, out) for p, out in zip(procs, outputs)]
    finally:
        for p in procs:
            p.kill()


@pytest.fixture(scope="module")
def two_process_results(tiny_model, tmp_path_factory) -> tuple[dict, dict]:
    """One job of two processes runs an `LLM` on every mesh of MESHES in turn (start-up, the
    distributed runtime's set-up and imports paid once); each process's results, per mesh."""
    out = tmp_path_factory.mktemp("multihost-meshes")
    runs = _run_workers(tiny_model, MESHES, out)
    for process, (code, output) in enumerate(runs):
        assert code == 0, f"process {process} exited {code}:\n{output[-4000:]}"
    leader, follower = (json.loads((out / f"{i}.json").read_text()) for i in range(2))
    assert set(leader) == set(follower) == set(MESHES)
    return leader, follower


@pytest.mark.parametrize("mesh", MESHES)
def test_two_processes_give_one_process_tokens(tiny_model, two_process_results, mesh):
    leader, follower = two_process_results
    got, other = leader[mesh], follower[mesh]
    llm = LLM(str(tiny_model), mesh=mesh, **ENGINE)  # one process, 4 of its 8 fake devices
    want_greedy = [o.outputs[0].token_ids
                   for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    want_sampled = [o.outputs[0].token_ids
                    for o in llm.generate(PROMPTS, SAMPLED, use_tqdm=False)]
    assert got["greedy"] == want_greedy, mesh
    assert got["sampled"] == want_sampled, mesh
    # Every process gets process 0's outputs from `generate`.
    assert (other["greedy"], other["sampled"]) == (got["greedy"], got["sampled"]), mesh
    # One RUN message per step (per pipeline call of several steps with stages), plus
    # BEGIN_CALL and END_CALL per generate call.
    stream = got["stream"]
    assert stream["messages"] == stream["runs"] + 2 * 2, mesh
    if "stage" in mesh:
        assert 0 < stream["runs"] < got["steps"], mesh
    else:
        assert stream["runs"] == got["steps"], mesh
    # Each process holds only its own devices' shards: half of every weight split over
    # `model` across the two processes (the embedding and head stay whole on each stage of
    # a pipeline); a data-parallel replica holds the whole model.
    for result in (got, other):
        held = result["local_weight_bytes"] / result["weight_bytes"]
        assert (held >= 1.0) if "data" in mesh else (held < 0.75), (mesh, held)
    print(f"\nplan stream on {mesh}: {1e3 * stream['seconds'] / stream['messages']:.2f} ms "
          f"per message, {stream['payload_bytes'] / stream['messages'] / 1024:.1f} KiB "
          "per message")


def test_a_process_with_other_prompts_fails_the_job_naming_it(tiny_model, tmp_path):
    started = time.monotonic()
    (code0, out0), (code1, out1) = _run_workers(tiny_model, ["model=4"], tmp_path,
                                                "--other-prompts")
    assert code1 == 1 and "process 1 of 2 failed: its generate() call has other prompts" in out1
    assert code0 != 0
    assert "lost process 1 of 2: it failed: its generate() call has other prompts" in out0
    assert not (tmp_path / "0.json").exists()
    print(f"\nmismatch noticed and both processes gone in {time.monotonic() - started:.0f}s")


class _Served:
    """`meshserve serve` as two processes; process 0 serves gRPC on `port`."""

    def __init__(self, model: str, mesh: str, *extra: str):
        self.port, coordinator = _free_port(), f"127.0.0.1:{_free_port()}"
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "meshserve.serving.cli", "serve", "--model", model,
             "--mesh", mesh, *SERVE_OPTIONS, "--port", str(self.port), "--coordinator",
             coordinator, "--num-processes", "2", "--process-id", str(i), *extra],
            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(2)]
        self._lines = [[], []]
        for i, proc in enumerate(self.procs):
            threading.Thread(target=self._read, args=(i, proc.stdout), daemon=True).start()
        self.wait_for(lambda: any("meshserve: serving" in line for line in self._lines[0]),
                      "process 0 to serve")

    def _read(self, index: int, pipe) -> None:
        for line in pipe:
            self._lines[index].append(line)

    def stdout(self, index: int) -> str:
        return "".join(self._lines[index])

    def wait_for(self, condition, what: str, timeout: float = TIMEOUT) -> None:
        end = time.monotonic() + timeout
        while not condition():
            for i, proc in enumerate(self.procs):
                if proc.poll() is not None and not condition():
                    raise AssertionError(f"process {i} exited {proc.returncode} waiting for "
                                         f"{what}:\n{self.stdout(i)}\n{proc.stderr.read()}")
            assert time.monotonic() < end, f"timed out waiting for {what}"
            time.sleep(0.05)

    def exit_codes(self, timeout: float) -> list[int]:
        return [proc.wait(timeout=timeout) for proc in self.procs]

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def test_serving_on_two_processes_gives_hf_tokens_and_drains_on_sigterm(smollm2_files,
                                                                       golden_dir):
    """SmolLM2 served by two processes on `model=4` (heads padded, split across processes)
    gives HF transformers' greedy tokens; SIGTERM to process 0 drains, then stops both."""
    case = json.loads((golden_dir / "smollm2.json").read_text())["cases"][0]
    served = _Served(str(smollm2_files.path), "model=4")
    try:
        with Client(f"127.0.0.1:{served.port}") as client:
            got = client.generate(case["prompt_ids"], SamplingParams(max_tokens=16,
                                                                     temperature=0))
            assert client.health() == "SERVING"
            stream = client.stream("Write a story about a dragon", SamplingParams(
                max_tokens=24, temperature=0))
            next(iter(stream))  # the request is running when SIGTERM arrives
            served.procs[0].send_signal(signal.SIGTERM)
            chunks = list(stream)
        assert served.exit_codes(timeout=120) == [0, 0]
        assert chunks[-1].finish_reason in ("stop", "length")  # the drain let it finish
        assert "drained and stopped" in served.stdout(0)
        assert "process 1 stopped with process 0" in served.stdout(1)
    finally:
        served.close()
    assert got.token_ids == case["greedy_ids"][:16]


def test_killing_process_1_fails_process_0_within_the_peer_timeout(tiny_model):
    peer_timeout = 3.0
    served = _Served(str(tiny_model), "data=2,model=2", "--peer-timeout", str(peer_timeout))
    statuses: list[str] = []
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{served.port}")
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())

        def record():
            try:
                for response in watch:
                    statuses.append(health_pb2.HealthCheckResponse.ServingStatus.Name(
                        response.status))
            except grpc.RpcError:
                pass  # the server went away

        threading.Thread(target=record, daemon=True).start()
        with Client(f"127.0.0.1:{served.port}") as client:
            stream = client.stream(PROMPTS[2], SamplingParams(max_tokens=200, temperature=0))
            chunks = iter(stream)
            next(chunks)
            served.procs[1].kill()
            killed = time.monotonic()
            with pytest.raises(ClientError) as failure:
                list(chunks)
        code = served.procs[0].wait(timeout=peer_timeout + 30)
        elapsed = time.monotonic() - killed
        stderr = served.procs[0].stderr.read()
    finally:
        served.close()
    assert code == 1
    assert elapsed < peer_timeout + 30
    assert failure.value.code == grpc.StatusCode.UNAVAILABLE
    assert "lost process 1 of 2" in failure.value.message
    assert "lost process 1 of 2" in stderr
    assert statuses[0] == "SERVING" and "NOT_SERVING" in statuses
    print(f"\nprocess 0 exited {elapsed:.1f}s after process 1 was killed")


def test_a_frozen_process_0_ends_its_follower_naming_it(tiny_model):
    """Process 0 stops answering (SIGSTOP: its coordination service freezes with it): the
    follower gives up after the peer timeout, names process 0 and exits 1, before JAX's own
    heartbeat timeout would abort it."""
    peer_timeout = 3.0
    served = _Served(str(tiny_model), "data=2,model=2", "--peer-timeout", str(peer_timeout))
    try:
        served.procs[0].send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        code = served.procs[1].wait(timeout=peer_timeout + 30)
        elapsed = time.monotonic() - stopped
        stderr = served.procs[1].stderr.read()
    finally:
        served.close()  # SIGKILL ends a stopped process too
    assert code == 1, stderr[-2000:]
    assert "lost process 0 of 2" in stderr
    assert elapsed < peer_timeout + 10  # JAX's own timeout is peer_timeout + 10 here
    print(f"\nthe follower exited {elapsed:.1f}s after process 0 froze")
