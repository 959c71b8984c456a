"""Experiment pipeline for partial graph capture and layerwise profiling of LLM/VLM inference."""

import gc
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# Young-generation passes of the cyclic collector: one per 10,000 net allocations (Python's default
# is 700), in every process of the pipeline (runs, ranks, bench children, test workers). Dynamo,
# Inductor and torch.export make about a million Python objects in a tiny run, and each pass that
# promotes some of them brings the next full pass over all of them nearer.
YOUNG_COLLECTION_THRESHOLD = 10_000
gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, *gc.get_threshold()[1:])
