"""bf16_gemv: bfloat16 linears on CPU run through `pipeline::bf16_linear`, which takes the GEMV
kernel (kernels/cpu_gemv.py) where it measured faster than F.linear: single rows where oneDNN's
bf16 matmul runs (an AVX512-BF16 host; more rows stay with oneDNN, which GEMMs well), decode-size
calls (up to 8 rows) where PyTorch's bf16 matmul falls back to ATen's loops (an AVX2-only host);
prefills stay F.linear (cpu_gemv.py says why).

Why: where oneDNN's bfloat16 matmul runs, F.linear reads a decode step's weights well below what a
plain reduction reads; where it does not (AVX2 only), ATen's loops read them at a fraction of it
(BENCHMARKS.md, decode in bfloat16). Scope subgraph and model as onednn_linear (linear_route.py).
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
