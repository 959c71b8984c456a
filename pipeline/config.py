"""Structured-config schemas, the typed config every package receives, and the up-front checks.

The dataclasses below are registered in Hydra's ConfigStore as the schema of `conf/config.yaml`, so a
value of the wrong type fails at composition. `typed()` turns the composed DictConfig into a
`PipelineConfig` once, refusing keys the schema does not have (also those added with `+`); from
there on packages receive their section as a dataclass (`RuntimeConfig`, `PromptConfig`, ...), never
a DictConfig. `validate()` then runs the per-section checks of what a schema cannot express
(cross-field limits, what this machine can run) before any model is built. Every failure here is a
`ConfigError`: one line naming the key and the fix, exit code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from pipeline.backend_specs import AS_BUILT, AUTO_CPU, AUTO_CUDA, SPECS, spec
from pipeline.errors import ConfigError


@dataclass
class ModelConfig:
    name: str = MISSING
    hf_id: str | None = None  # the hub id the values come from (nothing is downloaded)
    architecture: str | None = None  # the HF class; None: the checkpoint's config.json `architectures`
    model_factory: str = "auto"  # see pipeline.models.zoo.MODEL_FACTORIES
    hf_config: dict[str, Any] = field(default_factory=dict)  # published config.json values
    model_kwargs: dict[str, Any] = field(default_factory=dict)  # deep-merged over hf_config
    checkpoint: str | None = None  # local HF folder: config.json, *.safetensors, tokenizer, templates
    # None: the checkpoint's weights when there is one, else random; true: random weights from the
    # checkpoint's config; false: weights required
    skip_loading_weights: bool | None = None
    trust_remote_code: bool = False
    attn_implementation: str | None = None  # HF attention path: sdpa (HF's default) | eager


@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0


@dataclass
class RuntimeConfig:
    name: str = "demollm"
    attn_page_size: int = 64
    max_input_len: int = 4096
    max_seq_len: int = 8192
    max_batch_size: int = 8
    max_num_tokens: int = 8192
    world_size: int = 0  # 0 or 1: one process; N > 1: N tensor-parallel ranks (pipeline/ranks.py)
    # What a tensor-parallel rank allocates of the weights the shard transform splits. whole: every
    # rank builds the whole model and slices it, so export and transforms check the sharded graph
    # against the eager model; shard: each rank allocates only its slices (models/deferred.py), for
    # models whose whole does not fit a rank, with no eager model to check or profile against.
    tp_weights: str = "whole"
    # A collective that waits longer fails the run: a peer that hangs never holds the others forever;
    # long enough for the ranks' differences in load and compile time.
    collective_timeout_s: int = 300
    kv_cache_mb: int | None = None  # None: pages for max_batch_size sequences of max_seq_len
    lookahead: int = 1  # decode steps the host launches before reading the tokens of earlier ones
    # CPU: freed host memory stays in the process, so a step's activations land on touched pages
    # (runtime/host_memory.py); false leaves glibc's default of giving large blocks back at once
    retain_host_memory: bool = True
    sampling: SamplingConfig = field(default_factory=SamplingConfig)


@dataclass
class BackendConfig:
    name: str = "auto"
    fallback: str | None = (
        None  # eager: on a compile/capture failure go on uncompiled, tagged capture_fallback
    )
    cuda_graph_batch_sizes: list[int] | None = None  # decode buckets; None: 1, 2, 4, ... max_batch_size
    # Piecewise capture (backends/piecewise.py): the cached graph split at the ops whose work depends
    # on the step's sequence layout (attention.LAYOUT_OPS); every step that is not decode-only is
    # padded to a token bucket and runs the static segments compiled (torch-compile) or replayed
    # per bucket (torch-cudagraph, torch-opt), the layout ops eagerly between them; decode keeps
    # the full graph
    piecewise: bool = False
    piecewise_tokens: list[int] | None = None  # token buckets; None: 1, 2, 4, ... runtime.max_num_tokens
    # The segment after the last layout op that computes the logits (capture=full): its buffers grow
    # with vocabulary x tokens, so by default it runs uncaptured after the replays
    piecewise_capture_lm_head: bool = False


@dataclass
class AttentionConfig:
    name: str = "auto"


@dataclass
class CaptureConfig:
    mode: str = "partial"
    submodules: list[str] | None = None  # dotted paths; None: find the language model


@dataclass
class PromptConfig:
    batch_size: int = 1
    prompt_len: int = 128
    output_len: int = 32
    queries: list[Any] | None = None
    image_size: int | None = None  # synthetic image side in pixels; None: the model family's default
    images: list[str] | None = None  # local image files for VLM requests (cycled); None: synthetic
    # The generated workload's image requests: family: a chat turn made by the family's chat template
    # and Processor (a folder's, else built from the config: models/families.py), its tile, row and
    # begin/end tokens; generic: the image's tokens amid random ids, laid out by models/images.py
    image_layout: str = "family"


@dataclass
class ProfileConfig:
    enabled: bool = True
    decode_steps: int = 8  # one profiling window each, after the prefill window
    # eager: also profile the eager model (Hugging Face's, its captured parts swapped back) on the
    # same workload, and compare module by module; none: the captured run only
    reference: str = "eager"
    # category -> regex over kernel names (ATen op names on CPU); first match wins, else "other"
    kernel_categories: dict[str, str] = field(default_factory=dict)
    table_depth: int | None = 4  # printed tables: deepest level shown (None: all)
    table_top_k: int | None = 8  # printed tables: largest children shown per node (None: all)
    # true: also profile the model after each step from eager to captured (the graph with its cache,
    # each further transform, the capture backend): what each bought and cost (pipeline/waterfall.py)
    waterfall: bool = False
    # rounds the waterfall's steps are timed in, each visiting every step (docs/profiler.md: the cost)
    waterfall_rounds: int = 3
    # torch-compile, torch-opt: map each compiled graph's kernels to the modules they compute, through
    # a second, profiled variant of each graph compiled for the profiled windows (Inductor's
    # provenance; uncached, so one more compile per graph, per waterfall visit too); false: a graph's
    # kernels count under the graph module (docs/profiler.md)
    kernel_provenance: bool = True


@dataclass
class ReportConfig:
    enabled: bool = True
    formats: list[str] = field(default_factory=lambda: ["png"])  # png always; add pdf or svg
    top_k: int = 8  # parts per plot; the rest are "others"
    depth: int | None = None  # module plot: module depth; None: decoder-layer children + the rest


@dataclass
class TrackingConfig:
    enabled: bool = True
    uri: str | None = None  # None: sqlite:///<repo>/mlflow.db
    experiment: str = "pipeline"


@dataclass
class BenchmarkConfig:
    enabled: bool = False  # warm-up, then `iterations` timed generations (median and spread)
    iterations: int = 5


@dataclass
class PipelineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    transforms: dict[str, Any] = field(default_factory=dict)  # name -> options; see pipeline.transforms
    prompt: PromptConfig = field(default_factory=PromptConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    dry_run: bool = False


def register_schemas() -> None:
    ConfigStore.instance().store(name="pipeline_schema", node=PipelineConfig)


def _unknown_keys(node: DictConfig, schema: type, prefix: str) -> None:
    """Hydra lets `+key=value` add a key to a structured config, and OmegaConf.to_object drops it
    silently: refuse every key the schema's dataclass does not declare. Fields typed as dicts
    (hf_config, model_kwargs, transforms, kernel_categories) take any keys; their own checks
    (the HF config class, the transform registry) judge them."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in node.keys():
        path = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"did you mean {prefix}{close[0]}? " if close else ""
            raise ConfigError(
                f"{path} is not a config key; {hint}{prefix.rstrip('.') or 'the top level'} has: "
                f"{', '.join(fields)}"
            )
        value = node._get_node(key)
        sub_schema = OmegaConf.get_type(value) if isinstance(value, DictConfig) else None
        if sub_schema is not None and dataclasses.is_dataclass(sub_schema):
            _unknown_keys(value, sub_schema, f"{path}.")


def typed(cfg: DictConfig) -> PipelineConfig:
    """The composed config as a PipelineConfig (sections are dataclasses), after refusing unknown keys."""
    _unknown_keys(cfg, PipelineConfig, "")
    return OmegaConf.to_object(cfg)


ATTENTION_BACKENDS = ("auto", "torch", "flashinfer", "triton")
CUDA_ONLY_ATTENTION = ("flashinfer", "triton")
CAPTURE_MODES = ("none", "full", "partial")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")

# Sanity limits, so that a typo cannot ask for terabytes before anything is built.
MAX_IMAGE_SIDE = 16384  # pixels
MAX_LOOKAHEAD = 4  # steps computed ahead are wasted for a sequence that already ended
MAX_SEQ_LEN = 1 << 20  # tokens


def runs_on_cuda(cfg: PipelineConfig, cuda_available: bool) -> bool:
    return cfg.device == "cuda" or (cfg.device == "auto" and cuda_available)


def resolve_backend(cfg: PipelineConfig, on_cuda: bool, replays: bool = True) -> str:
    """`auto`: capture=none is always the plain eager baseline; else torch-opt on CUDA, torch-compile
    on CPU and for a model whose steps CUDA graphs cannot replay (replays=False: its graph inputs
    change shape with each step's sequences, as cross-attended vision states do)."""
    if cfg.backend.name != "auto":
        return cfg.backend.name
    if cfg.capture.mode == "none":
        return AS_BUILT
    return AUTO_CUDA if on_cuda and replays else AUTO_CPU


def resolve_attention(name: str, on_cuda: bool) -> str:
    """`auto`: on CUDA flashinfer where installed, else triton; torch on CPU. Not torch on CUDA: a
    captured decode step needs static shapes, so there the torch backend gathers and attends over
    every page of the table (runtime.max_seq_len keys) each step, where the kernels read only the
    sequence's own pages."""
    if name != "auto":
        return name
    if not on_cuda:
        return "torch"
    return "flashinfer" if importlib.util.find_spec("flashinfer") is not None else "triton"


IMAGE_LAYOUTS = ("family", "generic")


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value} is not known; use one of: {', '.join(allowed)}")


def _positive(key: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{key}={value} must be positive")


def check_choices(cfg: PipelineConfig) -> None:
    _one_of("device", cfg.device, DEVICES)
    _one_of("dtype", cfg.dtype, DTYPES)
    _one_of("backend.name", cfg.backend.name, ("auto", *SPECS))
    _one_of("attention.name", cfg.attention.name, ATTENTION_BACKENDS)
    _one_of("capture.mode", cfg.capture.mode, CAPTURE_MODES)
    if cfg.model.attn_implementation is not None:
        _one_of("model.attn_implementation", cfg.model.attn_implementation, ("sdpa", "eager"))
    if cfg.runtime.name != "demollm":
        raise ConfigError(f"runtime.name={cfg.runtime.name} is not known; use runtime=demollm")


def check_machine(cfg: PipelineConfig, cuda_available: bool) -> None:
    """What this machine can run: CUDA-only backends and attention, installed packages."""
    if cfg.device == "cuda" and not cuda_available:
        raise ConfigError("device=cuda but no CUDA device is available here; use device=auto or device=cpu")
    on_cuda = runs_on_cuda(cfg, cuda_available)
    if cfg.backend.name != "auto" and spec(cfg.backend.name).cuda_only and not on_cuda:
        raise ConfigError(
            f"backend={cfg.backend.name} needs a CUDA device, and this run is on CPU; use backend=auto"
        )
    if cfg.attention.name in CUDA_ONLY_ATTENTION and not on_cuda:
        raise ConfigError(
            f"attention={cfg.attention.name} needs a CUDA device, and this run is on CPU; use attention=auto"
        )
    if cfg.attention.name == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
        raise ConfigError(
            "attention=flashinfer but the flashinfer package is not installed; install it or use attention=auto"
        )


def check_capture(cfg: PipelineConfig) -> None:
    if cfg.backend.name != "auto" and spec(cfg.backend.name).replays and cfg.capture.mode == "none":
        raise ConfigError(
            f"backend={cfg.backend.name} captures graphs, and capture=none has none; use capture=partial or capture=full"
        )
    if cfg.backend.fallback not in (None, "eager"):
        raise ConfigError(
            f"backend.fallback={cfg.backend.fallback} is not known; use backend.fallback=eager or null"
        )
    for size in cfg.backend.cuda_graph_batch_sizes or []:
        if not 0 < size <= cfg.runtime.max_batch_size:
            raise ConfigError(
                f"backend.cuda_graph_batch_sizes has {size}; each must be in 1..runtime.max_batch_size"
                f"={cfg.runtime.max_batch_size}"
            )
    check_piecewise(cfg)
    if cfg.capture.submodules is not None and cfg.capture.mode != "partial":
        raise ConfigError(
            f"capture.submodules is set but capture={cfg.capture.mode}; use capture=partial or drop capture.submodules"
        )


def check_piecewise(cfg: PipelineConfig) -> None:
    backend = cfg.backend
    for size in backend.piecewise_tokens or []:
        if not 0 < size <= cfg.runtime.max_num_tokens:
            raise ConfigError(
                f"backend.piecewise_tokens has {size}; each must be in 1..runtime.max_num_tokens"
                f"={cfg.runtime.max_num_tokens}"
            )
    if not backend.piecewise:
        if backend.piecewise_tokens is not None or backend.piecewise_capture_lm_head:
            raise ConfigError(
                "backend.piecewise_tokens or backend.piecewise_capture_lm_head is set but "
                "backend.piecewise=false; add backend.piecewise=true"
            )
        return
    if cfg.capture.mode == "none":
        raise ConfigError(
            "backend.piecewise=true splits a captured graph, and capture=none has none; "
            "use capture=partial or capture=full"
        )
    if backend.name != "auto" and spec(backend.name).runs_as_built:
        raise ConfigError(
            "backend.piecewise=true with backend=torch-simple has nothing to compile or capture; "
            "use backend=torch-compile, torch-cudagraph or torch-opt"
        )
    cached = cfg.transforms.get("insert_cached_attention")
    if cached is None or (cached or {}).get("enabled", True) is False:
        raise ConfigError(
            "backend.piecewise=true splits the graph at its cached-attention ops, and "
            "transforms.insert_cached_attention is off; enable it (transforms=default)"
        )


def check_runtime(rt: RuntimeConfig) -> None:
    for key in ("attn_page_size", "max_input_len", "max_seq_len", "max_batch_size", "max_num_tokens"):
        _positive(f"runtime.{key}", getattr(rt, key))
    if rt.max_seq_len > MAX_SEQ_LEN:
        raise ConfigError(f"runtime.max_seq_len={rt.max_seq_len} is more than {MAX_SEQ_LEN} tokens; lower it")
    if rt.max_seq_len % rt.attn_page_size:
        raise ConfigError(
            f"runtime.max_seq_len={rt.max_seq_len} is not a multiple of runtime.attn_page_size={rt.attn_page_size}; "
            "make it one"
        )
    if rt.max_num_tokens < rt.max_batch_size:
        # A decode step of max_batch_size sequences takes one token each; the budget is the user's,
        # never raised silently (the seed's discussion): a larger one means more activation memory.
        raise ConfigError(
            f"runtime.max_num_tokens={rt.max_num_tokens} is less than runtime.max_batch_size={rt.max_batch_size}, "
            "so a full decode step would not fit it; raise runtime.max_num_tokens or lower runtime.max_batch_size"
        )
    if rt.kv_cache_mb is not None:
        _positive("runtime.kv_cache_mb", rt.kv_cache_mb)
    if not 0 <= rt.lookahead <= MAX_LOOKAHEAD:
        raise ConfigError(
            f"runtime.lookahead={rt.lookahead}: use 0 (read every step's tokens before the next) up to "
            f"{MAX_LOOKAHEAD}; 1 already keeps the device busy"
        )
    sampling = rt.sampling
    if sampling.temperature < 0 or sampling.top_k < 0 or not 0 < sampling.top_p <= 1:
        raise ConfigError(
            f"runtime.sampling: temperature={sampling.temperature} (>= 0), top_k={sampling.top_k} (>= 0), "
            f"top_p={sampling.top_p} (in (0, 1]): fix the one out of range"
        )
    if rt.world_size < 0:
        raise ConfigError(
            f"runtime.world_size={rt.world_size}: use 0 (one process) or N > 1 (N tensor-parallel ranks)"
        )
    _one_of("runtime.tp_weights", rt.tp_weights, ("whole", "shard"))
    _positive("runtime.collective_timeout_s", rt.collective_timeout_s)


def check_prompt(prompt: PromptConfig, rt: RuntimeConfig) -> None:
    for key in ("batch_size", "prompt_len", "output_len"):
        _positive(f"prompt.{key}", getattr(prompt, key))
    _one_of("prompt.image_layout", prompt.image_layout, IMAGE_LAYOUTS)
    if prompt.image_size is not None:
        _positive("prompt.image_size", prompt.image_size)
        if prompt.image_size > MAX_IMAGE_SIDE:
            raise ConfigError(
                f"prompt.image_size={prompt.image_size} is more than {MAX_IMAGE_SIDE} pixels a side; use a smaller image"
            )
    for index, path in enumerate(prompt.images or []):
        if "://" in path:
            raise ConfigError(
                f"prompt.images[{index}]={path} is a URL; nothing can be fetched offline: use a local file"
            )
        if not Path(path).is_file():
            raise ConfigError(f"prompt.images[{index}]={path} does not exist")
    if prompt.prompt_len > rt.max_input_len:
        raise ConfigError(
            f"prompt.prompt_len={prompt.prompt_len} exceeds runtime.max_input_len={rt.max_input_len}; "
            "shorten the prompt or raise runtime.max_input_len"
        )
    if prompt.prompt_len + prompt.output_len > rt.max_seq_len:
        raise ConfigError(
            f"prompt.prompt_len + prompt.output_len = {prompt.prompt_len + prompt.output_len} exceeds "
            f"runtime.max_seq_len={rt.max_seq_len}; shorten them or raise runtime.max_seq_len"
        )


def check_model(model: ModelConfig) -> None:
    if model.checkpoint is None and model.skip_loading_weights is False:
        raise ConfigError(
            "model.skip_loading_weights=false needs weights: set model.checkpoint=/local/hf/folder "
            "or model.skip_loading_weights=true"
        )
    if model.checkpoint is None and not model.hf_config:
        raise ConfigError(
            f"model={model.name} has no hf_config and no checkpoint: set model.checkpoint=/path/to/hf/folder "
            "(model=hf reads config.json from it)"
        )


def check_outputs(cfg: PipelineConfig) -> None:
    """The profile, report and benchmark sections."""
    _positive("profile.decode_steps", cfg.profile.decode_steps)
    if cfg.profile.waterfall and not cfg.profile.enabled:
        raise ConfigError("profile.waterfall=true profiles each step: set profile.enabled=true too")
    if cfg.profile.waterfall and cfg.capture.mode == "none":
        raise ConfigError(
            "profile.waterfall=true steps from eager to a captured graph: use capture=partial or capture=full"
        )
    if cfg.profile.waterfall_rounds < 2:
        raise ConfigError(
            f"profile.waterfall_rounds={cfg.profile.waterfall_rounds}: a spread needs at least 2 rounds "
            "(default 3)"
        )
    if cfg.profile.waterfall and cfg.runtime.world_size > 1:
        raise ConfigError("profile.waterfall=true runs in one process: set runtime.world_size=1")
    _one_of("profile.reference", cfg.profile.reference, ("eager", "none"))
    for key in ("table_depth", "table_top_k"):
        if getattr(cfg.profile, key) is not None:
            _positive(f"profile.{key}", getattr(cfg.profile, key))
    for name, regex in cfg.profile.kernel_categories.items():
        try:
            re.compile(regex)
        except re.error as exc:
            raise ConfigError(
                f"profile.kernel_categories.{name}: {exc}; fix the regular expression"
            ) from None
    _positive("report.top_k", cfg.report.top_k)
    if cfg.report.depth is not None:
        _positive("report.depth", cfg.report.depth)
    if "png" not in cfg.report.formats or not set(cfg.report.formats) <= {"png", "pdf", "svg"}:
        raise ConfigError(
            f"report.formats={list(cfg.report.formats)}: list png and optionally pdf or svg, e.g. [png,pdf]"
        )
    _positive("benchmark.iterations", cfg.benchmark.iterations)


def validate(cfg: PipelineConfig, cuda_available: bool) -> None:
    """Checks that need no model, section by section: choices first, then what this machine can
    run, then each section's limits and the limits between sections."""
    check_choices(cfg)
    check_machine(cfg, cuda_available)
    check_capture(cfg)
    check_runtime(cfg.runtime)
    check_prompt(cfg.prompt, cfg.runtime)
    check_model(cfg.model)
    check_outputs(cfg)
