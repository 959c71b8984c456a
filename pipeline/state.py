"""RunState: the one typed object that flows through the stages, each adding what it produced."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipeline.config import PipelineConfig
from pipeline.devices import free_memory
from pipeline.export.graph_capture import CapturedGraph
from pipeline.models.deferred import DeferredWeights
from pipeline.models.inputs import ExampleInputs
from pipeline.parallel import Rank
from pipeline.runtime.requests import Request, build_requests
from pipeline.transforms.registry import TransformHistory

if TYPE_CHECKING:  # the modules that fill these fields import this one
    from transformers import PretrainedConfig

    from pipeline.numerics import PartError
    from pipeline.profiler.stepwise import Waterfall
    from pipeline.runtime.engine import DemoLLM, Generation
    from pipeline.runtime.requests import Sources


@dataclass(frozen=True)
class Job:
    """One job as checked before any model is built (jobs.checked_job, its one maker): what a run,
    each tensor-parallel rank, the bench and the tests start from (pickled whole into a spawned
    rank)."""

    config: PipelineConfig
    hf_config: PretrainedConfig
    run_dir: Path
    dtype: torch.dtype  # as resolved before loading (dtype=auto may pick bfloat16 to fit)
    device: torch.device  # a rank takes its own GPU of this type (Rank.device)
    name: str | None = None  # the MLflow run name (a sweep's swept values); None: from the config
    overrides: tuple[str, ...] = ()  # the command line's, logged as a param


@dataclass
class ModelInfo:
    architecture: str
    params: int
    bytes: int
    init_s: float
    is_vlm: bool
    language_model_paths: list[str]  # where the decoder stack sits inside the model
    source: str  # "random (seed N)" or the checkpoint folder
    decode_bytes: int = 0  # weights one decode step reads (language model and lm_head)
    position_offset: int = 0  # where the positions the language model gets start (PaliGemma: 1)


@dataclass
class CorrectnessCheck:
    stage: str  # the stage whose result was checked: export, transforms
    call: str  # "text" or "image"
    max_abs_err: float  # over the tokens that count (router_flips excluded)
    tolerance: float
    router_flips: int = 0  # tokens over the tolerance where eager's MoE routing was a near-tie

    @property
    def passed(self) -> bool:
        return self.max_abs_err <= self.tolerance


@dataclass
class Reference:
    """The eager model's outputs on the check calls, computed once before the first change."""

    logits: dict[str, torch.Tensor]  # call -> eager logits [B, S, V]
    router_near_ties: dict[str, torch.Tensor]  # call -> [B, S] bool, tokens with a near-tie routing
    parts: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # call -> part -> output
    part_order: list[str] = field(default_factory=list)  # numerics.part_paths: the order a forward runs them
    decode: Any = None  # numerics.DecodeParts: each part at a decode step of the eager model


@dataclass
class StageResult:
    """What a stage reports; the runner logs it, so stages never touch MLflow."""

    metrics: dict[str, float] = field(default_factory=dict)
    artifacts: list[Path] = field(default_factory=list)  # files under the run folder
    notes: list[str] = field(default_factory=list)  # one line each, shown and logged
    tags: dict[str, str] = field(default_factory=dict)
    images: dict[str, Path] = field(default_factory=dict)  # MLflow image key -> PNG (same key every run)
    tables: dict[str, dict[str, list]] = field(default_factory=dict)  # MLflow table file -> columns
    steps: dict[str, list[float]] = field(default_factory=dict)  # metric -> value at steps 1..N
    workload: dict[str, list] = field(default_factory=dict)  # the requests served, as columns


@dataclass
class StageRecord:
    """What one stage did, kept for the report."""

    name: str
    status: str  # done | failed | killed
    seconds: float
    notes: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    cause: str = ""
    started_ns: int = 0  # wall clock (time.time_ns) at the stage's start


@dataclass
class RunState:
    cfg: PipelineConfig
    run_dir: Path
    device: torch.device
    dtype: torch.dtype
    backend: str  # resolved from backend=auto: torch-simple | torch-compile | torch-cudagraph | torch-opt
    attention: str  # resolved from attention=auto: torch | flashinfer | triton
    hf_config: PretrainedConfig | None = None
    model: torch.nn.Module | None = None
    model_info: ModelInfo | None = None
    example_inputs: ExampleInputs | None = None
    check_calls: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> kwargs of a model call
    reference: Reference | None = None  # eager logits (and MoE near-ties) of each check call
    deferred: DeferredWeights | None = (
        None  # runtime.tp_weights=shard: weights load left for the shard transform
    )
    captured: list[CapturedGraph] = field(default_factory=list)
    checks: list[CorrectnessCheck] = field(default_factory=list)
    transform_history: TransformHistory | None = None
    sources: Sources | None = None  # tokenizer and image processor (a checkpoint's, when it has them)
    engine: DemoLLM | None = None  # built by generate, reused by profile
    generation: Generation | None = None  # of the last generate run
    stages: list[StageRecord] = field(default_factory=list)  # every stage run so far, in order
    rank: Rank | None = None  # among tensor-parallel ranks (runtime.world_size > 1); None: one process
    compiled_frames: int = 0  # Dynamo's frame count after the capture stage (later growth: recompiles)
    compile_log_mark: int = 0  # compile_log.LOG's frames then: those after it are generation's
    waterfall: Waterfall | None = None  # profile.waterfall=true: the steps measured so far
    # numerics: each part's output against eager, "prefill" on the check calls, "decode" at a decode step
    part_errors: dict[str, list[PartError]] = field(default_factory=dict)

    def workload(self) -> list[Request]:
        """The run's requests: the configured prompts (and images) of `prompt`."""
        cfg = self.cfg
        return build_requests(
            cfg.prompt, cfg.runtime, cfg.seed, self.hf_config, self.dtype, self.device, self.sources,
            chunked=cfg.capture.mode != "none",
        )  # fmt: skip

    def release(self) -> None:
        """Let go of everything that holds the model's tensors (the model, its graphs, the reference,
        the engine), so the next model built in this process has the memory."""
        self.model = self.engine = self.generation = self.reference = self.example_inputs = None
        self.captured, self.check_calls = [], {}
        free_memory()
