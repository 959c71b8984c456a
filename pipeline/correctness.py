"""Is the changed model still the eager model? Logits on the same calls, against a dtype-aware bound.

The eager reference is computed once, before the first change (export), and every stage that
changes the model (export, transforms) compares against it.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.state import CorrectnessCheck, RunState, StageResult

# Relative to the largest reference logit. Export replays the same ATen ops, so float32 agrees to
# rounding; rewrites such as fused GEMMs change the summation order, still far below 1e-4.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def logits(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output[0]


def reference_outputs(model: torch.nn.Module, calls: dict[str, dict]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {name: logits(model(**call)) for name, call in calls.items()}


def check(state: RunState, stage: str, result: StageResult) -> list[CorrectnessCheck]:
    """Compare state.model with the reference on every check call; records metrics and notes."""
    checks = []
    with torch.no_grad():
        for name, call in state.check_calls.items():
            ref = state.reference[name].float()
            err = (logits(state.model(**call)).float() - ref).abs().max().item()
            tol = TOLERANCE[state.dtype] * max(1.0, ref.abs().max().item())
            checks.append(CorrectnessCheck(stage, name, err, tol))
            result.metrics[f"correctness/{stage}/{name}_max_abs_err"] = err
            result.notes.append(f"check on the {name} call: max_abs_err {err:.3g} (tolerance {tol:.3g})")
    result.metrics["correctness/max_abs_err"] = max(c.max_abs_err for c in checks)
    state.checks += checks
    return checks


def failure(checks: list[CorrectnessCheck]) -> str | None:
    failed = [c for c in checks if not c.passed]
    if not failed:
        return None
    worst = max(failed, key=lambda c: c.max_abs_err)
    return (
        f"model after {worst.stage} differs from eager on the {worst.call} call: max_abs_err "
        f"{worst.max_abs_err:.3g} > tolerance {worst.tolerance:.3g}"
    )
