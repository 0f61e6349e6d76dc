"""Weight bytes in memory against the tensor bytes of the GGUF file they were loaded from, and the
format each kept kernel is held in.

    .venv/bin/python scripts/weight_bytes.py --model gemma-3-270m --platform cpu --native

Loads the model as an engine on `--platform` would (`--quantization`, default auto; `--native`:
with native kernels, which on the CPU keep what the LM head reads in the file's blocks), on this
machine's CPU, and prints the file's tensor bytes by block type, the loaded weights' bytes and
their ratio, then one line per quantized kernel: bits, group, minimums, scale dtype (and super
group), code offset and bytes. docs/models.md#quantized-weights quotes it.
"""

from __future__ import annotations

import argparse
import collections

from meshserve.model import gguf_reader
from meshserve.model.loading.hub import resolve_model
from meshserve.model.loading.pretrained import _read, scheme_plans
from meshserve.model.quant_formats import SCHEMES, describe
from meshserve.model.quantized_weights import quantized_arrays, weight_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--platform", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument("--native", action="store_true")
    parser.add_argument("--quantization", default="auto", choices=SCHEMES)
    args = parser.parse_args()
    files = resolve_model(args.model)
    if files.kind != "gguf":
        parser.error(f"{args.model} is not a GGUF file")
    tensors = gguf_reader.open_gguf(files.path).tensors.values()
    by_type = collections.Counter()
    for tensor in tensors:
        by_type[tensor.ggml_type.name] += tensor.data.nbytes
    file_bytes = sum(by_type.values())
    print(f"file tensors: {file_bytes:,} bytes ("
          + ", ".join(f"{name} {size:,}" for name, size in by_type.most_common()) + ")")
    plans = scheme_plans(args.quantization, platform=args.platform, native=args.native)
    model = _read(files, "float32", plans, None)
    loaded = weight_bytes(model)
    print(f"loaded weights: {loaded:,} bytes, {loaded / file_bytes:.3f}x the file's tensors")
    for key, q in quantized_arrays(model).items():
        print(f"  {key}: {describe(q.format)}: {q.nbytes:,} bytes")


if __name__ == "__main__":
    main()
