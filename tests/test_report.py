"""The report: breakdown data, the Markdown/HTML document, plots redrawn from a saved profile, and
a run's report and images, also when the run failed."""

from __future__ import annotations

import json

import pytest
from conftest import REPO_ROOT, check_busy_gap_split, mlflow_runs, run_pipeline

from pipeline.profiler.comparison import _rewritten_by, compared_part, comparison
from pipeline.profiler.parts import PARTS, kernel_times, module_slices, part_of, slice_of
from pipeline.profiler.results import ProfileResults
from pipeline.profiler.rows import PhaseStats, ProfileNode, Reference
from pipeline.profiler.tables import comparison_table
from pipeline.report.breakdown import breakdown, top_k
from pipeline.report.document import Image, Pre, Section, Table, to_html, to_markdown
from pipeline.report.plots import busy_gap_bars


def _node(fqn, kind, us, children=(), name=None, category=""):
    return ProfileNode(
        name or fqn.rsplit(".", 1)[-1],
        kind,
        fqn=fqn,
        device_time_us=us,
        category=category,
        children=list(children),
    )


def _stats(summary: ProfileNode, device_time_us: float | None = None) -> PhaseStats:
    """A phase holding only what the analysis reads: its summary tree and its total."""
    total = summary.device_time_us if device_time_us is None else device_time_us
    return PhaseStats(0.0, total, "one window", 0.0, 0.0, {}, summary, summary)


SUMMARY = _node(
    "",
    "phase",
    100.0,
    [
        _node(
            "demollm.step_inputs",
            "module",
            5.0,
            [_node("", "kernel", 5.0, name="aten::cat", category="memory")],
        ),
        _node(
            "",
            "module",
            90.0,
            [
                _node(
                    "lm.layers.*",
                    "module",
                    70.0,
                    [
                        _node(
                            "lm.layers.*.self_attn",
                            "module",
                            40.0,
                            [_node("", "kernel", 40.0, name="mm", category="gemm")],
                        ),
                        _node(
                            "lm.layers.*.mlp",
                            "module",
                            25.0,
                            [_node("", "kernel", 25.0, name="mm", category="gemm")],
                        ),
                    ],
                ),
                _node("lm_head", "module", 15.0, [_node("", "kernel", 15.0, name="mm", category="gemm")]),
            ],
            name="Model",
        ),
        _node(
            "(unattributed)",
            "unattributed",
            5.0,
            [_node("", "kernel", 5.0, name="aten::add", category="elementwise")],
        ),
    ],
)


def test_module_slices_split_layers_into_their_children():
    buckets = module_slices(SUMMARY)
    assert buckets == {
        "demollm.step_inputs": 5.0,
        "lm.layers.*.self_attn": 40.0,
        "lm.layers.*.mlp": 25.0,
        "lm.layers.* (self)": 5.0,
        "lm_head": 15.0,
        "Model (self)": 5.0,
        "(unattributed)": 5.0,
    }
    assert sum(buckets.values()) == pytest.approx(SUMMARY.device_time_us)
    assert module_slices(SUMMARY, depth=1) == {
        "demollm.step_inputs": 5.0,
        "Model": 90.0,
        "(unattributed)": 5.0,
    }
    assert kernel_times(SUMMARY, "category") == {"memory": 5.0, "gemm": 80.0, "elementwise": 5.0}
    assert top_k({"a": 3.0, "b": 2.0, "c": 1.0}, 1) == {"a": 3.0, "others": 3.0}


def test_breakdown_uses_the_same_parts_in_every_phase():
    profile = {"prefill": _stats(SUMMARY), "decode": _stats(SUMMARY)}
    data = breakdown(profile, "module", top=2)
    assert list(data) == ["prefill", "decode"]
    assert list(data["prefill"]) == ["lm.layers.*.self_attn", "lm.layers.*.mlp", "others"]
    assert data["decode"]["others"] == pytest.approx(0.035)  # ms
    with pytest.raises(ValueError, match="level"):
        breakdown(profile, "bogus")


def test_document_renders_markdown_and_self_contained_html(tmp_path):
    png = tmp_path / "plot.png"
    png.write_bytes(b"\x89PNG fake")
    sections = [
        Section("Summary", ["FAILED at stage 'profile': boom", Table(["a", "b"], [[1, 0.5], ["x|y", 2.0]])]),
        Section("Profile", [Pre("table <text>"), Image(png, "a plot")]),
    ]
    md = to_markdown("Title", sections, tmp_path)
    assert "| a | b |" in md and "x\\|y" in md and "![a plot](plot.png)" in md
    page = to_html("Title", sections)
    assert "data:image/png;base64," in page and "table &lt;text&gt;" in page and "class='failed'" in page
    assert "plot.png" not in page  # nothing outside the file


@pytest.mark.slow
def test_run_report_plots_images_and_redraw(tmp_path, tracking_uri):
    args = [
        "model=tiny_mistral3",
        "prompt.batch_size=2",
        "prompt.prompt_len=12",
        "prompt.output_len=4",
        "profile.decode_steps=2",
        "report.formats=[png,pdf]",
        f"tracking.uri={tracking_uri}",
    ]
    proc = run_pipeline(args, tmp_path / "ok")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "ok" / "run"
    for key in ("module_breakdown", "kernel_categories", "kernel_top", "busy_gaps"):
        assert (run / "plots" / f"{key}.png").stat().st_size > 10_000
        assert (run / "plots" / f"{key}.pdf").exists()
    md = (run / "report" / "report.md").read_text()
    for heading in ("Configuration", "Stages", "Export", "Transforms", "Capture", "Correctness", "Profile"):
        assert f"## {heading}" in md
    assert "model.multi_modal_projector" in md  # what stayed eager
    # shared as it is: no path of this machine, every stage's line with its unit
    assert str(tmp_path) not in md and str(REPO_ROOT) not in md
    assert "| transforms | done |" in md and " s (table below" in md
    assert "| latency/decode_p90_ms |" in md and "| ms |" in md
    check_busy_gap_split(json.loads((run / "profile" / "profile.json").read_text()))  # under torch-compile
    html = (run / "report" / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 5  # 3 breakdowns, busy and gaps, numerics along depth
    assert "max relative difference along depth" in html
    console = proc.stdout + proc.stderr
    summary = [line.split("summary: ", 1)[1] for line in console.splitlines() if "summary: " in line]
    assert summary[-1].startswith("report:") and any(line.startswith("prefill") for line in summary)

    client, runs = mlflow_runs(tracking_uri)
    artifacts = {a.path for a in client.list_artifacts(runs[0].info.run_id)}
    assert {"report", "plots", "profile", "traces"} <= artifacts
    images = {a.path for a in client.list_artifacts(runs[0].info.run_id, "images")}
    assert any("breakdown_module_breakdown" in p for p in images), images

    # The same plot redrawn from the saved profile, as the seed's tool does.
    from pipeline.tools.visualize import main as visualize

    out = tmp_path / "again.svg"
    assert (
        visualize(
            ["--json-trace", str(run / "profile" / "profile.json"), "--level", "module", "--output", str(out)]
        )
        == 0
    )
    assert out.read_text().startswith("<?xml")
    assert (
        visualize(
            [
                "--json-trace",
                str(run / "profile" / "profile.json"),
                "--phase",
                "decode_9",
                "--output",
                str(out),
            ]
        )
        == 2
    )
    assert visualize(["--json-trace", str(tmp_path / "missing.json"), "--output", str(out)]) == 2


@pytest.mark.slow
def test_a_failed_run_gets_a_report_of_what_it_reached(tmp_path, tracking_uri):
    proc = run_pipeline(
        [
            "model=tiny_llama3_1_8b",
            "prompt.output_len=4",
            "profile.decode_steps=2",
            f"tracking.uri={tracking_uri}",
        ],
        tmp_path,
        env={"PIPELINE_INJECT_FAULT": "profile"},
    )
    assert proc.returncode == 1
    run = tmp_path / "run"
    md = (run / "report" / "report.md").read_text()
    assert "FAILED at stage 'profile'" in md and "| generate | done |" in md and "| profile | failed |" in md
    assert "latency/decode_ms" in md
    client, runs = mlflow_runs(tracking_uri)
    assert runs[0].info.status == "FAILED" and runs[0].data.tags["failed_stage"] == "profile"
    assert "report" in {a.path for a in client.list_artifacts(runs[0].info.run_id)}
    assert json.loads((run / "generation" / "tokens.json").read_text())


def test_legend_labels_drop_the_wrappers_every_module_repeats():
    from pipeline.report.plots import legend_labels

    parts = ["model.language_model.layers.*.mlp", "lm_head", "model.vision_tower", "demollm.sample"]
    assert legend_labels(parts) == ["layers.*.mlp", "lm_head", "vision_tower", "demollm.sample"]
    clash = ["model.norm", "model.language_model.norm"]  # both would read `norm`: kept whole
    assert legend_labels(clash) == clash


def test_a_ratio_is_taken_only_of_two_measurable_times():
    """A part fused away on the captured side (a rounding residue, or nothing) shows both times and
    no ratio; a part both sides ran shows eager / captured."""
    rows = {
        r.part: r
        for r in (
            compared_part("norm", 1e-9, 176.0),
            compared_part("plan", 0.0, 0.0),
            compared_part("mlp", 100_000.0, 150_000.0),
        )
    }
    assert rows["norm"].speedup is None and rows["norm"].eager_ms == 0.176
    assert rows["plan"].speedup is None
    assert rows["mlp"].speedup == 1.5
    table = comparison_table(list(rows.values()), "decode")
    assert "captured vs Hugging Face generate (eager)" in table
    norm_line = next(line for line in table.splitlines() if line.startswith("norm "))
    assert norm_line.split()[5] == "-" and "no time on the captured side" in norm_line


@pytest.mark.parametrize(
    ("bucket", "part"),
    [
        ("model.language_model.layers.*.self_attn", "attention"),
        ("model.layers.*.mlp", "mlp"),
        ("language_model.model.layers.*.feed_forward", "mlp"),  # Llama-4's MoE layer
        ("model.layers.*.input_layernorm", "norms"),
        ("model.language_model.norm", "norms"),
        ("lm_head", "lm_head"),
        ("model.language_model.embed_tokens", "embeddings"),
        ("model.vision_tower.transformer.layers.*.attention", "vision_tower"),
        ("model.visual.blocks.0", "vision_tower"),
        ("model.multi_modal_projector", "projector"),
        ("demollm.sample", "demollm"),
        ("(unattributed)", "unattributed"),
        ("model.language_model (self)", "other"),
        ("model.layers.* (self)", "other"),
    ],
)
def test_every_module_bucket_has_one_top_level_part(bucket, part):
    assert part_of(bucket) == part and part in PARTS


def test_parts_whose_work_differs_are_shown_as_such():
    """A part a model-scope rewrite changed (the vision tower's linears through oneDNN) is that
    rewrite's gain, not capture's; a part fused away on the captured side is said to be; neither
    gets a ratio."""
    rewritten = {
        "model.vision_tower.transformer.layers.0.feed_forward.w1": "onednn_linear",
        "lm_head": "onednn_linear",
    }
    assert _rewritten_by("model.vision_tower.transformer.layers.*.feed_forward", rewritten) == "onednn_linear"
    assert _rewritten_by("lm_head", rewritten) == "onednn_linear"
    assert _rewritten_by("model.language_model.layers.*.mlp", rewritten) == ""
    fused = compared_part("model.language_model.layers.*.input_layernorm", 0.0, 176.0)
    assert fused.speedup is None and fused.note.startswith("no time on the captured side")
    assert compared_part("mlp", 100.0, 150.0).note == ""
    assert _rewritten_by("model.vision_tower (self)", rewritten) == ""  # the container's own time


def _summary(times: dict[str, float]) -> ProfileNode:
    """A phase's summary tree of one decoder layer's children (fqn -> device us), the layer's own
    time `layer` (0 unless given), with the graph's own time as `model.language_model` (self)."""

    def node(fqn, us, children=()):
        return {
            "kind": "module",
            "name": fqn.rsplit(".", 1)[-1],
            "fqn": fqn,
            "device_time_us": us,
            "children": list(children),
        }

    own = times.get("layer", 0.0)  # the layer's own time (its residual adds)
    layer = node("model.language_model.layers.*", own + sum(v for k, v in times.items() if ".layers." in k),
                 [node(k, v) for k, v in times.items() if ".layers." in k])  # fmt: skip
    outside = [node(k, v) for k, v in times.items() if ".layers." not in k and k not in ("graph", "layer")]
    graph = node("model.language_model", layer["device_time_us"] + times.get("graph", 0.0), [layer, *outside])
    return ProfileNode.from_dict(
        {
            "kind": "phase",
            "name": "decode",
            "fqn": "",
            "device_time_us": graph["device_time_us"],
            "children": [graph],
        }
    )


def test_parts_inductor_fused_get_one_ratio_over_the_group():
    """Inductor computed the norm's nodes in the attention's and the MLP's kernels (provenance): the
    three parts get no ratio each, and one `fused:` row sums them on both sides; the embedding,
    fused with nothing, keeps its own; the graph's own time has none."""
    lm = "model.language_model"
    captured = _summary({f"{lm}.layers.*.self_attn": 300.0, f"{lm}.layers.*.input_layernorm": 0.0,
                         f"{lm}.layers.*.mlp": 200.0, f"{lm}.embed_tokens": 50.0, "graph": 400.0})  # fmt: skip
    eager = _summary({f"{lm}.layers.*.self_attn": 200.0, f"{lm}.layers.*.input_layernorm": 100.0,
                      f"{lm}.layers.*.mlp": 300.0, f"{lm}.embed_tokens": 100.0, "graph": 20.0})  # fmt: skip
    fused = {f"{lm}.layers.0.input_layernorm": {f"{lm}.layers.0.self_attn", f"{lm}.layers.1.mlp.up_proj"}}
    rows = comparison({"decode": _stats(captured, 950.0)}, {"decode": _stats(eager, 720.0)},
                      phases=("decode",), fused=fused, graphs=(lm,))["decode"]  # fmt: skip
    by_part = {r.part: r for r in rows}
    norm = by_part[f"{lm}.layers.*.input_layernorm"]
    assert norm.speedup is None and norm.note.startswith("fused into layers.*.mlp, layers.*.self_attn")
    attention = by_part[f"{lm}.layers.*.self_attn"]
    assert attention.speedup is None and "holds fused layers.*.input_layernorm" in attention.note
    group = by_part["fused: layers.*.mlp + 2 more"]
    assert (group.captured_ms, group.eager_ms) == (0.5, 0.6)
    assert group.speedup == pytest.approx(1.2)
    assert by_part[f"{lm}.embed_tokens"].speedup == 2.0
    assert by_part[f"{lm} (self)"].speedup is None
    assert rows[-1].part == "total"


def _timed(fqn, kind, us, gap, children=()):
    """A node whose work took `us`, all busy, with `gap` us between it."""
    node = _node(fqn, kind, us, children)
    node.busy_us, node.gap_us, node.span_us = us, gap, us + gap
    return node


def test_each_parts_gain_splits_into_busy_time_saved_and_gaps_removed():
    """Per part and for the step: each side's gaps, and how much of the difference is faster work
    and how much is less time between it; a container's own row holds the gaps between its
    children."""

    def side(attn, attn_gap, mlp, mlp_gap, layer_gap, step_gap):
        layer = _timed("lm.layers.*", "module", attn + mlp, layer_gap,
                       [_timed("lm.layers.*.self_attn", "module", attn, attn_gap),
                        _timed("lm.layers.*.mlp", "module", mlp, mlp_gap)])  # fmt: skip
        return _stats(
            _timed(
                "", "phase", attn + mlp, step_gap, [_timed("lm", "module", attn + mlp, layer_gap, [layer])]
            )
        )

    captured, eager = (
        side(300.0, 20.0, 200.0, 10.0, 40.0, 50.0),
        side(400.0, 200.0, 200.0, 100.0, 500.0, 600.0),
    )
    rows = {
        r.part: r for r in comparison({"decode": captured}, {"decode": eager}, phases=("decode",))["decode"]
    }
    attention = rows["lm.layers.*.self_attn"]
    assert (attention.captured_gap_ms, attention.eager_gap_ms) == pytest.approx((0.02, 0.2))
    assert (attention.busy_saved_ms, attention.gaps_removed_ms) == pytest.approx((0.1, 0.18))
    assert rows["lm.layers.*.mlp"].busy_saved_ms == pytest.approx(0.0)
    between = rows["lm.layers.* (self)"]  # 500 - 200 - 100 us between the eager layer's children
    assert (between.eager_gap_ms, between.captured_gap_ms) == pytest.approx((0.2, 0.01))
    total = rows["total"]
    assert (total.busy_saved_ms, total.gaps_removed_ms) == pytest.approx((0.1, 0.55))
    table = comparison_table(list(rows.values()), "decode")
    assert "gaps removed" in table and "0.180" in table


def test_the_busy_and_gap_bars_hold_each_parts_split_on_both_sides():
    def side(attn_gap):
        layer = _timed("lm.layers.*", "module", 300.0, attn_gap,
                       [_timed("lm.layers.*.self_attn", "module", 300.0, attn_gap)])  # fmt: skip
        return {
            "decode": _stats(
                _timed("", "phase", 300.0, attn_gap, [_timed("lm", "module", 300.0, attn_gap, [layer])])
            )
        }

    profile = ProfileResults({}, side(20.0), reference=Reference("eager", side(200.0)))
    bars = busy_gap_bars(profile)
    assert list(bars) == ["decode"]
    assert bars["decode"]["attention captured"] == pytest.approx((0.3, 0.02))
    assert bars["decode"]["attention eager"] == pytest.approx((0.3, 0.2))
    assert set(bars["decode"]) == {"attention captured", "attention eager"}  # parts with no time left out


def test_a_module_maps_to_the_bucket_its_time_is_counted_in():
    buckets = {"model.layers.*.mlp", "model.layers.* (self)", "model (self)", "lm_head"}
    assert slice_of("model.layers.3.mlp.down_proj", buckets) == "model.layers.*.mlp"
    assert slice_of("model.layers.3", buckets) == "model.layers.* (self)"
    assert slice_of("model.layers.3.input_layernorm", buckets) == "model.layers.* (self)"
    assert slice_of("model.norm", buckets) == "model (self)"
    assert slice_of("lm_head", buckets) == "lm_head"
    assert slice_of("vision.proj", buckets) is None


def test_each_part_is_set_against_the_longer_of_its_read_and_gemm_times():
    """Hand-computed: a 4 MiB MLP (1 Mi float32 weights) must read 4 MiB a step: 41.9 us at 100
    GB/s; fed 1 token its GEMM takes 2.1 us at 1 TFLOP/s, so in decode the read is its roof. Fed
    1000 tokens its GEMM takes 2097 us at the rate measured at that shape: the GEMM is its roof.
    Attention's roof adds the KV cache it reads (1001 tokens x 512 bytes). A part faster than its
    roof is a roof error, never a percent above 100; the vision tower gets no rate."""
    from torch import nn

    from pipeline.profiler.roofline import Roofs, gemm_shapes, roofline, roofline_table

    model = nn.Module()
    model.model = nn.Module()
    model.model.language_model = nn.Module()
    model.model.vision_tower = nn.Linear(64, 64, bias=False)
    layer = nn.Module()
    layer.mlp = nn.Linear(1024, 1024, bias=False)
    layer.self_attn = nn.Linear(1024, 256, bias=False)
    layer.input_layernorm = nn.LayerNorm(1024)
    model.model.language_model.layers = nn.ModuleList([layer])
    lm = "model.language_model.layers.*"
    mlp, attn, norm = f"{lm}.mlp", f"{lm}.self_attn", f"{lm}.input_layernorm"
    roofs = Roofs(
        read_gbs=100.0,
        steps={
            "prefill": {"tokens": 1000, "rows": 1, "context": 1000, "sequences": 1},
            "decode": {"tokens": 1, "rows": 1, "context": 1001, "sequences": 1},
        },
        gemm_tflops={"1000,1024,1024": 1.0, "1000,1024,256": 1.0},
        kv_token_bytes=512,
    )
    shapes = gemm_shapes(model, roofs)  # measured on the model's own weights of each shape
    assert {key: (m, k, n) for key, (m, k, n, _) in shapes.items()} == {
        "1000,1024,1024": (1000, 1024, 1024),
        "1000,1024,256": (1000, 1024, 256),
    }
    assert shapes["1000,1024,1024"][3].data_ptr() == layer.mlp.weight.data_ptr()
    prefill = _summary({mlp: 3000.0, attn: 100.0, norm: 5.0, "model.vision_tower": 50.0})
    decode = _summary({mlp: 100.0, attn: 1.0, norm: 5.0, "model.vision_tower": 50.0})
    rows = roofline({"prefill": _stats(prefill), "decode": _stats(decode)}, model, roofs)
    by = {phase: {r.part: r for r in rows[phase]} for phase in rows}
    assert norm not in by["decode"]
    assert by["decode"][mlp].bound == "read"
    assert by["decode"][mlp].roof_ms == pytest.approx(4 * 2**20 / 100e9 * 1e3)
    assert by["decode"][mlp].pct_of_roof == pytest.approx(100 * 4 * 2**20 / 100e9 / 100e-6)
    assert by["prefill"][mlp].bound == "gemm"
    assert by["prefill"][mlp].pct_of_roof == pytest.approx(100 * 2 * 1000 * 2**20 / 1e12 / 3000e-6)
    kv = by["decode"][attn]
    assert kv.kv_mib == pytest.approx(1001 * 512 / 2**20)
    assert kv.roof_ms == pytest.approx((1024 * 256 * 4 + 1001 * 512) / 100e9 * 1e3)
    assert kv.roof_error and kv.pct_of_roof is None  # 1 us is under its 15.6 us roof
    assert by["prefill"]["model.vision_tower"].gbs is None
    table = roofline_table(rows["decode"], "decode", roofs)
    assert "ROOF ERROR: 0.001 ms < roof 0.016 ms" in table and "weights MiB" in table
    assert all(r.pct_of_roof is None or r.pct_of_roof <= 100 for phase in rows for r in rows[phase])


def test_no_ratio_over_unlike_work():
    """A whole-model graph's prefill computes the lm_head on every prompt row, eager on the last;
    demollm's spans are each runner's own: neither gets a ratio. In decode (one row each side) the
    lm_head keeps its ratio; a partly captured model's eager lm_head keeps it in prefill too."""

    def summary(head_us: float, steps_us: float) -> ProfileNode:
        return ProfileNode.from_dict({
            "kind": "phase",
            "name": "prefill",
            "fqn": "",
            "device_time_us": head_us + steps_us,
            "children": [
                {"kind": "module", "name": "lm_head", "fqn": "lm_head", "device_time_us": head_us, "children": []},
                {"kind": "module", "name": "step_inputs", "fqn": "demollm.step_inputs",
                 "device_time_us": steps_us, "children": []},
            ],
        })  # fmt: skip

    def phases(head_us, steps_us):
        return {p: _stats(summary(head_us, steps_us)) for p in ("prefill", "decode")}

    whole = comparison(phases(500.0, 50.0), phases(10.0, 10.0), graphs=("",))
    by = {phase: {r.part: r for r in rows} for phase, rows in whole.items()}
    assert by["prefill"]["lm_head"].speedup is None and "every prompt row" in by["prefill"]["lm_head"].note
    assert by["decode"]["lm_head"].speedup == pytest.approx(0.02)
    for phase in by:
        assert by[phase]["demollm.step_inputs"].speedup is None
        assert "each runner's own" in by[phase]["demollm.step_inputs"].note
    partial = comparison(phases(500.0, 50.0), phases(10.0, 10.0), graphs=("model.language_model",))
    assert next(r for r in partial["prefill"] if r.part == "lm_head").speedup == pytest.approx(0.02)


def test_work_a_graph_transform_moved_between_parts_gets_one_ratio_named_by_it():
    """fuse_add_rmsnorm moved each layer's residual add (its own time) into the norm after it (the
    transform history's `moved`): neither part gets a ratio of its own, both notes name the
    transform, and one row sums the two on both sides; the MLP, untouched, keeps its ratio."""
    lm = "model.language_model"
    norm, mlp = f"{lm}.layers.*.post_attention_layernorm", f"{lm}.layers.*.mlp"
    captured = _summary({norm: 30.0, mlp: 100.0, "layer": 0.0})  # the add is inside the norm now
    eager = _summary({norm: 20.0, mlp: 150.0, "layer": 15.0})
    moved = {f"{lm}.layers.0": {f"{lm}.layers.0.post_attention_layernorm": "fuse_add_rmsnorm"}}
    rows = comparison(
        {"decode": _stats(captured, 130.0)},
        {"decode": _stats(eager, 185.0)},
        moved=moved,
    )["decode"]
    by = {r.part: r for r in rows}
    assert by[norm].speedup is None and "by fuse_add_rmsnorm" in by[norm].note
    assert by[f"{lm}.layers.* (self)"].speedup is None
    assert (
        "fused into layers.*.post_attention_layernorm by fuse_add_rmsnorm" in by[f"{lm}.layers.* (self)"].note
    )
    group = next(r for r in rows if r.part.startswith("fused:"))
    assert (group.captured_ms, group.eager_ms) == pytest.approx((0.03, 0.035))
    assert by[mlp].speedup == pytest.approx(1.5)


def test_a_mixture_of_experts_decode_reads_only_the_experts_its_tokens_reach():
    """8 experts of [n=256, k=128] float32 (128 KiB each), 2 routed per token: a decode step of 1
    token reaches 2 experts (256 KiB), a prefill of 1000 tokens all 8; the FLOPs are the routed
    ones either way."""
    import torch
    from torch import nn

    from pipeline.profiler.roofline import Roofs, work

    model = nn.Module()
    layer = nn.Module()
    layer.mlp = nn.Module()
    layer.mlp.experts = nn.Module()
    layer.mlp.experts.gate_up_proj = nn.Parameter(torch.zeros(8, 256, 128))
    model.layers = nn.ModuleList([layer])
    roofs = Roofs(
        read_gbs=100.0,
        steps={
            "prefill": {"tokens": 1000, "rows": 1, "context": 1000, "sequences": 1},
            "decode": {"tokens": 1, "rows": 1, "context": 1001, "sequences": 1},
        },
        experts_per_token=2,
    )
    decode = work(model, {"layers.*.mlp"}, "decode", roofs)["layers.*.mlp"]
    prefill = work(model, {"layers.*.mlp"}, "prefill", roofs)["layers.*.mlp"]
    expert = 256 * 128 * 4
    assert decode.weight_bytes == prefill.weight_bytes == 8 * expert
    assert (decode.read_bytes, prefill.read_bytes) == (2 * expert, 8 * expert)
    assert decode.flops == 2 * 2 * 256 * 128 and prefill.flops == 2 * 2000 * 256 * 128
