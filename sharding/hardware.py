"""Accelerator specs for the mesh planner: peak rates, memory and links, each from a public source.

A `HardwareSpec` holds what the planner's cost model reads, per device, in SI units:

    flops          peak dense 16-bit (bf16/fp16) matmul FLOP/s: datasheets that quote "with
                   sparsity" figures are halved
    f32_flops      peak float32 FLOP/s, or None where no figure is published (then float32 is not
                   planned on it)
    hbm_bw         HBM bytes/s
    hbm            HBM bytes (datasheet GB, 1e9)
    link_bw        bytes/s the device can send within its node (NVLink, ICI), one direction:
                   datasheets quote the two directions added up, which is halved here, since a
                   ring collective sends one way while it receives the other
    per_node       devices that link joins (an NVLink node; for TPUs, the ICI pod)
    inter_node_bw  bytes/s per device, one direction, between nodes (the node's network cards
                   divided over its devices), or None for a single node

Peak figures are upper bounds: real kernels reach a fraction of them, and the planner says so.
A spec is either one of `HARDWARE` by name or given in full, `HardwareSpec.parse("flops=...,...")`.

This module imports neither jax nor numpy.
"""

from __future__ import annotations

import dataclasses

SIXTEEN_BIT_DTYPES = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    name: str = "custom"
    flops: float
    hbm_bw: float
    hbm: float
    link_bw: float
    per_node: int
    inter_node_bw: float | None = None
    f32_flops: float | None = None

    def __post_init__(self):
        for field in ("flops", "hbm_bw", "hbm", "link_bw"):
            _check_positive(field, getattr(self, field))
        for field in ("inter_node_bw", "f32_flops"):
            if getattr(self, field) is not None:
                _check_positive(field, getattr(self, field))
        if isinstance(self.per_node, bool) or not isinstance(self.per_node, int) \
                or self.per_node < 1:
            raise ValueError(f"hardware per_node must be an int >= 1 (devices the fast link "
                             f"joins), got {self.per_node!r}")

    @classmethod
    def parse(cls, text: str) -> "HardwareSpec":
        """`"flops=989e12,hbm_bw=3.35e12,hbm=80e9,link_bw=450e9,per_node=8"` -> a spec; the
        optional keys are `inter_node_bw`, `f32_flops` and `name`."""
        known = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, object] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = (s.strip() for s in part.partition("="))
            if not sep or key not in known:
                raise ValueError(f"bad hardware {text!r}: expected comma-separated KEY=VALUE "
                                 f"with KEY in {sorted(known)}, e.g. "
                                 f"'flops=989e12,hbm_bw=3.35e12,hbm=80e9,link_bw=450e9,"
                                 f"per_node=8'")
            if key in values:
                raise ValueError(f"bad hardware {text!r}: {key} is given twice")
            values[key] = _parse_value(text, key, value)
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING and f.name not in values)
        if missing:
            raise ValueError(f"bad hardware {text!r}: give {', '.join(missing)} as well")
        return cls(**values)

    def peak_flops(self, dtype: str) -> float:
        """The matmul rate for weights and activations of `dtype`."""
        if dtype in SIXTEEN_BIT_DTYPES:
            return self.flops
        if self.f32_flops is None:
            raise ValueError(f"hardware {self.name} has no float32 rate; plan bfloat16, or give "
                             f"f32_flops in a custom spec")
        return self.f32_flops


def _check_positive(field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"hardware {field} must be a number > 0, got {value!r}")


def _parse_value(text: str, key: str, value: str):
    if key == "name":
        return value
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"bad hardware {text!r}: {key} must be a number like 80e9, "
                         f"got {value!r}") from None
    if key == "per_node":
        if number != int(number):
            raise ValueError(f"bad hardware {text!r}: per_node must be a whole number, "
                             f"got {value!r}")
        return int(number)
    return number


HARDWARE: dict[str, HardwareSpec] = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM column
    # (https://www.nvidia.com/en-us/data-center/h100/): BF16 Tensor Core 1,979 TFLOPS with
    # sparsity, FP32 67 TFLOPS, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s. Between nodes: the
    # NVIDIA DGX H100 datasheet, 8 single-port ConnectX-7 at 400 Gb/s, one per GPU.
    "h100-sxm": HardwareSpec(name="h100-sxm", flops=989.5e12, f32_flops=67e12, hbm_bw=3.35e12,
                             hbm=80e9, link_bw=450e9, per_node=8, inter_node_bw=50e9),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM column
    # (https://www.nvidia.com/en-us/data-center/h200/): BF16 Tensor Core 1,979 TFLOPS with
    # sparsity, FP32 67 TFLOPS, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s. Between nodes: the
    # NVIDIA DGX H200 datasheet, 8 single-port ConnectX-7 at 400 Gb/s, one per GPU.
    "h200-sxm": HardwareSpec(name="h200-sxm", flops=989.5e12, f32_flops=67e12, hbm_bw=4.8e12,
                             hbm=141e9, link_bw=450e9, per_node=8, inter_node_bw=50e9),
    # NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column
    # (https://www.nvidia.com/en-us/data-center/a100/): BF16 Tensor Core 312 TFLOPS (624 with
    # sparsity), FP32 19.5 TFLOPS, 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s. Between nodes:
    # the NVIDIA DGX A100 datasheet, 8 single-port ConnectX-6 at 200 Gb/s, one per GPU.
    "a100-80gb-sxm": HardwareSpec(name="a100-80gb-sxm", flops=312e12, f32_flops=19.5e12,
                                  hbm_bw=2.039e12, hbm=80e9, link_bw=300e9, per_node=8,
                                  inter_node_bw=25e9),
    # Google Cloud TPU v5e documentation (https://cloud.google.com/tpu/docs/v5e): 197 TFLOPs
    # bf16 per chip, 16 GB HBM2 at 819 GBps, 400 GBps bidirectional ICI per chip, 256 chips per
    # pod on ICI, 2 x 100 Gbps NICs per 8-chip host (25 Gb/s per chip). No float32 rate is
    # published: the MXUs multiply bf16.
    "tpu-v5e": HardwareSpec(name="tpu-v5e", flops=197e12, hbm_bw=819e9, hbm=16e9, link_bw=200e9,
                            per_node=256, inter_node_bw=3.125e9),
}


def hardware(spec: str | HardwareSpec) -> HardwareSpec:
    """A spec by name (`h100-sxm`), in full (`"flops=...,hbm_bw=...,..."`), or as given."""
    if isinstance(spec, HardwareSpec):
        return spec
    if spec in HARDWARE:
        return HARDWARE[spec]
    if "=" in spec:
        return HardwareSpec.parse(spec)
    raise ValueError(f"unknown hardware {spec!r}; use one of {sorted(HARDWARE)} or give it in "
                     f"full, e.g. 'flops=989e12,hbm_bw=3.35e12,hbm=80e9,link_bw=450e9,"
                     f"per_node=8'")
