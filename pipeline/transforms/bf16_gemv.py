"""bf16_gemv: bfloat16 linears on CPU run through `pipeline::bf16_linear`, whose decode-size calls
(1-8 rows) take the AVX512-BF16 GEMV kernel (kernels/cpu_gemv.py) and whose prefill calls stay
F.linear (oneDNN's matmul, which GEMMs well).

Why: this CPU's bfloat16 F.linear reads a decode step's weights at 26-33 GB/s, about half of what
a reduction reads here, and a bfloat16 decode step of mistral3 ran at 90-95 % of that rate
(`make bench`, 2026-12-01). Scope subgraph and model as onednn_linear (linear_route.py). Where the
kernel cannot be built (no AVX512-BF16, no compiler), nothing is rewritten and the history's
unmatched list says why.
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
