"""onednn_linear: float32 linears on CPU run through oneDNN's inner product instead of F.linear.

Why: on the CPU build of torch F.linear goes to MKL's GEMM with the weight transposed, which at
decode sizes reads a [N, K] weight at a fraction of the memory bandwidth on some hosts, and runs
prefill GEMMs slower too; oneDNN reads the plain [N, K] layout. Not on every host: on others MKL
reads the weights faster at one and two rows, so a decode-size call runs whichever of the two was
timed faster for its shape (kernels/linear_choice.py). The figures are in BENCHMARKS.md (decode,
"demollm F.linear").

Scope subgraph: every `aten.linear` in a captured graph; scope model: the eager `nn.Linear`
modules outside the graphs (linear_route.py). The default runs both. Only float32 weights on CPU:
elsewhere F.linear already runs the better kernel (see `takes`; bfloat16: bf16_gemv).
"""

from __future__ import annotations

import torch

from pipeline import ops  # noqa: F401  (registers pipeline::onednn_linear)
from pipeline.transforms.linear_route import LinearRoute, OpLinear
from pipeline.transforms.registry import register


class OneDNNLinear(OpLinear):
    op = torch.ops.pipeline.onednn_linear.default


@register
class OneDNNLinearTransform(LinearRoute):
    name = "onednn_linear"
    module = OneDNNLinear

    @staticmethod
    def takes(weight: torch.Tensor | None) -> bool:
        """float32 weights on CPU. bfloat16's F.linear already runs oneDNN (its matmul primitive),
        measured a little faster than the inner product at decode sizes (mistral3's lm_head at
        batch 4: 40.8 vs 44.2 ms)."""
        return (
            weight is not None
            and weight.device.type == "cpu"
            and weight.dim() == 2
            and weight.dtype == torch.float32
        )

    @staticmethod
    def unavailable() -> str:
        return "" if torch.backends.mkldnn.is_available() else "this torch build has no oneDNN (mkldnn)"
