"""profile.waterfall=true: each step from Hugging Face eager to the captured model, measured on the
one model as the stages advance it, with the step at which a layer first leaves eager."""

from __future__ import annotations

import json
import operator

import pytest
import torch
from conftest import compose_cfg, job_of, staged

from pipeline import waterfall
from pipeline.config import validate
from pipeline.errors import ConfigError, StageFailure
from pipeline.profiler import stepwise
from pipeline.profiler.ranges import node_stack
from pipeline.runner import new_state, run_stage
from pipeline.transforms import registry
from pipeline.transforms.match_rope import MatchRope

QUIET = ["profile.decode_steps=2", "report.enabled=false", "tracking.enabled=false"]
# The rounds' times and shares, not where each compiled kernel sits: no profiled variant per visit
MODEL = [
    "model=tiny_llama3_1_8b",
    "backend=torch-compile",
    "profile.waterfall=true",
    "profile.kernel_provenance=false",
]


@pytest.mark.slow
def test_each_step_is_measured_in_rounds_and_the_shares_add_up():
    with staged([*MODEL, *QUIET], "profile") as state:
        fall = state.waterfall
        steps = fall.steps
        names = [s.name for s in steps]
        assert names[:2] == ["eager", "graph_and_cache"] and names[-1] == "torch-compile"
        applied = {r.transform for r in state.transform_history.records if r.matches}
        assert set(names[2:-1]) == {n for n in applied if not registry.TRANSFORMS[n].decoding}
        assert fall.rounds == 3
        for phase in stepwise.PHASES:
            assert all(len(s.phase_ms[phase]) == 3 and min(s.phase_ms[phase]) > 0 for s in steps)
            # Signed shares: +1 for a gain, -1 for a loss, never the sign of the whole on each step
            whole = fall.whole(phase)
            assert sum(fall.shares(phase)[1:]) == pytest.approx(1.0 if whole > 0 else -1.0)
        capture = next(r for r in state.stages if r.name == "capture")
        assert steps[-1].cost_s == capture.metrics["capture/compile_s"]
        assert not fall.first_drift()
        profile = next(r for r in state.stages if r.name == "profile")
        # The profile's captured-vs-eager line is the waterfall's first round of its ends
        comparison = json.loads((state.run_dir / "profile" / "profile.json").read_text())["comparison"]
        for phase in stepwise.PHASES:
            assert comparison[phase][-1]["eager_ms"] == steps[0].phase_ms[phase][0]
            assert comparison[phase][-1]["captured_ms"] == steps[-1].phase_ms[phase][0]
        assert profile.metrics["waterfall/decode/00_eager_ms"] == steps[0].time("decode").median
        # one chart section per phase, the steps in order, each one's saving and share
        last = f"waterfall/decode/{len(steps) - 1:02d}_{steps[-1].name}"
        assert profile.metrics[f"{last}_saved_ms"] == fall.changes("decode")[-1].median
        assert profile.metrics[f"{last}_share"] == fall.shares("decode")[-1]
        assert "waterfall/decode/00_eager_saved_ms" not in profile.metrics
        assert (state.run_dir / "waterfall" / "waterfall.png").stat().st_size > 0
        text = (state.run_dir / "waterfall" / "waterfall.txt").read_text()
        assert "eager -> torch-compile" in text and "3 interleaved rounds" in text
        # Each step's graph as code, headed by its node count: fuse_gemms's has the fused weights.
        fused = names.index("fuse_gemms")
        assert steps[fused].nodes != steps[fused - 1].nodes
        code = (state.run_dir / "waterfall" / "graphs" / "fuse_gemms" / "root.py").read_text()
        assert code.startswith(f"# {steps[fused].nodes} nodes") and "fused_q_proj_k_proj_v_proj" in code
        # The model as it ends runs what the capture stage compiled: no step's graph left in place
        assert "fused_q_proj_k_proj_v_proj" in state.model.code


def test_a_broken_transform_is_named_with_the_layer_it_broke(tmp_path, monkeypatch):
    """match_rope made to rotate layer 1's queries and keys the wrong way: the waterfall names
    layer 1 (and what follows it) as first drifting at match_rope, layer 0 never, against Hugging
    Face's own outputs; the transforms stage then fails its logits check."""
    rewrite = MatchRope.apply_graph

    def broken(self, gm, ctx):
        matches = rewrite(self, gm, ctx)
        for node in list(gm.graph.nodes):
            stack = node_stack(node) or []
            if node.target is torch.ops.pipeline.rope.default and any(
                p.startswith("model.layers.1.") for _, p, _ in stack
            ):
                with gm.graph.inserting_before(node):
                    negated = gm.graph.call_function(operator.neg, (node.args[2],))
                node.args = (*node.args[:2], negated)
        return matches

    monkeypatch.setattr(MatchRope, "apply_graph", broken)
    state = new_state(
        job_of(["model=tiny_llama3_1_8b", "backend=torch-simple", "profile.waterfall=true", *QUIET], tmp_path)
    )
    try:
        for stage in ("load", "export"):
            run_stage(state, stage)
        with pytest.raises(StageFailure, match="max_abs_err"):
            run_stage(state, "transforms")
        first = state.waterfall.first_drift()
        assert first["model.layers.1"] == "match_rope" and "model.layers.0" not in first
        assert [s.name for s in state.waterfall.steps][:3] == ["eager", "graph_and_cache", "match_rope"]
    finally:
        state.release()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["capture=none"], "use capture=partial or capture=full"),
        (["profile.enabled=false"], "set profile.enabled=true too"),
    ],
)
def test_a_waterfall_that_cannot_run_is_refused_up_front(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_cfg(["profile.waterfall=true", *overrides]), cuda_available=False)


def test_a_waterfall_needs_a_graph_that_decodes():
    transforms = registry.parse(compose_cfg(["transforms.insert_cached_attention.enabled=false"]).transforms)
    with pytest.raises(ConfigError, match="enable transforms.insert_cached_attention"):
        waterfall.check(transforms)
    waterfall.check(registry.parse(compose_cfg().transforms))  # the default order holds


def test_the_transforms_a_graph_decodes_with_are_the_first_step_by_their_own_mark(monkeypatch):
    """The first step is every enabled transform marked `decoding`, whatever its name; each other
    one is a step of its own, in order."""
    transforms = registry.parse(compose_cfg().transforms)
    steps = waterfall.order(transforms)
    assert [t.name for t in steps[0]] == [t.name for t in transforms if t.config.enabled and t.decoding]
    assert "insert_cached_attention" in [t.name for t in steps[0]] and all(len(s) == 1 for s in steps[1:])
    monkeypatch.setattr(registry.TRANSFORMS["match_rope"], "decoding", True)
    assert "match_rope" in [t.name for t in waterfall.order(transforms)[0]]


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch-cudagraph", "torch-opt"])
def test_the_waterfall_of_a_gpu_backend(backend):
    """On a GPU the last step is the CUDA-graph backend: its decode replays are profiled and
    attributed as the profile stage's are, and nothing drifts in bfloat16."""
    overrides = ["model=tiny_llama3_1_8b", f"backend={backend}", "profile.waterfall=true", *QUIET]
    with staged(overrides, "profile", dtype=torch.bfloat16, device="cuda") as state:
        steps = state.waterfall.steps
        assert [s.name for s in steps][:2] == ["eager", "graph_and_cache"] and steps[-1].name == backend
        for phase in stepwise.PHASES:
            assert sum(state.waterfall.shares(phase)[1:]) == pytest.approx(1.0)
        assert not state.waterfall.first_drift()


def _fall(prefill_rounds: list[list[float]], vision: list[list[float]] | None = None) -> stepwise.Waterfall:
    """A waterfall of steps whose prefill (and decode) ms per round are given; vision: the vision
    tower's ms per step and round."""
    fall = stepwise.Waterfall(untouched=["vision_tower"] if vision else [])
    for i, rounds in enumerate(prefill_rounds):
        step = stepwise.Step(f"step{i}", 0.0, 0.0)
        for r, ms in enumerate(rounds):
            parts = {"vision_tower": vision[i][r]} if vision else {}
            step.add_round({"prefill": ms, "decode": ms}, {"prefill": parts, "decode": parts})
        fall.steps.append(step)
    return fall


def test_a_step_that_costs_time_has_a_negative_share_whatever_the_whole():
    gain = _fall([[10, 10, 10], [6, 6, 6], [7, 7, 7], [4, 4, 4]])  # -4, +1, -3: a gain of 6
    assert gain.shares("prefill")[1:] == pytest.approx([4 / 6, -1 / 6, 3 / 6])
    assert sum(gain.shares("prefill")[1:]) == pytest.approx(1.0)
    loss = _fall([[10, 10, 10], [6, 6, 6], [17, 17, 17]])  # a gain of 4, then a cost of 11: a loss of 7
    assert loss.shares("prefill")[1:] == pytest.approx([4 / 7, -11 / 7])
    assert sum(loss.shares("prefill")[1:]) == pytest.approx(-1.0)
    assert "-157%" in stepwise.table(loss) and "prefill 0.59x within a round" in stepwise.table(loss)


def test_a_change_inside_the_rounds_spread_is_noisy():
    # step1's change within the rounds: +1, -1, +2 (holds 0); step2's: 5, 4, 6
    fall = _fall([[10, 12, 11], [9, 13, 9], [4, 9, 3]])
    assert fall.noisy("prefill") == [False, True, False]
    assert "NOISY" in stepwise.table(fall).splitlines()[4]  # step1's row


def test_an_untouched_part_that_moves_says_the_host_was_noisy():
    steady = _fall([[10, 10, 10], [5, 5, 5]], vision=[[2.0, 2.1, 2.0], [2.0, 2.05, 2.1]])
    assert not steady.warnings()
    moved = _fall([[10, 10, 10], [5, 5, 5]], vision=[[2.0, 2.1, 2.0], [4.0, 4.1, 4.2]])
    assert any("vision_tower, which no step touches" in w for w in moved.warnings())
    assert "!!! prefill: vision_tower" in stepwise.table(moved)


def test_a_profile_line_outside_the_rounds_is_said():
    fall = _fall([[10, 11, 12], [5, 5, 5]])  # eager / last: 2.0, 2.2, 2.4
    fall.profile_speedup = {"prefill": 2.2}
    assert not fall.warnings()
    fall.profile_speedup = {"prefill": 3.5}
    assert any("outside the waterfall's eager -> step1" in w for w in fall.warnings())


def test_a_saved_waterfall_loads_back_with_the_same_answers(tmp_path):
    """waterfall.json round-trips through stepwise.load: the steps' rounds, the untouched parts and
    the profile's ratio, so the table and warnings a sweep's parent reads are the run's own."""
    fall = _fall([[10, 10, 10], [5, 5, 5]], vision=[[2.0, 2.1, 2.0], [4.0, 4.1, 4.2]])
    fall.steps[1].drifted, fall.profile_speedup = ["mlp"], {"prefill": 3.5}
    (tmp_path / "waterfall.json").write_text(json.dumps(fall.as_dict()))
    loaded = stepwise.load(tmp_path / "waterfall.json")
    assert loaded.as_dict() == fall.as_dict() and stepwise.table(loaded) == stepwise.table(fall)
    assert len(loaded.warnings()) == 3  # two untouched-part moves, one profile ratio outside
