"""Workarounds for bugs in the Hugging Face releases the pins admit, each the smallest change that
makes the model run, applied only where the bug is present (feature-tested, not version-tested),
with the upstream version that has it. Imported by pipeline.models, so every model the pipeline or
a test builds, Hugging Face's own reference included, runs with them."""

from __future__ import annotations

from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers.models.llama4 import modeling_llama4


def llama4_image_outputs() -> bool:
    """transformers 5.24.0: Llama4ForConditionalGeneration.forward builds its output with
    `image_outputs=outputs.image_outputs`, `outputs` being its language model's
    MoeCausalLMOutputWithPast, which has no such field: every forward (text or image) raises
    AttributeError. The language model never sees the image outputs, so None is what it would
    carry. Returns whether the fix was needed."""
    fields = getattr(modeling_llama4.Llama4CausalLMOutputWithPast, "__dataclass_fields__", {})
    if "image_outputs" not in fields or hasattr(MoeCausalLMOutputWithPast, "image_outputs"):
        return False
    MoeCausalLMOutputWithPast.image_outputs = None
    return True


APPLIED = [fix.__name__ for fix in (llama4_image_outputs,) if fix()]
