"""The pipeline's own config composition, for benchmarks run outside a Hydra job."""

from __future__ import annotations

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig

from pipeline import REPO_ROOT
from pipeline.config import register_schemas


def compose(overrides: list[str]) -> DictConfig:
    register_schemas()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)
