"""The layerwise profiler: trees from synthetic windows (CPU and GPU shapes of events), module
ranges in exported graphs, and the profile stage end to end against eager."""

from __future__ import annotations

import csv
import dataclasses
import json
import re
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    REPO_ROOT,
    attributed_kernel_pct,
    build_tiny,
    check_busy_gap_split,
    compose_cfg,
    layer_kernel_pct,
    mlflow_runs,
    run_pipeline,
    staged,
)
from torch import nn
from torch._C._autograd import DeviceType
from torch._C._profiler import _EventType

from pipeline.config import validate
from pipeline.errors import ConfigError
from pipeline.export import graph_capture
from pipeline.profiler import events, ranges, tables, tree
from pipeline.profiler.categories import Categorizer
from pipeline.profiler.events import DeviceEvent, ModuleSpan, OpEvent, Window
from pipeline.profiler.results import ProfileResults
from pipeline.profiler.roofline import Roofs
from pipeline.profiler.rows import ComparedPart, LayerRow, PhaseStats, ProfileNode, Reference, RoofRow

CATEGORIES = Categorizer(compose_cfg().profile.kernel_categories)


def _op(name, start, end, parent=None, shapes=None):
    op = OpEvent(name, start, end, shapes or [], parent=parent)
    if parent is not None:
        parent.child_ns += end - start
    return op


def _cpu_window() -> Window:
    """Two layers of a model, an op outside any module, a nested op chain."""
    linear = _op("aten::linear", 110, 150)
    mm = _op("aten::mm", 115, 145, parent=linear, shapes=[[2, 4], [4, 4]])
    return Window(
        modules=[
            ModuleSpan("", "Model", [], 100, 400),
            ModuleSpan("layers.0", "Layer", [], 105, 200),
            ModuleSpan("layers.0.proj", "Linear", [("weight", [4, 4])], 108, 160),
            ModuleSpan("layers.1", "Layer", [], 200, 300),
        ],
        ops=[linear, mm, _op("aten::add", 210, 260), _op("aten::cat", 20, 60), _op("aten::mul", 310, 330)],
    )


def _children_within_parent(node: tree.Node) -> None:
    for child in node.children.values():
        _children_within_parent(child)
    assert sum(c.device_time_us for c in node.children.values()) <= node.device_time_us + 1e-6


def test_cpu_tree_attributes_by_time_and_keeps_unattributed():
    root = tree.model_tree(_cpu_window(), "decode_1", CATEGORIES)
    model = root.children[("module", "")]
    proj = model.children[("module", "layers.0")].children[("module", "layers.0.proj")]
    kernels = {c.name: c for c in proj.children.values()}
    # linear's own 10 ns and mm's 30 ns are each a leaf; mm's trace says where it came from.
    assert kernels["aten::mm"].device_time_us == pytest.approx(0.030)
    assert kernels["aten::mm"].trace == "aten::linear > aten::mm" and kernels["aten::mm"].category == "gemm"
    assert kernels["aten::linear"].device_time_us == pytest.approx(0.010)
    assert proj.device_time_us == pytest.approx(0.040) and proj.params == [("weight", [4, 4])]
    assert model.device_time_us == pytest.approx(0.040 + 0.050 + 0.020)  # layers and its own mul
    unattributed = root.children[("unattributed",)]
    assert unattributed.device_time_us == pytest.approx(0.040)  # the cat before the model ran
    assert root.device_time_us == pytest.approx(0.150)
    _children_within_parent(root)
    attributed, in_layers = tree.coverage(root)
    assert attributed == pytest.approx(100 * 0.110 / 0.150)
    assert in_layers == pytest.approx(100 * 0.090 / 0.110)


def test_summary_merges_layers_and_mean_averages_windows():
    root = tree.model_tree(_cpu_window(), "decode_1", CATEGORIES)
    summary = tree.summary_tree(root)
    layers = summary.children[("module", "")].children[("module", "layers.*")]
    assert layers.name == "layers.*" and layers.invocations == 2
    assert layers.device_time_us == pytest.approx(0.090)
    mean = tree.mean_tree([root, tree.model_tree(_cpu_window(), "decode_2", CATEGORIES)], "decode")
    assert mean.device_time_us == pytest.approx(root.device_time_us)
    model = next(c for c in mean.children.values() if c.kind == "module" and c.fqn == "")
    assert model.invocations == 1 and model.device_time_us == pytest.approx(0.110)


def test_gpu_window_tree_places_kernels_at_their_launch():
    """Kernels count as device time where they were launched; a CUDA graph replay's kernels all
    sit under the runner that launched the graph."""
    window = Window(
        modules=[
            ModuleSpan("lm", "GraphModule", [], 100, 500),
            ModuleSpan("lm.cuda_graph_runner", "CUDAGraphRunner", [], 110, 490),
        ],
        ops=[_op("aten::copy_", 120, 130), _op("aten::argmax", 600, 610)],
        device=[
            DeviceEvent("gemm_kernel", 7000, 150, None),
            DeviceEvent("rms_norm_kernel", 3000, 150, None),
            DeviceEvent("argmax_kernel", 500, 605, None),
        ],
        on_device=True,
    )
    root = tree.model_tree(window, "decode_1", CATEGORIES)
    runner = root.children[("module", "lm")].children[("module", "lm.cuda_graph_runner")]
    assert runner.device_time_us == pytest.approx(10.0)
    assert {c.category for c in runner.children.values()} == {"gemm", "norm"}
    assert root.children[("unattributed",)].device_time_us == pytest.approx(0.5)


def test_busy_time_and_gaps_per_call_on_cpu():
    """Each call's span runs from its first op to its last; busy is the union of its ops (nested
    mm inside linear once); the gaps are the rest. A call counts the ops it dispatched itself."""
    root = tree.model_tree(_cpu_window(), "decode_1", CATEGORIES)
    model = root.children[("module", "")]
    layer = model.children[("module", "layers.0")]
    assert (layer.span_us, layer.busy_us, layer.gap_us, layer.launches) == pytest.approx((0.040, 0.040, 0, 1))
    # linear 110-150, add 210-260, mul 310-330: 220 ns from first to last, 110 of them busy
    assert (model.span_us, model.busy_us, model.gap_us, model.launches) == pytest.approx(
        (0.220, 0.110, 0.110, 3)
    )
    assert (root.span_us, root.busy_us, root.launches) == pytest.approx((0.310, 0.150, 4))  # cat at 20-60 too
    outside = root.children[("unattributed",)]
    assert (outside.busy_us, outside.gap_us) == pytest.approx((0.040, 0))
    summary = tree.summary_tree(root)
    layers = summary.children[("module", "")].children[("module", "layers.*")]
    assert (layers.span_us, layers.busy_us, layers.launches) == pytest.approx((0.090, 0.090, 2))
    mean = tree.mean_tree([root, tree.model_tree(_cpu_window(), "decode_2", CATEGORIES)], "decode")
    assert (mean.span_us, mean.busy_us, mean.launches) == pytest.approx((0.310, 0.150, 4))


def test_gaps_between_kernels_on_the_device_clock():
    """On a GPU the busy time and gaps are the kernels' own intervals on the device, wherever
    their launches sat; a replay's kernels count for the modules their stack names, once per replay."""
    stack = (("lm.layers.0", "Layer"), ("lm.layers.0.mlp", "MLP"))
    window = Window(
        modules=[
            ModuleSpan("lm", "GraphModule", [], 100, 500),
            ModuleSpan("lm.runner", "Runner", [], 110, 490),
        ],
        ops=[_op("cudaGraphLaunch", 120, 130)],
        device=[
            DeviceEvent("gemm_kernel", 1000, 150, None, start_ns=10_000, correlation=5, stack=stack),
            DeviceEvent("act_kernel", 500, 150, None, start_ns=14_000, correlation=5, stack=stack),
            DeviceEvent("gemm_kernel", 1000, 150, None, start_ns=20_000, correlation=6, stack=stack),
        ],
        on_device=True,
    )
    root = tree.model_tree(window, "decode_1", CATEGORIES)
    runner = root.children[("module", "lm")].children[("module", "lm.runner")]
    assert (runner.span_us, runner.busy_us, runner.gap_us, runner.launches) == pytest.approx(
        (11.0, 2.5, 8.5, 3)
    )
    mlp = runner.children[("module", "lm.layers.0")].children[("module", "lm.layers.0.mlp")]
    # two replays: 10.0-11.0 and 14.0-14.5 in one (4.5 us span), 20.0-21.0 in the other
    assert (mlp.span_us, mlp.busy_us, mlp.launches) == pytest.approx((5.5, 2.5, 3))


class _Pausing(nn.Module):
    """Two linear calls with a host pause between them."""

    def __init__(self, pause_s: float):
        super().__init__()
        self.proj, self.pause_s = nn.Linear(32, 32), pause_s

    def forward(self, x):
        x = self.proj(x)
        if self.pause_s:
            time.sleep(self.pause_s)
        return self.proj(x)


@pytest.mark.parametrize("pause_s", [0.02, 0.0])
def test_a_host_pause_between_ops_is_found_as_a_gap(pause_s):
    """Profiled for real: the sleep put between a module's ops is its gap; with no sleep, the
    gap is only the dispatch between two calls, far below it. On CPU busy time is device time."""
    model = _Pausing(pause_s)
    x = torch.randn(4, 32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
        model(x)
    window = events.read_window(prof, {id(m): name for name, m in model.named_modules()})
    node = tree.model_tree(window, "prefill", CATEGORIES).children[("module", "")]
    assert node.busy_us == pytest.approx(node.device_time_us, rel=0.01)
    assert node.busy_us + node.gap_us == pytest.approx(node.span_us)
    if pause_s:
        assert node.gap_us >= pause_s * 1e6
    else:
        assert node.gap_us < 0.005 * 1e6  # a few ms at most even on a slow host: no pause there


class _Event(SimpleNamespace):
    """A stand-in for the profiler's _ProfilerEvent."""

    def __init__(self, tag, name, start, end, children=(), correlation=0, module=None, tid=1):
        super().__init__(
            tag=tag,
            name=name,
            start_time_ns=start,
            end_time_ns=end,
            children=list(children),
            correlation_id=correlation,
            start_tid=tid,
            extra_fields=SimpleNamespace(module=module, inputs=[]),
        )


class _Kineto:
    def __init__(self, name, correlation, duration, device=DeviceType.CUDA):
        self._name, self._correlation, self._duration, self._device = name, correlation, duration, device

    def name(self):
        return self._name

    def correlation_id(self):
        return self._correlation

    def duration_ns(self):
        return self._duration

    def device_type(self):
        return self._device

    def start_ns(self):
        return 0


def test_read_window_ties_device_events_to_launches():
    """A kernel in the tree under its launch, and a graph replay's kernels found only by their
    cudaGraphLaunch's correlation id: both land in the module that launched them."""
    runner_info = SimpleNamespace(cls_name="CUDAGraphRunner", self_ptr=7, parameters=[])
    launch_kernel = _Event(
        _EventType.Kineto, "cudaLaunchKernel", 130, 135, [_Event(_EventType.Kineto, "k_add", 900, 910, correlation=5)],
        correlation=5,
    )  # fmt: skip
    add = _Event(_EventType.TorchOp, "aten::add", 120, 140, [launch_kernel])
    replay = _Event(_EventType.Kineto, "cudaGraphLaunch", 200, 210, correlation=9)
    runner = _Event(_EventType.PyCall, "nn.Module: CUDAGraphRunner_0", 150, 300, [replay], module=runner_info)
    other_thread = _Event(_EventType.PyCall, "threading.py: run", 0, 1000, tid=2)
    prof = SimpleNamespace(
        profiler=SimpleNamespace(
            kineto_results=SimpleNamespace(
                experimental_event_tree=lambda: [other_thread, add, runner],
                events=lambda: [
                    _Kineto("k_add", 5, 10),
                    _Kineto("gemm", 9, 40),
                    _Kineto("gemm", 9, 40),
                    _Kineto("aten::add", 5, 20, DeviceType.CPU),
                ],
            )
        )
    )
    window = events.read_window(prof, {7: "lm.cuda_graph_runner"})
    assert window.on_device and [m.fqn for m in window.modules] == ["lm.cuda_graph_runner"]
    placed = {(d.name, d.anchor_ns, d.op.name if d.op else None) for d in window.device}
    assert placed == {("k_add", 130, "aten::add"), ("gemm", 200, None)}
    assert sum(d.duration_ns for d in window.device) == 90
    root = tree.model_tree(window, "decode_1", CATEGORIES)
    assert root.children[("module", "lm.cuda_graph_runner")].device_time_us == pytest.approx(0.080)


def test_a_module_outside_the_model_is_no_part_of_it():
    """A library's function wrapped as an nn.Module (transformers' hub-kernel `Func` around rotary
    embedding) runs inside a model module: its ops stay with that module, no `<Func>` node."""
    attention = SimpleNamespace(cls_name="LlamaAttention", self_ptr=3, parameters=[])
    wrapper = SimpleNamespace(cls_name="Func", self_ptr=99, parameters=[])
    mul = _Event(_EventType.TorchOp, "aten::mul", 130, 140)
    func = _Event(_EventType.PyCall, "nn.Module: Func_0", 120, 150, [mul], module=wrapper)
    attn = _Event(_EventType.PyCall, "nn.Module: LlamaAttention_0", 100, 200, [func], module=attention)
    prof = SimpleNamespace(
        profiler=SimpleNamespace(
            kineto_results=SimpleNamespace(experimental_event_tree=lambda: [attn], events=lambda: [])
        )
    )
    window = events.read_window(prof, {3: "model.layers.0.self_attn"})
    assert [m.fqn for m in window.modules] == ["model.layers.0.self_attn"]
    root = tree.model_tree(window, "prefill", CATEGORIES)
    node = root.children[("module", "model.layers.0.self_attn")]
    assert [child.name for child in node.children.values()] == ["aten::mul"], node.children


def test_module_ranges_wrap_graph_nodes_and_leave_no_trace():
    model, hf_config, examples = build_tiny("tiny_llama3_1_8b")
    model, _ = graph_capture.capture(model, [""], examples.text)
    code = model.code
    expected = model(**examples.text).logits
    with ranges.module_ranges(model) as paths:
        assert paths == ["root"]
        names = [n.args[0] for n in model.graph.nodes if n.target is ranges.ENTER]
        assert "module::model.layers.1.self_attn.o_proj|Linear" in names
        assert "module::lm_head|Linear" in names
        assert sum(n.target is ranges.ENTER for n in model.graph.nodes) == sum(
            n.target is ranges.EXIT for n in model.graph.nodes
        )
        torch.testing.assert_close(model(**examples.text).logits, expected, rtol=0, atol=0)
    assert model.code == code


def test_tables_cut_by_depth_and_top_k():
    summary = ProfileNode.of(tree.summary_tree(tree.model_tree(_cpu_window(), "decode_1", CATEGORIES)))
    full = tables.format_table(summary, "t")
    assert "aten::mm" in full and "(unattributed)" in full
    shallow = tables.format_table(summary, "t", depth=1)
    assert "layers.*" not in shallow and "Model" in shallow
    top = tables.format_table(summary, "t", top_k=1)
    assert "... 1 more" in top


def test_a_saved_profile_loads_back_into_the_same_results(tmp_path):
    """profile.json round-trips: every field of every phase, node, comparison row and roof row, the
    decode mean's own fields included; what is not a profile.json says so in one line."""
    root = tree.model_tree(_cpu_window(), "decode_1", CATEGORIES)
    decode = PhaseStats.of(root, 2.5, "mean of 1 windows")
    decode.step_ms_median, decode.mean_of = 2.4, ["decode_1"]
    phases = {
        "prefill": PhaseStats.of(root, 9.0, "one window"),
        "decode_1": PhaseStats.of(root, 2.5, "one window"),
    }
    phases["decode"] = decode
    results = ProfileResults(
        {"model": "tiny", "batch_size": 2},
        phases,
        reference=Reference("eager", {"decode": PhaseStats.of(root, 3.0, "one window")}),
        fused={"model.norm": ["model.layers.0.mlp"]},
        comparison={
            "decode": [ComparedPart("mlp", 1.0, 1.5, 1.5), ComparedPart("total", 2.0, 3.0, None, "why")]
        },
        roofs=Roofs(read_gbs=10.0, steps={"decode": {"tokens": 1, "rows": 1, "context": 9, "sequences": 1}}),
        roofline={"decode": [RoofRow("mlp", 1.0, 4.0, 0.0, 5.0, 0.1, "read", 0.4, 40.0)]},
        layers={
            "decode": [
                LayerRow("layers.0", 1.0, 1.5, 1.5, "", 0.9, 0.1, 1.2, 0.3, "moe", 40.0, 1e-6, 1e-7, True)
            ]
        },
    )
    files, printed = results.write(tmp_path, None, None)
    loaded = ProfileResults.load(tmp_path / "profile.json")
    assert loaded == results
    assert "decode summary table (mean of 1 windows)" in printed and "against its roof" in printed
    assert {f.name for f in files} >= {
        "profile.json",
        "tables.txt",
        "comparison.csv",
        "model_stats.csv",
        "layers.csv",
    }
    assert "decode: per layer" in printed and loaded.phases["decode"].model_stats.span_us > 0
    assert loaded.phases["decode"].summary_stats.children[0].children, "the tree came back flat"
    (tmp_path / "bad.json").write_text('{"schema_version": 2, "phases": {"decode": {}}}')
    with pytest.raises(ValueError, match="bad.json: a profile.json missing or mistyping 'step_ms'"):
        ProfileResults.load(tmp_path / "bad.json")


@pytest.mark.parametrize(
    ("kernel", "category"),
    [
        ("_rms_norm_kernel", "norm"),
        ("pipeline::add_rms_norm", "norm"),
        ("_rope_kernel", "rope"),
        ("_silu_and_mul_kernel", "elementwise"),
        ("pipeline::silu_and_mul", "elementwise"),
        ("_attention_plan_kernel", "attention"),
        ("_paged_attention_kernel", "attention"),
        ("pipeline::onednn_linear", "gemm"),
    ],
)
def test_default_categories_place_the_pipelines_own_kernels(kernel, category):
    """The Triton kernels (GPU names) and canonical ops (CPU names) land in their categories."""
    assert CATEGORIES(kernel) == category


def test_bad_kernel_category_regex_is_refused():
    with pytest.raises(ConfigError, match=r"profile.kernel_categories.gemm"):
        validate(compose_cfg(["profile.kernel_categories.gemm='(unclosed'"]), cuda_available=False)


def _profile(tmp_path, name, overrides, uri):
    proc = run_pipeline(
        [
            "model=tiny_llama3_1_8b",
            "prompt.batch_size=2",
            "prompt.prompt_len=12",
            "prompt.output_len=4",
            "profile.decode_steps=2",
            f"tracking.uri={uri}",
            *overrides,
        ],
        tmp_path / name,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / name / "run"
    return run, json.loads((run / "profile" / "profile.json").read_text()), proc


def _modules(node: dict, kind: str = "module") -> set[str]:
    found = {node["fqn"]} if node["kind"] == kind else set()
    for child in node["children"]:
        found |= _modules(child, kind)
    return found


def _nodes(node: dict):
    yield node
    for child in node["children"]:
        yield from _nodes(child)


def _writes(source: str, name: str) -> bool:
    """Whether Python source writes a file called `name`: straight from the path, or through a
    variable holding it."""
    if re.search(rf'"{re.escape(name)}"\)\.(write_text|open\("w)', source):
        return True
    held = re.findall(rf'(\w+) = [^\n]*"{re.escape(name)}"', source)
    return any(re.search(rf"\b{v}\.(write_text|write_bytes|open\(\"w)", source) for v in held)


def _check_sums(node: dict) -> None:
    # profile.json rounds each value to 1e-3 us
    assert sum(c["device_time_us"] for c in node["children"]) <= node["device_time_us"] + 1e-3 * (
        1 + len(node["children"])
    )
    for child in node["children"]:
        _check_sums(child)


@pytest.mark.slow
def test_profile_of_the_graph_matches_eager(tmp_path, tracking_uri, capsys):
    model, hf_config, examples = build_tiny("tiny_llama3_1_8b")
    layers = hf_config.num_hidden_layers
    eager_modules = set(dict(model.named_modules()))
    captured, _ = graph_capture.capture(model, [""], examples.text)
    # The graph runs the eager modules' code (ranges) and export's own helpers (_guards_fn).
    graph_modules = eager_modules | set(dict(captured.named_modules()))
    graph_run, graph, proc = _profile(
        tmp_path, "graph", ["capture=partial", "backend=torch-simple"], tracking_uri
    )
    eager_run, eager, _ = _profile(tmp_path, "eager", ["capture=none", "backend=torch-simple"], tracking_uri)

    assert list(graph["phases"]) == ["prefill", "decode_1", "decode_2", "decode"]
    assert graph["context"]["backend"] == "torch-simple" and graph["schema_version"] == 2
    for profile, real_modules in ((graph, graph_modules), (eager, eager_modules)):
        for phase in profile["phases"].values():
            _check_sums(phase["model_stats"])
            _check_sums(phase["summary_stats"])
            names = {n for n in _modules(phase["model_stats"]) if not n.startswith("demollm.")}
            assert names <= real_modules, names - real_modules
            assert {f"model.layers.{i}" for i in range(layers)} <= names
            summary_layers = [
                c for c in phase["summary_stats"]["children"] if c["kind"] == "module"
            ]  # the model's root, then its layers merged
            assert any(
                g["fqn"] == "model.layers.*" and g["invocations"] == layers
                for r in summary_layers
                for m in r["children"]
                for g in m["children"]
            )
    # The same decoder layers and, inside them, no module eager does not have.
    graph_layers = {n for n in _modules(graph["phases"]["prefill"]["model_stats"]) if ".layers." in n}
    eager_layers = {n for n in _modules(eager["phases"]["prefill"]["model_stats"]) if ".layers." in n}
    assert {f"model.layers.{i}.self_attn" for i in range(layers)} <= graph_layers <= eager_layers

    # The MLPs against their roof hold the weights Hugging Face's MLPs hold, whatever the transforms
    # fused, and fed the decode batch reach FLOP/s = 2 x weights x batch / their time.
    roofs = graph["roofline"]["roofs"]
    mlp_weights = [p for n, p in model.named_parameters() if ".mlp." in n]
    (mlp,) = [r for r in graph["roofline"]["phases"]["decode"] if r["part"] == "model.layers.*.mlp"]
    assert mlp["weight_mib"] == pytest.approx(sum(p.numel() * p.element_size() for p in mlp_weights) / 2**20)
    batch = roofs["steps"]["decode"]["tokens"]
    flops = 2 * sum(p.numel() for p in mlp_weights) * batch
    assert mlp["tflops"] == pytest.approx(flops / (mlp["device_ms"] * 1e-3) / 1e12)
    assert roofs["steps"]["prefill"]["tokens"] > batch >= 1
    # A roof is a bound: no part above it, each one measured at the part's own GEMM shapes
    assert roofs["gemm_tflops"] and all(
        r["pct_of_roof"] is None or r["pct_of_roof"] <= 100
        for rows in graph["roofline"]["phases"].values()
        for r in rows
    )

    _, runs = mlflow_runs(tracking_uri)
    metrics = next(r for r in runs if r.data.tags["capture"] == "partial").data.metrics
    assert metrics["profile/windows"] == 3 and metrics["profile/overhead_ratio"] > 0
    # Every module's calls split into busy time and gaps, on the run and on its eager reference,
    # and each part's gaps charted on both sides
    check_busy_gap_split(graph)
    for side in ("", "_eager"):
        assert (
            metrics[f"layers/decode{side}/attention_gap_ms"] > 0
            and f"profile/prefill{side}_gap_pct" in metrics
        )
    rows = {r["part"]: r for r in graph["comparison"]["decode"]}
    assert rows["total"]["eager_gap_ms"] > 0 and rows["total"]["captured_gap_ms"] > 0
    for name, phase in graph["phases"].items():
        stats = phase["model_stats"]
        assert attributed_kernel_pct(stats) > 98 and layer_kernel_pct(stats) > 85, name

    # The re-print tool prints what the stage printed.
    from pipeline.tools.print_table import main as print_table

    printed = (graph_run / "profile" / "tables.txt").read_text()
    cfg = compose_cfg()
    for phase, table in (("prefill", "summary"), ("decode", "model")):
        expected = tables.phase_table(
            ProfileResults.from_dict(graph).phases,
            phase,
            table,
            cfg.profile.table_depth,
            cfg.profile.table_top_k,
        )
        assert expected in printed
    # tables.txt has one writer, which holds the comparison with eager and the roofs too
    assert "decode: captured vs Hugging Face generate (eager)" in printed and "against its roof" in printed
    for written in ("tables.txt", "profile.json"):
        writers = [p.name for p in (REPO_ROOT / "pipeline").rglob("*.py") if _writes(p.read_text(), written)]
        assert writers == ["results.py"], (written, writers)
    # the saved profile loads back whole: reference, comparison and roofs included
    assert json.loads(ProfileResults.load(graph_run / "profile" / "profile.json").to_json()) == graph
    rows = list(csv.DictReader((graph_run / "profile" / "model_stats.csv").open()))
    by_id = {r["id"]: r for r in rows if r["phase"] == "decode_1"}
    assert all(
        int(by_id[r["parent_id"]]["depth"]) == int(r["depth"]) - 1 for r in by_id.values() if r["parent_id"]
    )
    trace = json.loads((graph_run / "traces" / "decode_1" / "rank0.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("ProfilerStep#") for n in names)
    assert "module::model.layers.0.self_attn|LlamaAttention" in names
    assert trace["distributedInfo"]["rank"] == 0
    # Eager modules are named too (hooks), in the eager run and around the graph
    eager_trace = json.loads((eager_run / "traces" / "decode_1" / "rank0.json").read_text())
    eager_names = {e.get("name", "") for e in eager_trace["traceEvents"]}
    assert {"module::lm_head|Linear", "module::model.embed_tokens|Embedding"} <= eager_names
    assert "module::model.layers.1.mlp|LlamaMLP" in eager_names
    assert {p.name for p in (graph_run / "traces").iterdir()} == {"prefill", "decode_1", "decode_2", "eager"}
    assert print_table(["--json-trace", str(graph_run / "profile" / "profile.json"), "--phase", "nope"]) == 2
    # The trace diff reads both saved profiles and lists every module slice of either (top 100).
    from pipeline.tools.compare import main as compare

    assert compare([str(eager_run), str(graph_run), "--top-k", "100"]) == 0
    diff = capsys.readouterr().out
    assert (
        "decode, by module (A = run, B = run)" in diff
        and "model.layers.*.mlp" in diff
        and "by category" in diff
    )
    assert compare([str(eager_run), str(graph_run), "--phase", "nope"]) == 2


@pytest.mark.slow
def test_holistic_trace_analysis_reads_a_runs_traces(tmp_path, tracking_uri):
    """HTA (the dev extra) loads each phase folder as one rank and finds the modules by name,
    eager ones included."""
    hta = pytest.importorskip("hta.trace_analysis")
    run, _, _ = _profile(tmp_path, "hta", ["capture=partial", "backend=torch-simple"], tracking_uri)
    for phase in ("prefill", "decode_1", "decode_2"):
        analysis = hta.TraceAnalysis(trace_dir=str(run / "traces" / phase))
        assert analysis.t.get_ranks() == [0]
        names = set(analysis.t.symbol_table.get_sym_table())
        assert len(analysis.t.get_trace(0)) > 100
        assert "module::lm_head|Linear" in names or "module::lm_head|OneDNNLinear" in names
        assert "module::model.layers.0.self_attn|LlamaAttention" in names


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch-cudagraph", "torch-opt"])
def test_cuda_graph_replays_land_in_their_modules(backend, tmp_path, tracking_uri):
    """A replay's kernels all sit at one cudaGraphLaunch: matched to the bucket's recorded kernel
    sequence, they land in the decoder layers under the runner (attribution cudagraph_sequence)."""
    run, profile, proc = _profile(tmp_path, backend, ["capture=partial", f"backend={backend}"], tracking_uri)
    assert "CUDAGraphRunner" in proc.stderr
    entry = profile["phases"]["decode_1"]
    decode = entry["model_stats"]

    def find(node):
        if node["cls"] == "CUDAGraphRunner":
            return node
        return next((f for c in node["children"] if (f := find(c))), None)

    runner = find(decode)
    assert runner is not None and runner["device_time_us"] > 0.5 * decode["device_time_us"]
    layers = [
        c for c in runner["children"] if c["kind"] == "module" and c["fqn"].rsplit(".", 1)[-1].isdigit()
    ]
    assert len(layers) == 2 and all(c["attribution"] == "cudagraph_sequence" for c in layers), runner[
        "children"
    ]
    assert all(c["device_time_us"] > 0 for c in layers)
    assert entry["attribution_pct"]["cudagraph_sequence"] > 50 and entry["layer_coverage_pct"] > 90


def _layer_gaps_us(phase: dict) -> float:
    """The decoder layers' gaps in a phase's model tree (us)."""
    return sum(n["gap_us"] for n in _nodes(phase["model_stats"]) if re.search(r"layers\.\d+$", n["fqn"]))


@pytest.mark.cuda
def test_cuda_graphs_remove_the_decode_steps_launch_gaps(tmp_path, tracking_uri):
    """On a GPU a gap is the device idle between kernels: the decode step replayed as one CUDA
    graph leaves its layers far less of it than launching kernel by kernel (torch-simple), and
    its comparison with eager counts the gaps removed."""
    _, simple, _ = _profile(tmp_path, "simple", ["capture=partial", "backend=torch-simple"], tracking_uri)
    _, graphs, _ = _profile(tmp_path, "graphs", ["capture=partial", "backend=torch-cudagraph"], tracking_uri)
    for name in ("decode_1", "decode_2"):
        replayed, launched = _layer_gaps_us(graphs["phases"][name]), _layer_gaps_us(simple["phases"][name])
        assert launched > 0 and replayed < 0.5 * launched, (name, replayed, launched)
    total = graphs["comparison"]["decode"][-1]
    assert total["eager_gap_ms"] > total["captured_gap_ms"]


# vLLM's entry classes (vllm/profiler/layerwise_profile.py), field for field: what its readers,
# tools/profiler/print_layerwise_table.py and visualize_layerwise_profile.py, build from each node
@dataclasses.dataclass
class SummaryStatsEntry:
    name: str
    cuda_time_us: float
    pct_cuda_time: float
    invocations: int


@dataclasses.dataclass
class ModelStatsEntry:
    name: str
    cpu_time_us: float
    cuda_time_us: float
    pct_cuda_time: float
    trace: str


def _flatten(entry_cls, roots: list) -> list:
    """print_layerwise_table.flatten_entries: every node's entry built as entry_cls(**entry)."""
    out = []

    def visit(node, depth):
        out.append((entry_cls(**node["entry"]), depth))
        for child in node["children"]:
            visit(child, depth + 1)

    for root in roots:
        visit(root, 0)
    return out


def test_the_profile_in_vllms_layout_loads_through_vllms_entries(tmp_path):
    overrides = [
        "model=tiny_llama3_1_8b",
        "backend=torch-simple",
        "prompt.output_len=3",
        "profile.decode_steps=2",
    ]
    with staged(overrides, "profile", tmp_path):
        pass
    ours = json.loads((tmp_path / "profile" / "profile.json").read_text())
    theirs = json.loads((tmp_path / "profile" / "vllm_profile.json").read_text())
    keys = list(theirs)
    assert keys[0] == "context" and keys[1:] == ["prefill", "decode_1", "decode_2"]  # the steps only
    context = theirs["context"]
    assert context["engine_args"] == {"model": "tiny_llama3_1_8b", "tensor_parallel_size": 1}
    assert {"batch_size", "prompt_len", "output_len"} <= set(context)  # the visualizer's title
    for phase in keys[1:]:
        summary = _flatten(SummaryStatsEntry, theirs[phase]["summary_stats"])
        model = _flatten(ModelStatsEntry, theirs[phase]["model_stats"])
        ours_total = ours["phases"][phase]["device_time_us"]
        assert sum(e.cuda_time_us for e, depth in model if depth == 0) == pytest.approx(ours_total, rel=0.01)
        assert any("self_attn" in e.name for e, _ in summary) and any(e.trace for e, _ in model)
        assert theirs[phase]["metadata"] == {"num_running_seqs": 1}
