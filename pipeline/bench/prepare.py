"""The model a benchmark measures, brought to a stage by the pipeline's own runner, so the bench
measures what `python -m pipeline` runs: the composed, typed config as a Job, then
`runner.advance` to the stage asked for, on a state whose files go to a temporary folder."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir

from pipeline import REPO_ROOT
from pipeline.config import PipelineConfig, register_schemas, typed
from pipeline.models import zoo
from pipeline.runner import advance, new_state
from pipeline.runtime.engine import DemoLLM
from pipeline.state import Job, RunState


def compose(overrides: list[str]) -> PipelineConfig:
    register_schemas()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return typed(hydra_compose(config_name="config", overrides=overrides))


def job(overrides: list[str], dtype: torch.dtype, device: torch.device, run_dir: Path) -> Job:
    """The job `python -m pipeline OVERRIDES` would run, in `run_dir`."""
    cfg = compose(overrides)
    return Job(cfg, zoo.build_hf_config(cfg.model), run_dir, dtype, device, overrides=tuple(overrides))


@contextlib.contextmanager
def prepared(
    overrides: list[str], dtype: torch.dtype, device: torch.device, until: str = "load"
) -> Iterator[RunState]:
    """A RunState advanced through `until`. Afterwards its run folder (the stages' files) is removed
    and the state lets go of everything that holds weights, so the next model the bench loads has
    the memory (the captured graphs, the reference and the engine hold the model's tensors too)."""
    with tempfile.TemporaryDirectory() as tmp:
        state = new_state(job(overrides, dtype, device, Path(tmp)))
        try:
            yield advance(state, until)
        finally:
            state.release()


def engine_of(state: RunState) -> DemoLLM:
    """demollm on the prepared model, EOS ignored so every run has the same number of steps."""
    return DemoLLM(state.model, state.hf_config, state.cfg.runtime, state.device, eos_ids=set())
