"""Known GPUs: memory and peak dense bf16 throughput, for the memory plan and MFU.

Figures from NVIDIA's data sheets (SXM parts, dense bf16 tensor-core peak, without sparsity):
A100 312 TFLOP/s (40 or 80 GB), H100 989 TFLOP/s (80 GB), H200 989 TFLOP/s (141 GB).
"""

from __future__ import annotations

from raytrain_ft.core.config import ScalingSection

# gpu_type -> (memory in GiB, peak dense bf16 TFLOP/s); keys = raytrain_ft.core.config.GPU_TYPES
GPUS: dict[str, tuple[float, float]] = {
    "A100-40GB": (40.0, 312.0),
    "A100-80GB": (80.0, 312.0),
    "H100": (80.0, 989.0),
    "H200": (141.0, 989.0),
}


def device_memory_gib(s: ScalingSection) -> float:
    return GPUS[s.gpu_type][0]


def peak_flops_per_device(s: ScalingSection) -> float:
    """FLOP/s: `scaling.peak_tflops_per_device`, or the `scaling.gpu_type`'s peak when it is 0."""
    return 1e12 * (s.peak_tflops_per_device or GPUS[s.gpu_type][1])
