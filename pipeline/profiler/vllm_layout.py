"""The profile in the JSON layout vLLM's layerwise profiler writes (`vllm/profiler/
layerwise_profile.py`, `examples/offline_profile.py`), so vLLM's own readers
(`tools/profiler/print_layerwise_table.py`, `visualize_layerwise_profile.py`) read ours:

  {"context": {...},                       first key: the readers take every other key as a step
   "prefill": {"metadata": {"num_running_seqs": B},
               "summary_stats": [{"entry": SummaryStatsEntry, "children": [...]}, ...],
               "model_stats":   [{"entry": ModelStatsEntry,   "children": [...]}, ...]},
   "decode_1": {...}, ...}

Entries carry exactly vLLM's fields: SummaryStatsEntry {name, cuda_time_us, pct_cuda_time,
invocations}, ModelStatsEntry {name, cpu_time_us, cuda_time_us, pct_cuda_time, trace}. Our device
time goes in `cuda_time_us` (on a CPU run: the ops' self time, as in profile.json). Only the steps
are written, not our `decode` mean; vLLM's visualizer expects one prefill step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.profiler.rows import Phases, ProfileNode

SUMMARY_FIELDS = ("name", "cuda_time_us", "pct_cuda_time", "invocations")
MODEL_FIELDS = ("name", "cpu_time_us", "cuda_time_us", "pct_cuda_time", "trace")


def _entry(node: ProfileNode, model: bool) -> dict[str, Any]:
    name = node.name if node.kind != "module" else f"{node.fqn or node.name} ({node.cls})"
    if model:
        return {
            "name": name,
            "cpu_time_us": node.cpu_time_us,
            "cuda_time_us": node.device_time_us,
            "pct_cuda_time": node.pct,
            "trace": node.trace,
        }
    return {
        "name": name,
        "cuda_time_us": node.device_time_us,
        "pct_cuda_time": node.pct,
        "invocations": node.invocations,
    }


def _tree(node: ProfileNode, model: bool) -> dict[str, Any]:
    return {"entry": _entry(node, model), "children": [_tree(c, model) for c in node.children]}


def vllm_profile(context: dict[str, Any], phases: Phases) -> dict[str, Any]:
    """Our phases (profile.json's) in vLLM's layout: the roots are the phase node's children."""
    out: dict[str, Any] = {
        "context": {
            **context,
            "engine_args": {
                "model": context.get("model", ""),
                "tensor_parallel_size": context.get("world_size", 1),
            },
            "output_len": context.get("decode_steps", 0) + 1,
        }
    }
    for name, phase in phases.items():
        if name == "decode":  # our mean of the decode steps, not a step
            continue
        out[name] = {
            "metadata": {"num_running_seqs": context.get("batch_size")},
            "summary_stats": [_tree(c, False) for c in phase.summary_stats.children],
            "model_stats": [_tree(c, True) for c in phase.model_stats.children],
        }
    return out
