"""Build llama.cpp's `llama-server` (and `llama-batched-bench`) from source, once per machine.

The source is the llama.cpp tree vendored in llama-cpp-python's sdist on PyPI
(`LLAMA_CPP_SDIST`), fetched with `pip download` like every other file meshserve takes from
PyPI; nothing prebuilt is downloaded. It is configured with cmake for this CPU (`-DGGML_NATIVE=ON`)
and static libraries, so each binary stands alone, and only `BUILD_TARGETS` are compiled.

Invariants:
* The binaries live in `<cache>/llama-server/<key>/bin/`, `<cache>` being meshserve's cache root
  (`meshserve.model.hub.cache_root`) and `<key>` the sdist version, the machine and a digest of
  the CPU's feature flags (a native build may not run on another CPU). A binary there is always
  complete: each is copied under a temporary name and renamed into place, the server last.
* One build at a time per key: `ensure_built` holds an exclusive `flock` on `<key>.lock` while it
  checks and builds, so a second caller waits, then finds the binaries and returns.
* Missing build tools raise `BuildToolsMissing`, a failed download or build `BuildFailed` with the
  tail of `<key>/build.log`; both are `PeerUnavailable`, so `meshserve bench` records the reason
  and carries on. The log of the last build stays beside the binaries.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from meshserve.model.hub import cache_root
from meshserve.serving.bench.peers import PeerUnavailable

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
LOG_TAIL_LINES = 30


class BuildToolsMissing(PeerUnavailable):
    """cmake or a C/C++ compiler is not on PATH."""


class BuildFailed(PeerUnavailable):
    """The sdist could not be fetched, or cmake failed; the message ends with the log's tail."""


def build_directory(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where this machine's build lives: `<cache>/llama-server/<version>-<machine>-<cpu digest>`."""
    key = f"{LLAMA_CPP_SDIST_VERSION}-{platform.machine()}-{_cpu_digest()}"
    return cache_root(cache_dir) / "llama-server" / key


def binary_path(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The path `name` (one of `BUILD_TARGETS`) has once built; it may not exist yet."""
    if name not in BUILD_TARGETS:
        raise ValueError(f"{name!r} is not built; choose one of {', '.join(BUILD_TARGETS)}")
    return build_directory(cache_dir) / "bin" / name


def cached_binary(name: str = "llama-server",
                  cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The built binary if it is in the cache, else None (nothing is built)."""
    path = binary_path(name, cache_dir)
    return path if _is_complete(path) else None


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


def ensure_built(cache_dir: str | os.PathLike | None = None, *,
                 log: Callable[[str], None] = print, jobs: int | None = None) -> Path:
    """The path of `llama-server`, built first (about 9 minutes on 2 cores) unless cached."""
    server = binary_path("llama-server", cache_dir)
    if all(_is_complete(binary_path(name, cache_dir)) for name in BUILD_TARGETS):
        return server
    missing = missing_build_tools()
    if missing:
        raise BuildToolsMissing(f"building llama-server needs {', '.join(missing)}, not found "
                                "on PATH; install them (e.g. apt-get install cmake g++)")
    directory = build_directory(cache_dir)
    directory.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(directory.parent / f"{directory.name}.lock", log):
        if not all(_is_complete(binary_path(name, cache_dir)) for name in BUILD_TARGETS):
            _build(directory, log=log, jobs=jobs or len(os.sched_getaffinity(0)))
    return server


def _build(directory: Path, *, log: Callable[[str], None], jobs: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    log_path = directory / "build.log"
    log(f"building llama-server from {LLAMA_CPP_SDIST}'s sdist into {directory} "
        f"({jobs} jobs, about 9 minutes on 2 cores); log: {log_path}")
    with tempfile.TemporaryDirectory(prefix=".build-", dir=directory) as work, \
            log_path.open("w") as log_file:
        work_dir = Path(work)
        source = _fetch_source(work_dir, log_file, log_path)
        build = work_dir / "build"
        _run([_cmake(), "-S", str(source), "-B", str(build), *CMAKE_OPTIONS],
             log_file, log_path, "cmake could not configure llama.cpp")
        _run([_cmake(), "--build", str(build), "--parallel", str(jobs),
              "--target", *BUILD_TARGETS], log_file, log_path, "cmake could not build llama.cpp")
        # llama-server last: its presence is what `cached_binary` and the test look for.
        for name in sorted(BUILD_TARGETS, key=lambda n: n == "llama-server"):
            _install(build / "bin" / name, directory / "bin" / name)
    log(f"built {directory / 'bin' / 'llama-server'}")


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
