"""Mixture-of-experts language models with vision experts: ERNIE-4.5-VL's MoE layers hold text
experts and vision experts, and its processor's `moe_mm_token_type_ids` [1, S] (1 at an image's
tokens and its begin and end markers) says which each token goes to. That tensor is a per-token
input of the language model, so the captured graph takes it: a request carries the processor's
(`Request.token_inputs`), each prefill step passes its slice (runtime/executors.py), and a step
without images (a decode step's generated tokens are text) gets the graph's empty form, zeros.

Hugging Face's MoE layer picks its route by a branch on the data (`moe_mm_token_type_ids.any()`)
and runs each modality's experts on the tokens of that modality alone, which export cannot
trace. `prepare` gives each such layer a forward without the branch: both sets of experts run on
every token and each token keeps its modality's output. A token's experts are chosen from that
token alone, so each keeps what Hugging Face computes for it (the vision experts' work on text
tokens is the price).
"""

from __future__ import annotations

import types

import torch
from torch import nn

TYPES = "moe_mm_token_type_ids"


def _is_layer(module: nn.Module) -> bool:
    return hasattr(module, "text_moe") and hasattr(module, "vision_moe")


def routes(model: nn.Module) -> bool:
    """Whether the model sends tokens to text or vision experts by the processor's token types."""
    return any(_is_layer(module) for module in model.modules())


def _forward(self, hidden_states: torch.Tensor, moe_mm_token_type_ids: torch.Tensor | None = None):
    """hidden_states [B, S, H] -> ([B, S, H], router logits [B * S, E]), each token through its
    modality's experts (0: text, else vision), plus the shared experts."""
    batch, seq, hidden = hidden_states.shape
    out, logits = self.text_moe(hidden_states)  # flattened [B * S * H], [B * S * E]
    out, logits = out.reshape(batch, seq, hidden), logits.reshape(batch * seq, -1)
    if moe_mm_token_type_ids is not None:
        vision, vision_logits = self.vision_moe(hidden_states)
        routed = moe_mm_token_type_ids.bool()  # [B, S]
        out = torch.where(routed[..., None], vision.reshape(batch, seq, hidden), out)
        logits = torch.where(routed.reshape(-1, 1), vision_logits.reshape(batch * seq, -1), logits)
    if self.shared_experts is not None:
        out = out + self.shared_experts(hidden_states)
    return out, logits


def prepare(model: nn.Module) -> nn.Module:
    """The model with each text/vision MoE layer given the branch-free forward (a no-op for other
    families)."""
    for module in model.modules():
        if _is_layer(module):
            module.forward = types.MethodType(_forward, module)
    return model
