"""Rounds and the run-to-run comparison on made-up samples: a machine whose speed drifts by 2x
between rounds leaves a per-round ratio exact, a runner disturbed in one round is flagged NOISY, and
the comparison of two bench results names the ratio that moved (no timing measured)."""

from __future__ import annotations

import copy
import resource

import pytest

from pipeline.bench import compare, load, rounds


def drifting_machine(slowdowns: list[float], disturbed: dict[int, float] | None = None):
    """Runners and a limit on a machine `slowdowns[i]` times slower in round i (round 0 warms up);
    `disturbed[i]` slows only demollm's sample in round i."""
    state = {"round": -1, "limit_calls": 0}
    disturbed = disturbed or {}

    def limit():  # before and after each round's samples, from round 1 on (round 0 warms up)
        state["limit_calls"] += 1
        return 100.0 / slowdowns[1 + (state["limit_calls"] - 1) // 2]

    def hf():
        state["round"] += 1
        return 0.2 * slowdowns[state["round"]], 1.0

    def demollm():
        i = state["round"]
        return 0.1 * slowdowns[i] * disturbed.get(i, 1.0), 1.0

    return {"HF": hf, "demollm": demollm}, {"read": limit}


def test_a_drifting_machine_leaves_per_round_ratios_exact():
    runners, limits = drifting_machine([1.0, 1.0, 2.0, 1.5, 1.0])
    taken, errors = rounds.take_turns(runners, repeats=4, limits=limits)
    assert not errors and len(taken) == 4  # the warm-up round is dropped
    ours = rounds.row(taken, "demollm", "HF", read_bytes=10 * 10**9, limits={"read": "read"})
    # the step time spreads 2x, the ratio to HF and the percent of the limit do not
    assert ours["decode_ms"]["p90"] / ours["decode_ms"]["p10"] > 1.5
    assert ours["vs_reference"]["median"] == pytest.approx(0.5) and ours["vs_reference"][
        "p90"
    ] == pytest.approx(0.5)
    assert ours["pct_of_read"]["median"] == pytest.approx(100.0)
    assert ours["noisy_figures"] == [] and not ours["noisy"]


def test_a_runner_disturbed_in_some_rounds_is_noisy():
    runners, limits = drifting_machine([1.0] * 6, disturbed={2: 1.8, 3: 1.8})
    taken, _ = rounds.take_turns(runners, repeats=5, limits=limits)
    ours = rounds.row(taken, "demollm", "HF", read_bytes=10 * 10**9, limits={"read": "read"})
    assert ours["noisy"] and set(ours["noisy_figures"]) == {"vs_reference", "pct_of_read"}


def test_a_failing_runner_is_reported_not_fatal():
    runners, limits = drifting_machine([1.0] * 3)
    runners["broken"] = lambda: 1 / 0
    taken, errors = rounds.take_turns(runners, repeats=2, limits=limits)
    assert "division by zero" in errors["broken"] and all("demollm" in r.samples for r in taken)


def test_without_a_warm_up_the_first_sample_is_kept():
    """Samples that are each a fresh process's first (the load row) have nothing to warm up."""
    samples = iter([3.0, 1.0, 2.0])
    taken, _ = rounds.take_turns(
        {"ours": lambda: (next(samples), 0.0)}, repeats=3, limits={"read": lambda: 50.0}, warm_up=False
    )
    assert [r.samples["ours"][0] for r in taken] == [3.0, 1.0, 2.0]
    assert all(r.limits == {"read": 50.0} for r in taken)


def bench_result(ratio: float, pct: float, step_ms: float, noisy: bool = False) -> dict:
    spread = lambda v: {"median": v, "p10": v, "p90": v, "n": 5}  # noqa: E731
    runner = {
        "runner": "demollm",
        "vs_reference": spread(ratio),
        "pct_of_read": spread(pct),
        "pct_of_gemv": spread(pct),
        "decode_ms": spread(step_ms),
        "noisy_figures": ["vs_reference"] if noisy else [],
    }
    return {
        "date": "2026-12-01",
        "model": "mistral3",
        "machine_load": {"other_cores": 0.0},
        "decode": [{"model": "mistral3", "dtype": "float32", "rows": [{"batch": 1, "runners": [runner]}]}],
        "backends": [],
        "prefill": {"rows": []},
    }


def test_a_round_whose_touched_load_spilled_off_its_block_has_no_touched_ratio():
    """HF init / ours on touched memory is taken only in rounds where neither load faulted in more
    than its allowance (SPILL_FRACTION of the model's bytes beside SPILL_ALLOWANCE_BYTES): a load
    whose parameters landed off the touched block timed part of a touch."""
    model_bytes = 11_600_000_000
    pages = (load.SPILL_FRACTION * model_bytes + load.SPILL_ALLOWANCE_BYTES) / resource.getpagesize()
    clean, spilled = 400, int(pages) + 1  # a clean mistral3 load faulted 400 pages; a spill 1.04 M
    taken = [
        rounds.Round(samples={load.OURS_TOUCHED: (ours, 0.0), load.HF_INIT_TOUCHED: (hf, 0.0)})
        for ours, hf in [(5.0, 20.0), (30.0, 21.0), (5.5, 22.0), (5.2, 20.8)]
    ]
    faults = [
        {load.OURS_TOUCHED: clean, load.HF_INIT_TOUCHED: clean},
        {load.OURS_TOUCHED: spilled, load.HF_INIT_TOUCHED: clean},
        {load.OURS_TOUCHED: clean, load.HF_INIT_TOUCHED: clean},
        {load.OURS_TOUCHED: clean, load.HF_INIT_TOUCHED: spilled},
    ]
    assert not load.spilled(int(pages), model_bytes) and load.spilled(spilled, model_bytes)
    row = load.touched_speedup(taken, faults, model_bytes)
    assert row["touched_rounds_spilled"] == 2
    ratio = row["speedup_touched"]  # 20 / 5 and 22 / 5.5
    assert ratio["n"] == 2 and ratio["median"] == pytest.approx(4.0)
    assert "speedup_touched" not in load.touched_speedup(taken[1:2], faults[1:2], model_bytes)


def test_compare_names_the_ratio_that_moved_not_the_time():
    earlier = bench_result(0.67, 80.0, 190.0)
    later = copy.deepcopy(earlier)
    later["decode"][0]["rows"][0]["runners"][0]["decode_ms"]["median"] = 270.0  # the machine slowed
    lines, moved = compare.compare(earlier, later, 10.0)
    assert moved == [] and any("ms/step" in line and "+42.1 %" in line for line in lines)
    later = bench_result(0.80, 80.0, 190.0)
    _, moved = compare.compare(earlier, later, 10.0)
    assert moved == ["decode float32 b1 demollm / HF eager"]
    _, moved = compare.compare(earlier, bench_result(0.80, 80.0, 190.0, noisy=True), 10.0)
    assert moved == []  # a figure a run marked NOISY was never a result


def test_compare_says_when_the_runs_ran_on_different_hosts():
    earlier, later = bench_result(0.67, 80.0, 190.0), bench_result(0.67, 80.0, 190.0)
    earlier["machine"] = {"isa": "avx2 avx512f avx512_bf16 onednn_bf16=yes"}
    later["machine"] = {"isa": "avx2 onednn_bf16=no"}
    lines, moved = compare.compare(earlier, later, 10.0)
    assert moved == [] and any(line.startswith("DIFFERENT HOSTS") for line in lines)
    later["machine"] = dict(earlier["machine"])
    assert not any("DIFFERENT HOSTS" in line for line in compare.compare(earlier, later, 10.0)[0])


def test_rounds_of_several_processes_are_pooled_ratios_still_per_round():
    """Two processes whose machines ran at different speeds: the pooled row holds every round, and
    each ratio is still taken within its own round (so both processes' ratios are exact)."""
    from pipeline.bench import decode

    measured = []
    for speed in (1.0, 1.4):
        slowdowns = [speed] * 6  # two limits: four limit calls a round
        runners, limits = drifting_machine(slowdowns)
        taken, _ = rounds.take_turns(
            {"HF eager b1": runners["HF"], "demollm b1": runners["demollm"]},
            repeats=2,
            limits={"read": limits["read"], "gemv b1": limits["read"]},
        )
        measured.append(decode.DecodeRounds(10 * 10**9, {}, ["HF eager b1", "demollm b1"], taken))
    result = decode.summarize("made_up", [1], 8, 4, decode.torch.float32, measured)
    assert (result["rounds"], result["processes"]) == (4, 2)
    hf, ours = result["rows"][0]["runners"]
    assert ours["vs_reference"]["median"] == pytest.approx(0.5) and ours["vs_reference"]["n"] == 4
    assert ours["pct_of_read"]["p10"] == pytest.approx(ours["pct_of_read"]["p90"])
    assert ours["decode_ms"]["p90"] == pytest.approx(140.0) and ours["decode_ms"]["p10"] == pytest.approx(
        100.0
    )
    assert ours["process_ms"] == [pytest.approx(100.0), pytest.approx(140.0)]
    text = "\n".join(decode.markdown(result))
    assert "4 rounds, 2 in each of 2 fresh processes" in text and "batch 1 demollm 100 / 140" in text
    measured[1].weight_bytes += 1
    with pytest.raises(RuntimeError, match="different bytes"):
        decode.summarize("made_up", [1], 8, 4, decode.torch.float32, measured)


def test_benchmarks_md_links_the_figure_beside_it():
    """`--render` links the figure from where the markdown lies, whichever run's .json it renders."""
    import re

    from conftest import REPO_ROOT

    links = re.findall(r"!\[benchmarks\]\(([^)]+)\)", (REPO_ROOT / "BENCHMARKS.md").read_text())
    assert links and all((REPO_ROOT / link).is_file() for link in links), links
