"""The per-layer table: layer kinds read off the model and its config, rows grouped by kind, time,
gaps, roof and numerics joined per part, and the parts whose work is not alike on both sides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import build_tiny, check_busy_gap_split, mlflow_runs, run_pipeline
from torch import nn

from pipeline import numerics
from pipeline.profiler.layers import REST, Unlike, layer_kinds, layer_rows
from pipeline.profiler.rows import LayerRow, PhaseStats, ProfileNode, RoofRow


def test_gemma3_layers_are_of_the_kinds_its_config_names():
    model, hf_config, _ = build_tiny("tiny_gemma3")
    parts = numerics.part_paths(model, ["model.language_model"])
    kinds = layer_kinds(model, parts, hf_config.text_config.layer_types)
    assert kinds == {
        "model.language_model.layers.0": "sliding_attention",
        "model.language_model.layers.1": "full_attention",
    }
    assert layer_kinds(model, parts, ["full_attention", "full_attention"]) == {}  # alike: no kinds


class _Layer(nn.Module):
    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.self_attn, self.mlp = nn.Linear(4, 4), mlp


class _Experts(nn.Module):
    pass


def test_a_dense_first_layer_differs_from_the_expert_layers_by_its_mlp():
    model = nn.Module()
    model.layers = nn.ModuleList([_Layer(nn.Linear(4, 4)), _Layer(_Experts()), _Layer(_Experts())])
    kinds = layer_kinds(model, ["layers.0", "layers.1", "layers.2"], None)
    assert kinds == {"layers.0": "mlp=Linear", "layers.1": "mlp=_Experts", "layers.2": "mlp=_Experts"}


def _module(fqn: str, us: float, gap: float, children=()) -> ProfileNode:
    return ProfileNode(
        fqn.rsplit(".", 1)[-1], "module", fqn=fqn, device_time_us=us, busy_us=us, gap_us=gap,
        span_us=us + gap, launches=1, children=list(children),
    )  # fmt: skip


def _phase(layer_us: list[float], gap: float, head_us: float) -> PhaseStats:
    """A step of three decoder layers (each `gap` us between its ops) and an lm_head, 10 us of work
    outside them and 50 us of gaps between them."""
    layers = [_module(f"lm.layers.{i}", us, gap) for i, us in enumerate(layer_us)]
    work = sum(layer_us) + head_us + 10.0
    root = ProfileNode(
        "prefill", "phase", device_time_us=work, busy_us=work, gap_us=gap * 3 + 50.0,
        span_us=work + gap * 3 + 50.0, children=[_module("lm", sum(layer_us), 0.0, layers), _module("lm_head", head_us, 0.0)],
    )  # fmt: skip
    return PhaseStats(0.0, work, "one window", 100.0, 100.0, {}, root, root)


PARTS = ["lm.layers.0", "lm.layers.1", "lm.layers.2", "lm_head"]
KINDS = {"lm.layers.0": "dense", "lm.layers.1": "moe", "lm.layers.2": "dense"}


def test_rows_are_grouped_by_kind_and_join_time_gaps_roof_and_numerics():
    captured = {"prefill": _phase([100.0, 400.0, 200.0], 10.0, 50.0)}
    eager = {"prefill": _phase([200.0, 800.0, 300.0], 60.0, 50.0)}
    errors = {"lm.layers.0": (1e-6, 1e-7, False), "lm.layers.2": (1e-2, 1e-3, True)}
    roofs = [RoofRow("lm_head", 0.05, 1.0, 0.0, roof_ms=0.025, pct_of_roof=50.0)]
    unlike = Unlike.of(PARTS, {}, {}, {})
    rows = layer_rows("prefill", captured, eager, PARTS, KINDS, unlike, roofs, errors)
    assert [r.part for r in rows] == [
        "lm.layers.0", "lm.layers.2", "dense layers (2)", "lm.layers.1", "moe layers (1)", "lm_head", REST, "total",
    ]  # fmt: skip
    by = {r.part: r for r in rows}
    assert by["lm.layers.0"].speedup == pytest.approx(2.0) and by["lm.layers.0"].kind == "dense"
    assert (by["lm.layers.0"].captured_gap_ms, by["lm.layers.0"].gaps_removed_ms) == pytest.approx(
        (0.01, 0.05)
    )
    assert (by["dense layers (2)"].captured_ms, by["dense layers (2)"].eager_ms) == pytest.approx((0.3, 0.5))
    assert by["lm.layers.2"].first_drift and by["lm.layers.2"].max_rel == 1e-3
    assert by["lm.layers.1"].max_abs is None  # not compared: no number made up
    assert by["lm_head"].pct_of_roof == pytest.approx(50.0)
    assert by["lm.layers.0"].pct_of_roof is None  # kinds differ: the summed slices' roof is no layer's
    # the rest is what the parts leave of the step, so the parts and the rest add up to the total
    parts_and_rest = [by[p] for p in [*PARTS, REST]]
    for field in ("captured_ms", "captured_gap_ms", "eager_ms", "eager_busy_ms", "eager_gap_ms"):
        assert sum(getattr(r, field) for r in parts_and_rest) == pytest.approx(getattr(by["total"], field))
    assert by[REST].captured_ms == pytest.approx(0.01) and by[REST].captured_gap_ms == pytest.approx(0.05)


def test_parts_whose_work_differs_get_a_note_not_a_ratio():
    """Inductor fused a layer's residual add into the next layer's norm; a model-scope rewrite
    changed the lm_head; with no eager reference there is nothing to divide."""
    captured = {"prefill": _phase([100.0, 400.0, 200.0], 10.0, 50.0)}
    eager = {"prefill": _phase([200.0, 800.0, 300.0], 60.0, 50.0)}
    unlike = Unlike.of(
        PARTS, {"lm_head": "onednn_linear"}, {"lm.layers.0.mlp": {"lm.layers.1.input_layernorm"}}, {}
    )
    by = {r.part: r for r in layer_rows("prefill", captured, eager, PARTS, {}, unlike, [], {})}
    assert (
        by["lm.layers.0"].speedup is None and by["lm.layers.0"].note == "shares fused work with lm.layers.1"
    )
    assert by["lm.layers.1"].note == "shares fused work with lm.layers.0"
    assert by["lm.layers.2"].speedup == pytest.approx(1.5)
    assert by["lm_head"].note == "rewritten by onednn_linear"
    assert not any("layers (" in r.part for r in by.values())  # alike layers: no kind rows
    alone = layer_rows("prefill", captured, None, PARTS, {}, unlike, [], {})
    assert all(r.speedup is None for r in alone[:-1]) and "no eager reference" in alone[0].note


def test_per_layer_metrics_are_a_bounded_set_that_says_which_layers():
    from pipeline.stages.profile import LAYER_METRICS, layer_metrics

    rows = [LayerRow(f"lm.layers.{i}", 1.0 + i, 2.0, None, captured_gap_ms=0.5) for i in range(40)]
    rows.append(LayerRow("lm_head", 1.0, 1.0, 1.0))
    metrics, note = layer_metrics({"decode": rows})
    layers = sorted(
        int(k.split("_")[1])
        for k in metrics
        if k.startswith("layers/decode/") and k.endswith("_ms") and "gap" not in k
    )
    assert len(layers) == LAYER_METRICS and layers[0] == 0 and layers[-1] == 39
    assert metrics["layers/decode/layer_39_ms"] == 40.0 and metrics["layers/decode_eager/layer_39_ms"] == 2.0
    assert note.startswith(f"per-layer metrics for {LAYER_METRICS} of 40 layers: 0, 1, 3")
    metrics, note = layer_metrics({"decode": rows[:2]})
    assert set(metrics) >= {"layers/decode/layer_0_ms", "layers/decode/layer_1_gap_ms"} and note == ""


@pytest.mark.slow
def test_gemma3_run_reports_its_layers_by_kind(tmp_path, tracking_uri):
    """A whole run of a model with sliding and global layers: the per-layer table in tables.txt,
    layers.csv, profile.json, the report (sortable) and MLflow, its rows grouped by kind."""
    proc = run_pipeline(
        ["model=tiny_gemma3", "capture=partial", "backend=torch-simple", "profile.decode_steps=1",
         f"tracking.uri={tracking_uri}"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    profile = json.loads((run / "profile" / "profile.json").read_text())
    check_busy_gap_split(profile)
    layers = profile["layers"]
    prefill = [r["part"] for r in layers["prefill"]]
    lm = "model.language_model.layers"
    assert prefill[prefill.index(f"{lm}.0") :][:4] == [
        f"{lm}.0",
        "sliding_attention layers (1)",
        f"{lm}.1",
        "full_attention layers (1)",
    ]
    rows = {r["part"]: r for r in layers["decode"]}
    assert rows[f"{lm}.1"]["kind"] == "full_attention" and rows[f"{lm}.1"]["max_abs"] is not None
    assert rows["total"]["eager_gap_ms"] > 0 and rows["total"]["captured_gap_ms"] > 0
    assert "decode: per layer, captured vs eager" in (run / "profile" / "tables.txt").read_text()
    assert (run / "profile" / "layers.csv").exists()
    page = (run / "report" / "report.html").read_text()
    assert "<table class='sortable'>" in page and "sliding_attention layers (1)" in page
    client, (mlflow_run,) = mlflow_runs(tracking_uri)
    table = json.loads(
        Path(client.download_artifacts(mlflow_run.info.run_id, "tables/layers.json")).read_text()
    )
    part, kind = table["columns"].index("part"), table["columns"].index("kind")
    assert [f"{lm}.0", "sliding_attention"] in [[row[part], row[kind]] for row in table["data"]]
    assert mlflow_run.data.metrics["layers/decode/layer_1_ms"] == pytest.approx(
        rows[f"{lm}.1"]["captured_ms"], rel=1e-3
    )
