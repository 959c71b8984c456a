"""The model a benchmark measures, brought to a stage by the pipeline's own runner, so the bench
measures what `python -m pipeline` runs: the composed config checked into a Job as the CLI checks
it (jobs.checked_job), then `runner.advance` to the stage asked for, on a state whose files go to
a temporary folder."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir

from pipeline import REPO_ROOT
from pipeline.config import register_schemas
from pipeline.devices import dtype_name
from pipeline.jobs import checked_job
from pipeline.runner import advance, new_state
from pipeline.runtime.engine import DemoLLM
from pipeline.state import Job, RunState


def job(overrides: list[str], dtype: torch.dtype, device: torch.device, run_dir: Path) -> Job:
    """The job `python -m pipeline OVERRIDES dtype=.. device=..` would run, in `run_dir`, or the
    ConfigError the CLI would stop at."""
    chosen = [*overrides, f"dtype={dtype_name(dtype)}", f"device={device.type}"]
    register_schemas()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=chosen)
    return checked_job(cfg, run_dir, torch.cuda.is_available(), overrides=tuple(chosen))


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
