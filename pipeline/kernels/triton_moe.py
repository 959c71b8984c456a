"""`pipeline::moe` on CUDA: the routed experts as two grouped GEMMs over token-expert pairs, with
nothing read on the host, so CUDA graphs capture it.

The pairs are sorted by expert and each expert's run is padded to a whole block of BLOCK_M rows,
so a block of rows never mixes experts and reads one expert's weights (vLLM's fused_moe does the
same). The layout is computed with device ops into buffers of a size fixed by the shapes alone
(at most min(pairs, E) experts are hit, each padding fewer than BLOCK_M rows); blocks past the
padded end have no expert and return at once. At decode every pair is a block of its own (one
useful row of BLOCK_M: the GEMV is bound by the weight read, not by the wasted rows), and only the
routed experts' weights are read; at prefill an expert's weights are read once per block of its
tokens.

Rounding follows the op's other implementations: each GEMM accumulates in float32 and rounds
its output to the dtype, silu and the product round as the aten chain does (silu_and_mul's
kernel), Llama-4's routing weight scales the input in the dtype, and the k experts of a token
are summed in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pipeline.kernels.triton_silu_and_mul import silu_and_mul


@triton.jit
def _grouped_gemm_kernel(
    A,  # [rows of A, K]: the tokens (gate/up) or the pairs' activations (down), unit last stride
    W,  # [E, ...]: each expert's [N, K] weight, any strides
    OUT,  # [P, N] contiguous, one row per token-expert pair
    SCALE,  # [P] routing weights (read when SCALE_INPUT)
    pair_of_row,  # [max_rows] the pair each sorted row computes, P where padding
    expert_of_block,  # [max_blocks] the expert of each block of BLOCK_M rows, -1 past the end
    pairs,
    top_k,
    N,
    K,
    stride_a,
    stride_we,
    stride_wn,
    stride_wk,
    A_ROW_IS_TOKEN: tl.constexpr,  # A's row of pair p is p // top_k (else p)
    SCALE_INPUT: tl.constexpr,
    IEEE: tl.constexpr,  # float32: full-precision products, not TF32
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(expert_of_block + block)
    if expert < 0:
        return
    pair = tl.load(pair_of_row + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    valid = pair < pairs
    a_row = pair // top_k if A_ROW_IS_TOKEN else pair
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    if SCALE_INPUT:
        scale = tl.load(SCALE + pair, mask=valid, other=0.0).to(A.dtype.element_ty).to(tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    weight = W + expert.to(tl.int64) * stride_we
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        a = tl.load(
            A + a_row[:, None] * stride_a + ks[None, :], mask=valid[:, None] & (ks[None, :] < K), other=0.0
        )  # [BLOCK_M, BLOCK_K]
        if SCALE_INPUT:
            a = (a.to(tl.float32) * scale[:, None]).to(A.dtype.element_ty)
        w = tl.load(
            weight + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
            mask=(ks[:, None] < K) & (cols[None, :] < N),
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    out = OUT + pair[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


def _block_layout(flat: Tensor, experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """flat: [P] expert id per pair -> (pair_of_row [max_rows], expert_of_block [max_blocks]),
    pairs grouped by expert, each expert's run padded to a multiple of block_m; device ops only."""
    pairs = flat.numel()
    max_blocks = triton.cdiv(pairs + min(pairs, experts) * (block_m - 1), block_m)
    order = flat.argsort(stable=True)  # [P] pairs by expert
    counts = torch.bincount(flat, minlength=experts)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    first_row = padded.cumsum(0) - padded  # [E] each expert's first sorted row
    first_pair = counts.cumsum(0) - counts  # [E] its first position in `order`
    expert = flat[order]  # [P]
    row = first_row[expert] + torch.arange(pairs, device=flat.device) - first_pair[expert]  # [P]
    pair_of_row = torch.full((max_blocks * block_m,), pairs, dtype=torch.int64, device=flat.device)
    pair_of_row[row] = order
    expert_of_block = torch.full((max_blocks,), -1, dtype=torch.int64, device=flat.device)
    expert_of_block[row // block_m] = expert
    return pair_of_row, expert_of_block


def moe(
    x: Tensor,
    selected: Tensor,
    weights: Tensor,
    gate_up: Tensor,
    down: Tensor,
    transposed: bool,
    weights_on_input: bool,
) -> Tensor:
    """pipeline::moe's CUDA kernel; arguments as the op's (ops.py)."""
    tokens, top_k = selected.shape
    pairs = tokens * top_k
    experts, hidden = gate_up.shape[0], x.shape[-1]
    out = torch.empty_like(x)
    if not pairs:
        return out
    # decode: one pair a block; prefill: blocks of several tokens read an expert's weights once
    block_m = 16 if pairs <= experts else 64
    layout = _block_layout(selected.reshape(-1), experts, block_m)
    flat_weights = weights.reshape(-1)  # [P]
    x = x if x.stride(-1) == 1 else x.contiguous()
    # gate_up: [E, 2I, H] (nn.Linear: W[e, n, k]) or, transposed, [E, H, 2I] (W[e, k, n])
    width = gate_up.shape[2] if transposed else gate_up.shape[1]
    gu_n, gu_k = (
        (gate_up.stride(2), gate_up.stride(1)) if transposed else (gate_up.stride(1), gate_up.stride(2))
    )
    projected = _grouped_gemm(x, gate_up, width, gu_n, gu_k, layout, pairs, top_k, True,
                        flat_weights if weights_on_input else None, block_m)  # [P, 2I]  # fmt: skip
    activated = silu_and_mul(projected)  # [P, I]
    d_n, d_k = (down.stride(2), down.stride(1)) if transposed else (down.stride(1), down.stride(2))
    y = _grouped_gemm(activated, down, hidden, d_n, d_k, layout, pairs, top_k, False, None, block_m)  # [P, H]
    y = y.float() if weights_on_input else y.float() * flat_weights.float().unsqueeze(-1)
    out.copy_(y.view(tokens, top_k, hidden).sum(dim=1))
    return out


def _grouped_gemm(
    a: Tensor,
    weight: Tensor,
    n: int,
    stride_wn: int,
    stride_wk: int,
    layout: tuple[Tensor, Tensor],
    pairs: int,
    top_k: int,
    a_row_is_token: bool,
    scale: Tensor | None,
    block_m: int,
) -> Tensor:
    """out[p] = a[row of p] @ weight[expert of p] as [K] x [K, n]: [P, n] in a's dtype."""
    pair_of_row, expert_of_block = layout
    k = a.shape[-1]
    out = torch.empty((pairs, n), dtype=a.dtype, device=a.device)
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (expert_of_block.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a,
        weight,
        out,
        scale if scale is not None else a,
        pair_of_row,
        expert_of_block,
        pairs,
        top_k,
        n,
        k,
        a.stride(0),
        weight.stride(0),
        stride_wn,
        stride_wk,
        A_ROW_IS_TOKEN=a_row_is_token,
        SCALE_INPUT=scale is not None,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out
