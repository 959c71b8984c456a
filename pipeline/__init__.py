"""Experiment pipeline for partial graph capture and layerwise profiling of LLM/VLM inference."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
