"""bf16_gemv: bfloat16 linears on CPU run through `pipeline::bf16_linear`, which takes the GEMV
kernel (kernels/cpu_gemv.py) where it measured faster than F.linear: single rows where oneDNN's
bf16 matmul runs (an AVX512-BF16 host; more rows stay with oneDNN, which GEMMs well), decode-size
calls (up to 8 rows) where PyTorch's bf16 matmul falls back to ATen's loops (an AVX2-only host);
prefills stay F.linear (cpu_gemv.py says why).

Why: on the AVX512-BF16 host, F.linear read a decode step's weights at 26-33 GB/s, about half of
what a reduction read, and a bfloat16 decode step of mistral3 ran at 90-95 % of that rate (`make
bench`, 2026-12-01); on the AVX2-only host F.linear reads 11 GB/s at one row and 2.9 at four where
a reduction reads 21 (2026-12-02). Scope subgraph and model as onednn_linear (linear_route.py).
Where the kernel cannot be built (no AVX2 with FMA, no compiler), nothing is rewritten and the
history's unmatched list says why.
"""

from __future__ import annotations

import torch

from pipeline import ops  # noqa: F401  (registers pipeline::bf16_linear)
from pipeline.kernels import cpu_gemv
from pipeline.transforms.linear_route import LinearRoute, OpLinear
from pipeline.transforms.registry import register


class BF16Linear(OpLinear):
    op = torch.ops.pipeline.bf16_linear.default


@register
class BF16GemvTransform(LinearRoute):
    name = "bf16_gemv"
    module = BF16Linear

    @staticmethod
    def takes(weight: torch.Tensor | None) -> bool:
        return (
            weight is not None
            and weight.device.type == "cpu"
            and weight.dim() == 2
            and weight.dtype == torch.bfloat16
        )

    @staticmethod
    def unavailable() -> str:
        return cpu_gemv.unsupported()
