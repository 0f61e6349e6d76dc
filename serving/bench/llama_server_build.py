"""Build llama.cpp's `llama-server` (and `llama-batched-bench`) from source, once per machine,
and prove that what was built runs.

The source is the llama.cpp tree vendored in llama-cpp-python's sdist on PyPI
(`LLAMA_CPP_SDIST`), fetched with `pip download` like every other file meshserve takes from
PyPI; nothing prebuilt is downloaded. It is configured with cmake for this CPU (`-DGGML_NATIVE=ON`)
and static libraries, so each binary stands alone, and only `BUILD_TARGETS` are compiled.

A native build can compile in a CPU feature that then crashes: on some CPUs that report AMX,
llama.cpp built with it dies by SIGSEGV or SIGILL on its first decode. So each build is
smoke-tested (one short real decode of the model being benchmarked, `smoke_test`), and
`BUILD_VARIANTS` is an ordered list of ways to build, each adding C/C++ flags to
`CMAKE_OPTIONS`: the first is the plain native build, each next one turns off a feature known
to crash. A build that dies by a
signal in its smoke test falls back to the next variant; one that passes is used.

Invariants:
* Layout: `<cache>/llama-server/<key>/<variant>/bin/` holds each variant's binaries and
  `<variant>/build.log` its last build's log; `<key>/build.json` (`RECORD_NAME`) records every
  attempt (cmake options, extra C/C++ flags, the smoke test's command and outcome, the signal)
  and the variant in use. `<cache>` is meshserve's cache root (`meshserve.model.loading.hub.cache_root`)
  and `<key>` the sdist version, the machine and a digest of the CPU's feature flags (a native
  build may not run on another CPU).
* A binary is used only when the record names its variant as passed with the variant's current
  flags, so a build that crashed, a build from before smoke tests (`<key>/bin/`) or one built
  with other flags is never reused. A crashed variant's binaries are deleted and it is not built
  again under this key; a variant added to `BUILD_VARIANTS` later is tried on the next call.
* A binary in place is always complete: each is copied under a temporary name and renamed into
  place, the server last; the record is written the same way.
* One build at a time per key: `ensure_built` holds an exclusive `flock` on `<key>.lock` while it
  checks, builds and smoke-tests, so a second caller waits, then finds the record and returns.
* Every failure is a `PeerUnavailable`, so `meshserve bench` records the reason and carries on:
  missing build tools `BuildToolsMissing`; a failed download or build `BuildFailed` with the tail
  of `build.log`; a smoke test that fails without a signal (the model does not load)
  `SmokeTestFailed`; every variant dying by a signal `EveryBuildCrashed`, naming each variant's
  flags and signal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from meshserve.model.loading.hub import cache_root
from meshserve.serving.bench.peers import NO_AMX_FLAGS, PeerUnavailable

LLAMA_CPP_SDIST_VERSION = "0.3.36"
LLAMA_CPP_SDIST = f"llama-cpp-python=={LLAMA_CPP_SDIST_VERSION}"
BUILD_TARGETS = ("llama-server", "llama-batched-bench")
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",            # this CPU's vector extensions, as a user building it here gets
    "-DBUILD_SHARED_LIBS=OFF",     # the binaries stand alone, so they can be moved into the cache
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",   # models are local files; no network code
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
)
RECORD_NAME = "build.json"
RECORD_FORMAT = 1
LOG_TAIL_LINES = 30
SMOKE_TAIL_LINES = 12
SMOKE_TIMEOUT_S = 300.0
# One short real decode: an 8-token prompt and 2 generated tokens, one sequence.
SMOKE_DECODE_ARGS = ("-c", "64", "-b", "32", "-ub", "32", "-npp", "8", "-ntg", "2", "-npl", "1")


@dataclasses.dataclass(frozen=True)
class BuildVariant:
    """One way to build: `CMAKE_OPTIONS`, plus `flags` added to both CMAKE_C_FLAGS and
    CMAKE_CXX_FLAGS. `name` is the variant's directory under the build key."""

    name: str
    flags: tuple[str, ...] = ()
    reason: str = ""

    def __post_init__(self):
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", self.name):
            raise ValueError(f"BuildVariant name must be lowercase letters, digits and '-', "
                             f"got {self.name!r}")

    def cmake_arguments(self) -> list[str]:
        """The cmake configure options of this variant."""
        if not self.flags:
            return list(CMAKE_OPTIONS)
        joined = " ".join(self.flags)
        return [*CMAKE_OPTIONS, f"-DCMAKE_C_FLAGS={joined}", f"-DCMAKE_CXX_FLAGS={joined}"]

    def describe(self) -> str:
        return f"{self.name} ({' '.join(self.flags) or 'no extra flags'})"


# Tried in order; each next variant turns off one more feature known to crash.
BUILD_VARIANTS = (
    BuildVariant("native"),
    BuildVariant("native-no-amx", NO_AMX_FLAGS,
                 reason="on some CPUs that report AMX, llama.cpp built with it dies by SIGSEGV "
                        "or SIGILL on its first decode"),
)


class BuildToolsMissing(PeerUnavailable):
    """cmake or a C/C++ compiler is not on PATH."""


class BuildFailed(PeerUnavailable):
    """The sdist could not be fetched, or cmake failed; the message ends with the log's tail."""


class SmokeTestFailed(PeerUnavailable):
    """A built binary could not run its short decode, without dying by a signal (the model does
    not load, or it ran past `SMOKE_TIMEOUT_S`); its binaries are kept and tested again next
    time."""


class EveryBuildCrashed(PeerUnavailable):
    """Every variant in `BUILD_VARIANTS` died by a signal in its smoke test."""


@dataclasses.dataclass(frozen=True)
class SmokeTest:
    """The outcome of running a build: "passed", "crashed" (a step died by a signal) or
    "failed" (a step exited with another status, or timed out); one entry per step run."""

    outcome: str
    steps: tuple[dict[str, Any], ...]

    @property
    def signal(self) -> str | None:
        return next((s["signal"] for s in self.steps if s.get("signal")), None)

    def to_json(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "signal": self.signal, "steps": list(self.steps)}


def build_directory(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where this machine's builds live: `<cache>/llama-server/<version>-<machine>-<cpu digest>`."""
    key = f"{LLAMA_CPP_SDIST_VERSION}-{platform.machine()}-{_cpu_digest()}"
    return cache_root(cache_dir) / "llama-server" / key


def binary_path(name: str, variant: BuildVariant,
                cache_dir: str | os.PathLike | None = None) -> Path:
    """The path `name` (one of `BUILD_TARGETS`) has once `variant` is built; it may not exist."""
    if name not in BUILD_TARGETS:
        raise ValueError(f"{name!r} is not built; choose one of {', '.join(BUILD_TARGETS)}")
    return _bin_directory(build_directory(cache_dir), variant) / name


def cached_binary(name: str = "llama-server",
                  cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The binary of the variant whose smoke test passed, if it is in the cache; else None
    (nothing is built or run)."""
    variant = _passed_variant(build_directory(cache_dir))
    if variant is None:
        return None
    path = binary_path(name, variant, cache_dir)
    return path if _is_complete(path) else None


def build_info(cache_dir: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """What the binaries in use were built with, for a result file: the sdist, the variant, the
    cmake options, the extra C and C++ flags, the smoke test, and each attempt's outcome. None
    when nothing passed a smoke test yet."""
    directory = build_directory(cache_dir)
    record, variant = _read_record(directory), _passed_variant(directory)
    if record is None or variant is None:
        return None
    used = _attempt(record, variant)
    return {
        "sdist": record["sdist"], "directory": str(directory), "variant": variant.name,
        "cmake_options": used["cmake_options"], "c_flags": used["c_flags"],
        "cxx_flags": used["cxx_flags"],
        "smoke_test": {k: used["smoke_test"][k] for k in ("outcome", "signal")}
        | {"command": used["smoke_test"]["steps"][-1]["command"]},
        "attempts": [{"variant": a["variant"], "c_flags": a["c_flags"],
                      "outcome": a["smoke_test"]["outcome"], "signal": a["smoke_test"]["signal"]}
                     for a in record["attempts"]],
    }


def missing_build_tools() -> list[str]:
    """The build tools not found on PATH (cmake, a C compiler, a C++ compiler); empty when all
    are there. `CC`/`CXX` name the compilers when set, as cmake reads them."""
    compilers = {"a C compiler": (os.environ.get("CC"), "cc", "gcc", "clang"),
                 "a C++ compiler": (os.environ.get("CXX"), "c++", "g++", "clang++")}
    missing = [] if shutil.which("cmake") else ["cmake"]
    for what, names in compilers.items():
        if not any(name and shutil.which(name) for name in names):
            missing.append(what)
    return missing


def ensure_built(cache_dir: str | os.PathLike | None = None, *, model: str | os.PathLike,
                 log: Callable[[str], None] = print, jobs: int | None = None) -> Path:
    """The path of a `llama-server` whose build passed its smoke test, building and testing
    each of `BUILD_VARIANTS` in turn unless one is cached (each build takes minutes).
    `model` (a GGUF file) is what the smoke test decodes."""
    cached = cached_binary("llama-server", cache_dir)
    if cached is not None:
        return cached
    directory = build_directory(cache_dir)
    directory.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(directory.parent / f"{directory.name}.lock", log):
        return _first_variant_that_runs(directory, Path(model), log=log,
                                        jobs=jobs or len(os.sched_getaffinity(0)))


def smoke_test(bin_directory: Path, model: Path, *, threads: int | None = None,
               timeout: float = SMOKE_TIMEOUT_S) -> SmokeTest:
    """Runs the built binaries: `llama-server --version` (it starts), then `llama-batched-bench`
    decoding 2 tokens after an 8-token prompt of `model` (the same static ggml CPU code as the
    server's decode). Stops at the first step that does not exit 0."""
    threads = threads or len(os.sched_getaffinity(0))
    commands = ([str(bin_directory / "llama-server"), "--version"],
                [str(bin_directory / "llama-batched-bench"), "-m", str(model),
                 *SMOKE_DECODE_ARGS, "-t", str(threads)])
    steps: list[dict[str, Any]] = []
    for command in commands:
        step = _run_step(command, timeout)
        steps.append(step)
        if step["signal"]:
            return SmokeTest("crashed", tuple(steps))
        if step["timed_out"] or step["returncode"] != 0:
            return SmokeTest("failed", tuple(steps))
    return SmokeTest("passed", tuple(steps))


def describe_exit(returncode: int) -> str:
    """A death by a signal as "died of SIGSEGV (signal 11)", else "exited with status N"."""
    if returncode < 0:
        return f"died of {signal_name(-returncode)} (signal {-returncode})"
    return f"exited with status {returncode}"


def signal_name(number: int) -> str:
    """The signal's name (SIGSEGV for 11), or "signal N" for a number without one."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _first_variant_that_runs(directory: Path, model: Path, *, log: Callable[[str], None],
                             jobs: int) -> Path:
    """Under the lock: the first variant, in order, that passes its smoke test. A variant is
    built only when its binaries are missing; one that crashed is deleted and never built or
    tested again; one that failed otherwise stops the search and is tested again next time."""
    record = _read_record(directory) or _new_record()
    for variant in BUILD_VARIANTS:
        attempt = _attempt(record, variant)
        outcome = attempt["smoke_test"]["outcome"] if attempt else None
        bin_directory = _bin_directory(directory, variant)
        if outcome == "crashed":
            continue
        complete = all(_is_complete(bin_directory / name) for name in BUILD_TARGETS)
        if outcome == "passed" and complete:
            return bin_directory / "llama-server"  # another process built it while we waited
        if not complete:
            _build_variant(directory, variant, log=log, jobs=jobs)
        result = smoke_test(bin_directory, model)
        _set_attempt(record, variant, result, model)
        _write_record(directory, record)
        if result.outcome == "passed":
            log(f"llama-server built as {variant.describe()} passed its smoke test on {model}")
            return bin_directory / "llama-server"
        last = result.steps[-1]
        if result.outcome == "failed":
            raise SmokeTestFailed(
                f"llama.cpp built as {variant.describe()} could not run a short decode of "
                f"{model}: {_describe_step(last)}; its output:\n{last['output_tail']}")
        shutil.rmtree(bin_directory, ignore_errors=True)  # never to be used
        log(f"llama.cpp built as {variant.describe()}: {_describe_step(last)} in its smoke "
            "test; trying the next build")
    raise EveryBuildCrashed(_crash_summary(directory, record, model))


def _crash_summary(directory: Path, record: dict[str, Any], model: Path) -> str:
    tried = "; ".join(
        f"{a['variant']} with C/C++ flags '{' '.join(a['c_flags']) or '(none)'}': "
        f"{a['smoke_test']['signal'] or a['smoke_test']['outcome']}"
        for a in record["attempts"])
    return (f"every llama.cpp build died by a signal in its smoke test (a short decode of "
            f"{model}): {tried}. The record is {directory / RECORD_NAME}; delete {directory} "
            "to build again")


def _build_variant(directory: Path, variant: BuildVariant, *, log: Callable[[str], None],
                   jobs: int) -> None:
    """Fetches the source and builds `BUILD_TARGETS` into `<directory>/<variant>/bin/`."""
    missing = missing_build_tools()
    if missing:
        raise BuildToolsMissing(f"building llama-server needs {', '.join(missing)}, not found "
                                "on PATH; install them (e.g. apt-get install cmake g++)")
    variant_directory = directory / variant.name
    variant_directory.mkdir(parents=True, exist_ok=True)
    log_path = variant_directory / "build.log"
    log(f"building llama-server from {LLAMA_CPP_SDIST}'s sdist as {variant.describe()} into "
        f"{variant_directory} ({jobs} jobs, about 9 minutes on 2 cores); log: {log_path}")
    with tempfile.TemporaryDirectory(prefix=".build-", dir=variant_directory) as work, \
            log_path.open("w") as log_file:
        work_dir = Path(work)
        source = _fetch_source(work_dir, log_file, log_path)
        build = work_dir / "build"
        _run([_cmake(), "-S", str(source), "-B", str(build), *variant.cmake_arguments()],
             log_file, log_path, "cmake could not configure llama.cpp")
        _run([_cmake(), "--build", str(build), "--parallel", str(jobs),
              "--target", *BUILD_TARGETS], log_file, log_path, "cmake could not build llama.cpp")
        # llama-server last: its presence is what a complete build is checked by.
        for name in sorted(BUILD_TARGETS, key=lambda n: n == "llama-server"):
            _install(build / "bin" / name, _bin_directory(directory, variant) / name)
    log(f"built {_bin_directory(directory, variant) / 'llama-server'}")


def _bin_directory(directory: Path, variant: BuildVariant) -> Path:
    return directory / variant.name / "bin"


# -- the record ------------------------------------------------------------------------------------

def _new_record() -> dict[str, Any]:
    return {"format": RECORD_FORMAT, "sdist": LLAMA_CPP_SDIST, "machine": platform.machine(),
            "cpu_flags_digest": _cpu_digest(), "variant": None, "attempts": []}


def _read_record(directory: Path) -> dict[str, Any] | None:
    """The record, or None when there is none or it is from another format (then every
    variant is built again)."""
    try:
        record = json.loads((directory / RECORD_NAME).read_text())
    except (OSError, ValueError):
        return None
    return record if record.get("format") == RECORD_FORMAT else None


def _write_record(directory: Path, record: dict[str, Any]) -> None:
    partial = directory / f".{RECORD_NAME}.partial"
    partial.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(partial, directory / RECORD_NAME)


def _attempt(record: dict[str, Any], variant: BuildVariant) -> dict[str, Any] | None:
    """The record's attempt at `variant`, if it was built with the variant's current options
    and flags (an attempt with others says nothing of this build)."""
    return next((a for a in record["attempts"] if a["variant"] == variant.name
                 and a["cmake_options"] == list(CMAKE_OPTIONS)
                 and a["c_flags"] == a["cxx_flags"] == list(variant.flags)), None)


def _set_attempt(record: dict[str, Any], variant: BuildVariant, result: SmokeTest,
                 model: Path) -> None:
    attempt = {"variant": variant.name, "reason": variant.reason,
               "cmake_options": list(CMAKE_OPTIONS), "c_flags": list(variant.flags),
               "cxx_flags": list(variant.flags), "cmake_arguments": variant.cmake_arguments(),
               "smoke_test": result.to_json() | {"model": str(model),
                                                 "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}}
    record["attempts"] = [a for a in record["attempts"] if a["variant"] != variant.name]
    record["attempts"].append(attempt)
    record["variant"] = variant.name if result.outcome == "passed" else record["variant"]


def _passed_variant(directory: Path) -> BuildVariant | None:
    """The variant the record names as in use, if its attempt with the current flags passed."""
    record = _read_record(directory)
    if record is None:
        return None
    for variant in BUILD_VARIANTS:
        attempt = _attempt(record, variant)
        if (variant.name == record["variant"] and attempt
                and attempt["smoke_test"]["outcome"] == "passed"):
            return variant
    return None


# -- running things --------------------------------------------------------------------------------

def _run_step(command: list[str], timeout: float) -> dict[str, Any]:
    """One smoke-test step: its command, exit status (None when it ran past `timeout` and was
    killed), signal (None unless it died by one), seconds, and the tail of its output."""
    start = time.monotonic()
    with tempfile.TemporaryFile("w+", errors="replace") as output:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=output,
                                   stderr=subprocess.STDOUT)
        try:
            returncode: int | None = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            returncode = None
        output.seek(0)
        lines = output.read().splitlines()
    return {"command": command, "returncode": returncode,
            "signal": signal_name(-returncode) if returncode and returncode < 0 else None,
            "timed_out": returncode is None, "seconds": round(time.monotonic() - start, 3),
            "output_tail": "\n".join(lines[-SMOKE_TAIL_LINES:])}


def _describe_step(step: dict[str, Any]) -> str:
    name = Path(step["command"][0]).name
    if step["timed_out"]:
        return f"{name} ran past {SMOKE_TIMEOUT_S:.0f} s and was stopped"
    return f"{name} {describe_exit(step['returncode'])}"


def _fetch_source(work_dir: Path, log_file, log_path: Path) -> Path:
    """Download the sdist (no dependencies, never installed) and unpack its vendored llama.cpp."""
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
          "--disable-pip-version-check", LLAMA_CPP_SDIST, "-d", str(work_dir)],
         log_file, log_path, f"pip could not download the {LLAMA_CPP_SDIST} sdist from PyPI")
    sdists = list(work_dir.glob("*.tar.gz"))
    if len(sdists) != 1:
        raise BuildFailed(f"pip download of {LLAMA_CPP_SDIST} left {len(sdists)} sdists in "
                          f"{work_dir}, expected one")
    prefix = f"{sdists[0].name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
    with tarfile.open(sdists[0]) as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
        if not members:
            raise BuildFailed(f"{sdists[0].name} has no {prefix}; {LLAMA_CPP_SDIST} no longer "
                              "vendors llama.cpp")
        archive.extractall(work_dir, members=members, filter="data")
    return work_dir / prefix


def _run(command: list[str], log_file, log_path: Path, failure: str) -> None:
    log_file.write(f"$ {' '.join(command)}\n")
    log_file.flush()
    result = subprocess.run(command, stdout=log_file, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        log_file.flush()
        raise BuildFailed(f"{failure} (exit status {result.returncode}); the last "
                          f"{LOG_TAIL_LINES} lines of {log_path}:\n{_tail(log_path)}")


def _tail(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-LOG_TAIL_LINES:])


def _install(built: Path, target: Path) -> None:
    if not built.is_file():
        raise BuildFailed(f"cmake finished but left no {built}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    shutil.copy2(built, partial)
    partial.chmod(0o755)
    os.replace(partial, target)


def _is_complete(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _cmake() -> str:
    cmake = shutil.which("cmake")
    assert cmake is not None, "missing_build_tools() is checked first"
    return cmake


@contextlib.contextmanager
def _exclusive_lock(path: Path, log: Callable[[str], None]) -> Iterator[None]:
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another process building llama-server ({path})")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _cpu_digest() -> str:
    """8 hex digits of the CPU's feature flags (from /proc/cpuinfo where there is one)."""
    flags = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = " ".join(sorted(line.partition(":")[2].split()))
                break
    return hashlib.sha256(flags.encode()).hexdigest()[:8]
