"""The machine a bench ran on, recorded with its results: two runs compare only where these agree."""

from __future__ import annotations

import platform

import torch

from pipeline.kernels import cpu_gemv, host


def machine() -> dict[str, str]:
    import transformers

    return {
        "cpu": host.cpuinfo_field("model name") or platform.processor() or "unknown",
        "isa": cpu_isa(),
        "cores": str(torch.get_num_threads()),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


# The vector extensions a CPU's kernels choose between: CPUs sold under one model name differ in
# them, and bfloat16 matmul runs through oneDNN only with AVX-512 (else ATen's far slower loops).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_isa() -> str:
    """The ISA_FLAGS /proc/cpuinfo lists, and whether oneDNN runs bfloat16 here: two runs on hosts
    that differ in these ran different kernels, and their ratios do not compare."""
    flags = cpu_gemv.cpu_flags()
    bf16 = cpu_gemv.onednn_bf16()
    return " ".join([f for f in ISA_FLAGS if f in flags] + [f"onednn_bf16={'yes' if bf16 else 'no'}"])
