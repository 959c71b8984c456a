"""fuse_add_rmsnorm: a residual add and the RMSNorm that reads it become pipeline::add_rms_norm."""

from __future__ import annotations

import torch
from torch import nn
from transform_helpers import apply


def test_fuse_add_rmsnorm_only_where_the_sum_is_not_needed_sooner():
    """Fused: a residual add read by the norm and later; not fused: the sum read before the norm (the
    fused node stands at the norm), or an add that broadcasts."""
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm

    class Residual(nn.Module):
        def __init__(self, early_reader: bool):
            super().__init__()
            self.norm, self.early_reader = MistralRMSNorm(8), early_reader

        def forward(self, x, residual):  # [B, S, 8], [B, S, 8] or a broadcast [8]
            total = x + residual
            early = total * 2 if self.early_reader else total
            return self.norm(total) + early

    x = torch.randn(2, 3, 8)
    for module, residual, fused in (
        (Residual(False), torch.randn(2, 3, 8), 1),
        (Residual(True), torch.randn(2, 3, 8), 0),
        (Residual(False), torch.randn(8), 0),
    ):
        with torch.no_grad():
            module.norm.weight.uniform_(0.5, 1.5)
        gm = torch.export.export(module, (x, residual)).module()
        apply("cleanup", gm)  # as the default list runs
        assert apply("match_rmsnorm", gm) == 1
        assert apply("fuse_add_rmsnorm", gm) == fused
        torch.testing.assert_close(gm(x, residual), module(x, residual), rtol=0, atol=1e-6)
