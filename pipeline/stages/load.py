"""load: build the Hugging Face model offline (random seeded weights, or a local checkpoint's),
with what turns queries into tokens and pixels (the checkpoint's tokenizer, chat template and
image processor)."""

from __future__ import annotations

from torch import nn

from pipeline.graphs import find_language_models
from pipeline.models import (
    build,
    checkpoint,
    image_mask,
    meta,
    probe,
    text_calls,
    vision_experts,
    vq_codes,
    zoo,
)
from pipeline.models.deferred import DeferredWeights
from pipeline.models.inputs import make_example_inputs
from pipeline.models.memory import decode_weight_bytes, human_bytes, human_count
from pipeline.models.processor import check_image_counts
from pipeline.parallel import tensor_parallel
from pipeline.runtime.requests import sources_of
from pipeline.state import ModelInfo, RunState, StageResult

EXAMPLE_BATCH = 2  # export needs a batch > 1 to keep the batch dim dynamic


def run(state: RunState) -> StageResult:
    model_cls = zoo.resolve_model_class(state.cfg.model, state.hf_config)
    skeleton = meta.meta_model(model_cls, state.hf_config)
    if state.cfg.runtime.tp_weights == "shard" and tensor_parallel()[1] > 1:
        state.deferred = DeferredWeights()
    model, report, source, metrics, notes = _weights(state, model_cls, skeleton)
    lm_paths = find_language_models(model, zoo.text_config_of(state.hf_config))
    state.model = model = _calls_prepared(model, lm_paths[0] if len(lm_paths) == 1 else "")
    prompt = state.cfg.prompt
    state.sources = sources_of(state.cfg.model.checkpoint, state.hf_config, skeleton, prompt.image_layout)
    processor = state.sources.processor if prompt.queries else state.sources.layout_processor
    if processor is not None:
        # the processor against the model it loaded, once, before any graph is made of it
        with_images = next((r for r in state.workload() if r.images), None)
        if with_images is not None:
            check_image_counts(model, processor, state.hf_config, with_images)
    state.model_info = info = ModelInfo(
        architecture=type(model).__name__,
        params=report.params,
        bytes=report.bytes,
        init_s=report.seconds,
        is_vlm=zoo.is_vlm(state.hf_config),
        language_model_paths=lm_paths,
        source=source,
        decode_bytes=decode_weight_bytes(model, lm_paths[0] if lm_paths else ""),
    )
    notes += _examples(state, skeleton)
    if info.is_vlm and not prompt.queries:
        notes.append(state.sources.layout)
    metrics |= {
        "model/params": info.params,
        "model/bytes": info.bytes,
        "model/decode_bytes": info.decode_bytes,
        "model/init_s": info.init_s,
    }
    summary = [
        f"{info.architecture}: {human_count(info.params)} parameters, {info.bytes / 2**30:.2f} GiB "
        f"{str(state.dtype).removeprefix('torch.')} on {state.device}, weights {source}, init {info.init_s:.1f} s",
        f"language model at: {', '.join(info.language_model_paths) or '(none found)'}",
    ]
    return StageResult(metrics=metrics, notes=summary + notes)


def _weights(state: RunState, model_cls: type, skeleton: nn.Module) -> tuple:
    """(model, build report, where its weights came from, metrics, notes): the checkpoint's weights
    (each rank's slices alone with runtime.tp_weights=shard), or random ones from the seed."""
    model_cfg, notes, metrics = state.cfg.model, [], {}
    defer = _to_shard(skeleton, state.hf_config) if state.deferred is not None else None
    if model_cfg.checkpoint and model_cfg.skip_loading_weights is not True:
        if defer is not None:
            model, report = checkpoint.load_slices(
                model_cls, model_cfg.checkpoint, state.hf_config, state.dtype, state.device,
                model_cfg.attn_implementation, defer, state.deferred,
            )  # fmt: skip
        else:
            model, report = checkpoint.load(
                model_cls, model_cfg.checkpoint, state.hf_config, state.dtype, state.device,
                model_cfg.trust_remote_code, model_cfg.attn_implementation,
            )  # fmt: skip
        source = model_cfg.checkpoint
        metrics["model/unused_checkpoint_weights"] = len(report.unexpected)
        if report.unexpected:
            notes.append(checkpoint.describe_unexpected(report))
    else:
        model, report = build.build_random(
            model_cls, state.hf_config, state.dtype, state.device, state.cfg.seed,
            model_cfg.attn_implementation, defer=defer, deferred=state.deferred,
        )  # fmt: skip
        source = f"random (seed {state.cfg.seed})" + (
            f", config from {model_cfg.checkpoint}" if model_cfg.checkpoint else ""
        )
    if state.deferred is not None:
        whole = sum(
            p.numel() * state.dtype.itemsize for p in {id(p): p for p in skeleton.parameters()}.values()
        )
        notes.append(
            f"runtime.tp_weights=shard: {human_bytes(report.bytes)} of the whole {human_bytes(whole)} allocated; "
            "the linears the shard transform splits get only this rank's slice"
        )
    return model, report, source, metrics, notes


def _calls_prepared(model: nn.Module, language_model: str) -> nn.Module:
    """The model with the calls of a few families made what one captured graph takes (each a no-op
    for the others): Chameleon's images become code ids before the forward, ERNIE-4.5-VL's MoE
    layers route without a branch on the data, and a call without images of BLIP-2 or Kosmos-2
    (whose forwards want them every call) gets none."""
    model = vision_experts.prepare(vq_codes.prepare(model))
    return image_mask.prepare(text_calls.allow_text_calls(model), language_model)


def _examples(state: RunState, skeleton: nn.Module) -> list[str]:
    """The example calls export and the checks run (a text call, and an image call for a VLM), and
    where the model counts positions from, asked of the model; their notes."""
    notes = []
    state.example_inputs = make_example_inputs(
        state.hf_config,
        EXAMPLE_BATCH,
        state.cfg.prompt.image_size,
        state.dtype,
        state.device,
        state.cfg.seed,
        skeleton,
        state.sources.image_processor,
    )
    info, lm_paths = state.model_info, state.model_info.language_model_paths
    info.position_offset = probe.first_position(
        state.model, lm_paths[0] if len(lm_paths) == 1 else "", state.example_inputs.text["input_ids"][:1, :2]
    )
    if info.position_offset:
        notes.append(f"the model counts positions from {info.position_offset}; explicit positions do too")
    if state.example_inputs.note:
        notes.append(state.example_inputs.note)
    return notes


def _to_shard(skeleton: nn.Module, hf_config) -> build.DeferWhere:
    """runtime.tp_weights=shard: which parameters load leaves as placeholders for the shard
    transform: those of every linear in the language model that gets captured (the whole model of a
    text model) and of the lm_head, not one an embedding shares (the embedding runs before export).
    The vision tower runs whole before export and stays whole."""
    paths = find_language_models(skeleton, zoo.text_config_of(hf_config)) if zoo.is_vlm(hf_config) else [""]
    embedded = {id(m.weight) for m in skeleton.modules() if isinstance(m, nn.Embedding)}
    tied = {
        f"{path}.{name}"
        for path, module in skeleton.named_modules()
        for name, param in module._parameters.items()
        if param is not None and id(param) in embedded
    }

    def defer(path: str, module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear) or f"{path}.{name}" in tied:
            return False
        inside = any(not lm or path == lm or path.startswith(f"{lm}.") for lm in paths)
        return inside or path.rsplit(".", 1)[-1] == "lm_head"

    return defer
