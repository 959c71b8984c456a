"""The model a benchmark measures, prepared by the pipeline's own stages, so the bench measures what
`python -m pipeline` runs: the composed, typed config, then `load`, and on request the later stages
(`export`, `transforms` with their correctness checks, ...) on a RunState whose files go to a
temporary folder. Tests use it to run stages in-process."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir

from pipeline import REPO_ROOT
from pipeline.config import PipelineConfig, register_schemas, resolve_attention, resolve_backend, typed
from pipeline.devices import free_memory
from pipeline.models import zoo
from pipeline.runtime.engine import DemoLLM
from pipeline.stages import capture, export, generate, load, profile, transforms
from pipeline.state import RunState

STAGES = {
    "load": load.run,
    "export": export.run,
    "transforms": transforms.run,
    "capture": capture.run,
    "generate": generate.run,
    "profile": profile.run,
}


def compose(overrides: list[str]) -> PipelineConfig:
    register_schemas()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return typed(hydra_compose(config_name="config", overrides=overrides))


def new_state(overrides: list[str], dtype: torch.dtype, device: torch.device, run_dir: Path) -> RunState:
    cfg = compose(overrides)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    on_cuda = device.type == "cuda"
    return RunState(
        cfg,
        run_dir,
        device,
        dtype,
        backend=resolve_backend(cfg, on_cuda),
        attention=resolve_attention(cfg.attention.name, on_cuda),
        hf_config=zoo.build_hf_config(cfg.model),
    )


def advance(state: RunState, *stages: str) -> RunState:
    """Run the named stages on the state, in the order given."""
    for name in stages:
        STAGES[name](state)
    return state


@contextlib.contextmanager
def prepared(
    overrides: list[str], dtype: torch.dtype, device: torch.device, stages: tuple[str, ...] = ("load",)
) -> Iterator[RunState]:
    """A RunState after `stages`. Afterwards its run folder (the stages' files) is removed and the
    state lets go of everything that holds weights, so the next model the bench loads has the memory
    (the captured graphs, the reference and the engine hold the model's tensors too)."""
    with tempfile.TemporaryDirectory() as tmp:
        state = new_state(overrides, dtype, device, Path(tmp))
        try:
            yield advance(state, *stages)
        finally:
            release(state)


def release(state: RunState) -> None:
    state.model = state.engine = state.generation = state.reference = state.example_inputs = None
    state.captured, state.check_calls = [], {}
    free_memory()


def engine_of(state: RunState) -> DemoLLM:
    """demollm on the prepared model, EOS ignored so every run has the same number of steps."""
    return DemoLLM(state.model, state.hf_config, state.cfg.runtime, state.device, eos_ids=set())
