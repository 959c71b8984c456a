"""Layerwise attribution through compiled and graph-captured code: Inductor's kernels mapped back to
the exported graph's modules (provenance), CUDA-graph replays matched to a recorded kernel sequence
(synthetic event trees here; the GPU run in tests/test_profiler.py), and the eager reference beside
the captured run."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import layer_kernel_pct, staged
from torch import fx

from pipeline.profiler import cudagraphs, provenance, tree
from pipeline.profiler.categories import Categorizer
from pipeline.profiler.events import DeviceEvent, ModuleSpan, OpEvent, Window
from pipeline.runner import advance

LAYER = (("m.layers.0", "Layer"),)
ATTN = (*LAYER, ("m.layers.0.attn", "Attention"))
MLP = (*LAYER, ("m.layers.0.mlp", "MLP"))


def test_replays_are_matched_by_position_and_name():
    recorded = [("gemm", ATTN), ("softmax", ATTN), ("gemm", MLP), ("act", MLP)]
    assert cudagraphs.align(["gemm", "softmax", "gemm", "act"], recorded) == [ATTN, ATTN, MLP, MLP]
    # a kernel the replay did not run is passed over; an extra one matches nothing
    assert cudagraphs.align(["gemm", "gemm", "act"], recorded) == [ATTN, MLP, MLP]
    assert cudagraphs.align(["gemm", "memset", "softmax", "gemm", "act"], recorded) == [
        ATTN,
        None,
        ATTN,
        MLP,
        MLP,
    ]


def _replay_window(names: list[str]) -> Window:
    runner = ModuleSpan("m.cuda_graph_runner", "CUDAGraphRunner", [], 0, 100)
    launch = OpEvent("cudaGraphLaunch", 10, 11, [])
    device = [DeviceEvent(n, 5_000, 10, None, start_ns=1000 + i, correlation=7, launch="cudaGraphLaunch")
              for i, n in enumerate(names)]  # fmt: skip
    return Window(modules=[runner], ops=[launch], device=device, on_device=True)


def test_a_replay_lands_under_its_modules_and_an_extra_kernel_stays_counted():
    window = _replay_window(["gemm", "softmax", "memset", "gemm", "act"])
    bucket_1 = [("gemm", ATTN), ("act", MLP)]
    bucket_4 = [("gemm", ATTN), ("softmax", ATTN), ("gemm", MLP), ("act", MLP)]
    assert cudagraphs.attribute(window, [bucket_1, bucket_4]) == (4, 1)  # bucket 4's sequence explains it
    root = tree.model_tree(window, "decode_1", Categorizer({}))
    runner = root.children[("module", "m.cuda_graph_runner")]
    layer = runner.children[("module", "m.layers.0")]
    assert layer.attribution == "cudagraph_sequence"
    assert layer.children[("module", "m.layers.0.attn")].device_time_us == 10.0  # gemm + softmax, 5 us each
    assert layer.children[("module", "m.layers.0.mlp")].device_time_us == 10.0
    assert runner.direct_us == 5.0  # the extra kernel: kept with the runner, not dropped
    shares = tree.attribution_pct(root)
    assert shares["cudagraph_sequence"] == pytest.approx(80.0) and shares["module_range"] == pytest.approx(
        20.0
    )


def _pre_grad_graph() -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    add = graph.call_function(torch.add, (x, x))
    add.name = "add"
    norm = graph.call_function(torch.relu, (add,))
    norm.name = "norm_default_1"  # Dynamo's rename: the exported line names the node
    norm.meta["stack_trace"] = (
        'File "<eval_with_key>.3", line 9, in forward\n    norm_default = torch.relu(add)'
    )
    mul = graph.call_function(torch.mul, (norm, x))
    mul.name = "mul"
    graph.output(mul)
    return fx.GraphModule({}, graph)


def test_a_kernel_fused_across_modules_goes_to_the_majority_then_to_its_last_node():
    stacks = {
        "add": LAYER,
        "norm_default": (("m.layers.1", "Layer"), ("m.layers.1.norm", "Norm")),
        "mul": MLP,
    }
    mappings = {
        "cppCodeToPost": {
            "cpp_fused_add_norm_0:1": ["add_1", "norm_1"],  # a tie: the norm, its last node
            "torch.ops.pipeline.rms_norm.default:2": ["norm_1"],
            "cpp_fused_mul_1:3": ["mul_1", "add_1", "mul_2"],  # two of three nodes in the MLP
            "extern_kernels.mm:4": ["orphan"],
        },
        "postToPre": {"add_1": ["add"], "norm_1": ["norm_default_1"], "mul_1": ["mul"], "mul_2": ["mul"]},
    }
    sites = provenance.sites_of(mappings, _pre_grad_graph(), stacks)
    assert [(s.event, s.stack, s.rule) for s in sites] == [
        ("cpp_fused_add_norm_0", stacks["norm_default"], "majority"),
        ("pipeline::rms_norm", stacks["norm_default"], "single"),
        ("cpp_fused_mul_1", MLP, "majority"),
        ("aten::mm", (), "none"),
    ]
    # What each fused kernel took from other modules: the layer's add into the norm's kernel, the
    # layer's add into the MLP's.
    assert [s.absorbed for s in sites] == [("m.layers.0",), (), ("m.layers.0",), ()]
    into = provenance.fused_modules({0: provenance.GraphSites(0, sites)})
    assert into == {"m.layers.0": {"m.layers.1.norm", "m.layers.0.mlp"}}


def test_compiled_calls_become_nested_module_spans():
    call = OpEvent("## Call CompiledFxGraph abc ##", 0, 100, [])
    ops = [call] + [
        OpEvent(name, start, start + 10, [], parent=call)
        for name, start in (("graph_3_cpp_fused_0", 0), ("pipeline::attention", 20), ("graph_3_cpp_fused_1", 40), ("aten::mm", 60))
    ]  # fmt: skip
    sites = [
        provenance.Site("cpp_fused_0", ATTN, "single"),
        provenance.Site("pipeline::attention", ATTN, "single"),
        provenance.Site("cpp_fused_1", MLP, "majority"),
        provenance.Site("aten::mm", (), "none"),
    ]
    found = provenance.attribute(Window(ops=ops), {3: provenance.GraphSites(3, sites)})
    assert (found.attributed, found.unattributed, found.majority) == (3, 1, 1)
    spans = {(s.fqn, s.start_ns, s.end_ns, s.attribution) for s in found.spans}
    assert spans == {
        ("m.layers.0", 0, 50, "inductor_provenance"),
        ("m.layers.0.attn", 0, 30, "inductor_provenance"),
        ("m.layers.0.mlp", 40, 50, "inductor_provenance"),
    }


def _profiled(name: str, backend: str, tmp_path, *extra: str) -> tuple[dict, str]:
    """(profile.json, the captured graph's path) of an in-process run of every stage up to profile."""
    # The default workload (a 128-token prompt): how much of a layer stack's time falls outside its
    # layers (the vision transformer's mask building) depends on the prompt beside the image.
    overrides = [
        f"model={name}",
        f"backend={backend}",
        "prompt.output_len=3",
        "profile.decode_steps=2",
        *extra,
    ]
    with staged(overrides, "profile", tmp_path) as state:
        path = state.captured[0].path
        return json.loads((tmp_path / "profile" / "profile.json").read_text()), (path + "." if path else "")


def _walk(node: dict):
    yield node
    for child in node["children"]:
        yield from _walk(child)


def _modules(node: dict, prefix: str = "") -> set[str]:
    """The modules with time, under prefix."""
    return {
        n["fqn"]
        for n in _walk(node)
        if n["kind"] == "module" and n["device_time_us"] > 0 and n["fqn"].startswith(prefix)
    }


def _parents_hold_their_children(node: dict) -> None:
    for parent in _walk(node):
        below = sum(c["device_time_us"] for c in parent["children"])
        rounding = 0.0005 * (len(parent["children"]) + 1)  # profile.json keeps 3 decimals of a microsecond
        assert parent["device_time_us"] >= below - rounding, (
            parent["fqn"] or parent["name"],
            parent["device_time_us"],
            below,
        )


# Work a family's text model does between its layers, which no layer holds: Qwen3-VL's DeepStack
# adds vision features to the hidden states after layer 0 in the stack's own loop (an index, a
# nonzero and an index_put, 5 % of the tiny prefill's kernels; run empty in decode)
BETWEEN_LAYERS_PCT = {"tiny_qwen3_vl": 10}


# One model per kind of decoder layer (suite budget): Mistral 3's dense layer (the text seeds' and
# LLaVA-like families'), Qwen2.5-VL's multimodal RoPE, Llama 4's MoE with chunked attention, Gemma 3's
# sliding and global layers with four norms and a bidirectional image span (Gemma 2's kind),
# Qwen3-VL's QK-norm and DeepStack (Qwen3's), GLM-4V's post-norms and interleaved RoPE
COMPILED_LAYERS = [
    "tiny_mistral3",
    "tiny_qwen2_5_vl",
    "tiny_llama4_scout",
    "tiny_gemma3",
    "tiny_qwen3_vl",
    "tiny_glm4v",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPILED_LAYERS)
def test_torch_compile_profiles_see_every_layer(name, tmp_path):
    """Under torch-compile every decoder layer shows with its attention and MLP, found through
    Inductor's provenance; at least 95 % of the layer stacks' kernels inside a layer; the eager
    reference beside it; parents hold their children in every phase."""
    profile, graph = _profiled(name, "torch-compile", tmp_path)
    for phase in ("prefill", "decode_1", "decode"):
        entry = profile["phases"][phase]
        assert layer_kernel_pct(entry["model_stats"]) >= 95 - BETWEEN_LAYERS_PCT.get(name, 0), phase
        inside = {f for f in _modules(entry["model_stats"], graph) if ".layers." in f and "vision" not in f}
        layers = sorted(f for f in inside if f.rsplit(".", 1)[-1].isdigit())
        assert len(layers) == 2, (phase, sorted(inside))
        for layer in layers:
            children = {
                f.removeprefix(layer + ".").split(".")[0] for f in inside if f.startswith(layer + ".")
            }
            assert {"self_attn", "feed_forward"} <= children or {"self_attn", "mlp"} <= children, (
                layer,
                children,
            )
        compiled = {
            n["fqn"] for n in _walk(entry["model_stats"]) if n.get("attribution") == "inductor_provenance"
        }
        assert inside <= compiled, (phase, sorted(inside - compiled))
        _parents_hold_their_children(entry["model_stats"])
        _parents_hold_their_children(entry["summary_stats"])
    assert profile["phases"]["decode"]["statistic"] == "mean of 2 windows"
    assert profile["comparison"]["decode"][-1]["part"] == "total"
    assert profile["reference"]["phases"]["decode"]["model_stats"]["device_time_us"] > 0


@pytest.mark.slow
def test_torch_compile_and_torch_simple_name_the_same_modules(tmp_path):
    compiled, graph = _profiled(
        "tiny_qwen2_5_vl", "torch-compile", tmp_path / "compiled", "profile.reference=none"
    )
    simple, _ = _profiled("tiny_qwen2_5_vl", "torch-simple", tmp_path / "simple", "profile.reference=none")
    for phase in ("prefill", "decode"):
        ours = _modules(compiled["phases"][phase]["summary_stats"], graph)
        theirs = _modules(simple["phases"][phase]["summary_stats"], graph)
        # the layers and their attention and MLP on both sides (a module whose kernels Inductor
        # fused into a neighbour's, a norm, may show on one side only)
        core = {f for f in theirs if f.endswith(("layers.*", "self_attn", "mlp"))}
        assert len(core) == 3 and core <= ours, (phase, sorted(core), sorted(ours))
        _parents_hold_their_children(simple["phases"][phase]["model_stats"])


def test_without_kernel_provenance_no_variant_is_compiled_and_the_graph_keeps_its_kernels(tmp_path):
    """profile.kernel_provenance=false: the profile compiles nothing (the timed variant runs in its
    windows), no module is attributed through provenance, and the note names the key."""
    from pipeline.backends.compile import compiled_frames

    overrides = ["model=tiny_llama3_1_8b", "backend=torch-compile", "prompt.output_len=3"]
    overrides += ["profile.decode_steps=2", "profile.reference=none", "profile.kernel_provenance=false"]
    with staged(overrides, "generate", tmp_path) as state:
        before = compiled_frames()
        profiled = advance(state, "profile")
        assert compiled_frames() == before
    profile = json.loads((tmp_path / "profile" / "profile.json").read_text())
    for phase in ("prefill", "decode_1"):
        stats = profile["phases"][phase]["model_stats"]
        assert not [n for n in _walk(stats) if n.get("attribution") == "inductor_provenance"], phase
        assert layer_kernel_pct(stats) == 0, phase
    note = next(n for n in profiled.stages[-1].notes if n.startswith("inside the graphs"))
    assert "profile.kernel_provenance=false" in note
