"""The bench code runs on tiny configurations and writes well-formed results: rounds, per-round
ratios with their spread, noisy flags (no timing asserted)."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import psutil
import pytest
import torch
from conftest import REPO_ROOT

import pipeline.bench.__main__ as bench
import pipeline.bench.load as bench_load
from pipeline.bench import compare, decode, engine_work, pipeline_run, tensor_parallel
from pipeline.kernels import cpu_gemv


@pytest.mark.slow
@pytest.mark.timeout(600)  # its runs take 80-100 s on 2 cores
def test_bench_cli_runs_a_part_on_a_tiny_model(tmp_path):
    """`python -m pipeline.bench` as a user runs it, on a part of its blocks (the others run in
    process below, each a test of its own: one run of every block passed 300 s under CI's load)."""
    output = tmp_path / "BENCH.md"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.bench",
            "--rows",
            "load,export,decode,prefill",
            "--model",
            "tiny_mistral3",
            "--repeats",
            "2",
            "--decode-batches",
            "1,2",
            "--decode-steps",
            "2",
            # one round in each of two fresh processes, pooled
            "--decode-processes",
            "2",
            # one dtype: a second doubles the fresh processes (bfloat16's rows: the MoE test below)
            "--decode-dtypes",
            "float32",
            "--decode-prompt-len",
            "16",
            "--prefill-tokens",
            "16,32",
            "--load-rounds",
            "2",
            "--output",
            str(output),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(output.with_suffix(".json").read_text())
    assert results["model"] == "tiny_mistral3"
    assert results["rows"] == ["load", "export", "decode", "prefill"]
    assert not {"backends", "engine_work", "run"} & set(results)
    load = results["load"]
    assert load["params"] > 0 and all(
        is_spread(load[k], 2)
        for k in (
            "ours_s",
            "hf_init_s",
            "speedup",
            "ours_touched_s",
            "hf_init_touched_s",
            "touch_gbs",
        )
    )
    # a round where a touched load spilled off its block has no ratio (test_bench_rounds covers the rule)
    spilled = load["touched_rounds_spilled"]
    # every load faults in some pages; a round spilled exactly when a load faulted past its allowance
    faults = load["touched_load_faults_max"]
    assert isinstance(faults, int) and faults > 0 and 0 <= spilled <= 2
    assert (spilled > 0) == bench_load.spilled(faults, 4 * load["params"])  # float32 bytes
    if spilled < 2:
        assert is_spread(load["speedup_touched"], 2 - spilled)
    else:
        assert "speedup_touched" not in load
    assert 0 <= results["machine_load"]["other_cores"] <= psutil.cpu_count()
    assert "loadavg_1m" in results["machine_load"]["start"]
    assert results["export"]["submodule"] == "model.language_model"
    text = output.read_text()
    assert "A part of the bench: `--rows load,export,decode,prefill`" in text
    assert "| load, random init" in text and "| export of `model.language_model`" in text
    for left_out in ("## Decode per backend", "## Host work per decode step", "## Whole run", "# On a GPU"):
        assert left_out not in text, left_out
    assert [(d["model"], d["dtype"]) for d in results["decode"]] == [("tiny_mistral3", "float32")]
    for result in results["decode"]:
        assert (result["rounds"], result["processes"]) == (2, 2)
        block = "\n".join(decode.markdown(result))
        assert block in text and "2 rounds, 1 in each of 2 fresh processes" in block
        check_decode(result, block, moe=False)
    assert [r["tokens"] for r in results["prefill"]["rows"]] == [16, 32]
    assert all(
        is_spread(r[key], 2)
        for r in results["prefill"]["rows"]
        for key in ("tflops", "gemm_tflops", "pct_of_gemm", "pass_ms", "pct_of_pass")
    )
    assert "## Prefill" in text and "| % of pass |" in text
    assert "| load on memory touched first (the touch: " in text
    # a part's figure lies beside its markdown, not over the README's
    assert results["plot"] == "BENCH.png" and (tmp_path / "BENCH.png").stat().st_size > 10_000


@pytest.mark.slow
def test_whole_run_rows():
    run = pipeline_run.bench_pipeline_run(["model=tiny_mistral3", "capture=partial"], 2)
    assert "error" not in run and is_spread(run["wall_s"], 2)
    assert all(is_spread(run["metrics"][k], 2) for k in ("stage/load_s", "profile/overhead_ratio"))
    assert "## Whole run" in "\n".join(pipeline_run.markdown(run))


@pytest.mark.slow
def test_moe_decode_rows_route_fewer_bytes_than_all_experts():
    result = decode.bench_decode("tiny_llama4_scout", [1, 2], 8, 2, 2, torch.bfloat16)
    assert (result["model"], result["dtype"]) == ("tiny_llama4_scout", "bfloat16")
    text = "\n".join(decode.markdown(result))
    check_decode(result, text, moe=True)
    assert "routed: " in text


@pytest.mark.slow
def test_moe_rows_left_out_where_hugging_faces_experts_cannot_run(monkeypatch, tmp_path):
    """Where Hugging Face's all-experts form cannot run in time (bfloat16 without oneDNN's bf16
    matmul), `--rows moe` measures nothing and the table says why."""
    assert decode.moe_rows_unaffordable(torch.float32) == ""
    assert bool(decode.moe_rows_unaffordable(torch.bfloat16)) == (not cpu_gemv.onednn_bf16())
    monkeypatch.setattr(decode, "moe_rows_unaffordable", lambda dtype: "not measured: a test")
    output = tmp_path / "MOE.md"
    monkeypatch.setattr(sys, "argv", ["bench", "--rows", "moe", "--output", str(output)])
    bench.main()
    results = json.loads(output.with_suffix(".json").read_text())
    assert "decode" not in results and results["moe_left_out"]["reason"] == "not measured: a test"
    assert "## Decode, `model=llama4_scout` (bfloat16, CPU)\n\nnot measured: a test." in output.read_text()


def check_decode(result: dict, text: str, moe: bool) -> None:
    """A decode block of two batches and two rounds: every runner's figures well-formed."""
    assert [r["batch"] for r in result["rows"]] == [1, 2] and is_spread(result["read_limit_gbs"], 2)
    # demollm again with F.linear in place of the linear kernels (onednn_linear in float32,
    # bf16_gemv in bfloat16), the MoE model with Hugging Face's all-experts form in place of the
    # routed experts
    kernel = result["dtype"] == "float32" or not cpu_gemv.unsupported()
    runners = ["HF eager", "demollm"] + (["demollm F.linear"] if kernel else [])
    runners += ["demollm all experts"] if moe else []
    # Well-formed numbers only: a tiny model's step-time differences can be noise of either sign.
    for row in result["rows"]:
        assert is_spread(row["gemv_pass_gbs"], 2)
        # routed experts only: fewer bytes than every expert (4 experts, top 1, batch <= 2)
        assert (0 < row["routed_bytes"] < result["weight_bytes"]) if moe else "routed_bytes" not in row
        assert [r["runner"] for r in row["runners"]] == runners
        for runner in row["runners"]:
            for key in ("decode_ms", "pct_of_read", "pct_of_gemv", "gbs"):
                assert is_spread(runner[key], 2), (runner["runner"], key)
            assert isinstance(runner["noisy"], bool)
        hf, *ours = row["runners"]
        assert all(is_spread(r["vs_reference"], 2) for r in ours) and "vs_reference" not in hf
        assert set(hf["noisy_figures"]) <= {"pct_of_read", "pct_of_gemv"}
    assert f"## Decode, `model={result['model']}` ({result['dtype']}, CPU" in text
    # every runner's line: median (p10-p90) cells for the step time, the ratio and the percents
    lines = [line for line in text.splitlines() if any(f"| {r} |" in line for r in runners)]
    assert len(lines) == 2 * len(runners) and all(line.count("(") >= 3 for line in lines)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny_llama3_1_8b", "tiny_qwen3_moe"])
def test_backend_rows(name):
    result = decode.bench_backends(
        name, 1, 16, 2, 2, torch.device("cpu"), torch.float32, bench.CPU_BACKENDS, f_linear=["torch-simple"]
    )
    assert result["model"] == name
    assert [r["runner"] for r in result["rows"]] == [
        "HF eager generate",
        "HF static cache + torch.compile",
        "demollm torch-simple",
        "demollm torch-compile",
        "demollm torch-simple, F.linear",
    ]
    assert all(is_spread(r["decode_ms"], 2) and is_spread(r["prefill_ms"], 2) for r in result["rows"])
    assert all(is_spread(r["vs_reference"], 2) for r in result["rows"][1:])
    assert all(isinstance(r["noisy"], bool) for r in result["rows"])
    assert f"## Decode per backend, `model={name}`" in "\n".join(
        decode.backends_markdown(result, bench.CPU_TARGET)
    )


@pytest.mark.slow
def test_engine_work_rows():
    result = engine_work.bench_engine_work("tiny_mistral3", [1, 2], bench.ENGINE_WORK_BACKENDS)
    assert [(r["backend"], r["batch"]) for r in result["rows"]] == [
        ("torch-simple", 1), ("torch-simple", 2), ("torch-cudagraph", 1), ("torch-cudagraph", 2)
    ]  # fmt: skip
    assert all(is_spread(r["host_ms"], 5) for r in result["rows"])
    assert "## Host work per decode step" in "\n".join(engine_work.markdown(result))


def test_render_of_the_recorded_full_run_shows_every_block(tmp_path):
    """BENCHMARKS.json, a full run: every block's section, one line naming the machine, tables and
    the figure only (no prose beyond each table's method), and the page within 200 lines."""
    results = json.loads((REPO_ROOT / "BENCHMARKS.json").read_text())
    gpu = json.loads(bench.GPU_RESULTS.read_text())
    text = bench.markdown(results["model"], results, gpu)
    for section in ("## Pipeline overhead", "## Decode, ", "## Decode per backend", "## Host work per decode step",
                    "## Prefill", "## Whole run", "# On a GPU"):  # fmt: skip
        assert section in text, section
    machine = [line for line in text.splitlines() if line.startswith("Machine: ")]
    assert machine and results["machine"]["cpu"] in machine[0] and results["machine"]["torch"] in machine[0]
    assert "A part of the bench" not in text and "notes.md" not in text
    assert len(text.splitlines()) <= 200
    assert text == (REPO_ROOT / "BENCHMARKS.md").read_text(), (
        "BENCHMARKS.md is not rendered from BENCHMARKS.json"
    )
    assert bench.plot(results, tmp_path / "full.png") and (tmp_path / "full.png").stat().st_size > 10_000


def test_compare_flags_a_moved_ratio_and_not_a_noisy_one():
    """Two runs of BENCHMARKS.json: the same run holds; one unflagged ratio moved 20 % is MOVED, and
    the same move in a ratio a run marked NOISY is not."""
    results = json.loads((REPO_ROOT / "BENCHMARKS.json").read_text())
    lines, moved = compare.compare(results, results, 10.0)
    assert moved == [] and len(lines) > 20
    # float32 batch 1 demollm, its ratio to HF eager taken as quiet in the first run (the committed
    # run may have marked it NOISY: that is the case below)
    figures = results["decode"][0]["rows"][0]["runners"][1]["noisy_figures"]
    figures[:] = [f for f in figures if f != "vs_reference"]
    later = copy.deepcopy(results)
    runner = later["decode"][0]["rows"][0]["runners"][1]
    runner["vs_reference"]["median"] *= 1.2
    name = f"{decode.label(later, later['decode'][0])} b1 {runner['runner']} / HF eager"
    lines, moved = compare.compare(results, later, 10.0)
    assert moved == [name] and any(name in line and "MOVED" in line for line in lines)
    runner["noisy_figures"] = [*runner["noisy_figures"], "vs_reference"]
    lines, moved = compare.compare(results, later, 10.0)
    assert moved == [] and any(name in line and "NOISY in a run" in line for line in lines)


def test_a_part_of_the_bench_is_checked_before_it_runs(tmp_path):
    with pytest.raises(SystemExit, match="unknown block.*'decod'.*choose from load,export"):
        bench.parse_rows("decod,prefill", tmp_path / "x.md")
    with pytest.raises(SystemExit, match="pass --output FILE.md"):
        bench.parse_rows("prefill", REPO_ROOT / "BENCHMARKS.md")
    assert bench.parse_rows("prefill,decode", tmp_path / "x.md") == ["decode", "prefill"]
    assert bench.parse_rows(",".join(bench.ROWS), REPO_ROOT / "BENCHMARKS.md") == list(bench.ROWS)


def test_only_benchmarks_md_draws_the_readme_figure(tmp_path):
    # A full run written elsewhere for comparison must leave BENCHMARKS.md's figure alone.
    assert bench.plot_path(None, REPO_ROOT / "BENCHMARKS.md") == bench.DEFAULT_PLOT
    assert bench.plot_path(None, tmp_path / "full.md") == tmp_path / "full.png"
    assert bench.plot_path(tmp_path / "given.png", REPO_ROOT / "BENCHMARKS.md") == tmp_path / "given.png"


def is_spread(value: dict, rounds: int) -> bool:
    """A figure as the bench reports it: median with p10 and p90 over `rounds` rounds."""
    return (
        value["n"] == rounds
        and all(math.isfinite(value[k]) for k in ("median", "p10", "p90"))
        and value["p10"] <= value["median"] <= value["p90"]
    )


@pytest.mark.slow
def test_tensor_parallel_blocks_on_a_tiny_model():
    """`make bench-tp`'s blocks on two gloo ranks of a tiny model: every block runs, a world-2 rank
    reads half the sharded weights of one process (the replicated lm_head more), each block has its
    read limit, and the table shows every block."""
    args = {
        "model": "tiny_mistral3", "dtype": "float32", "device": "cpu", "worlds": [1, 2], "batch": 1,
        "prompt_len": 16, "steps": 2, "repeats": 2, "threads": 2,
    }  # fmt: skip
    result = tensor_parallel.bench(args)
    blocks = {b["label"]: b for b in result["blocks"]}
    assert [b.get("error") for b in blocks.values()] == [None] * 5, blocks
    one = blocks["world 1"]["ranks"][0]["weight_bytes"]
    vocab_parallel = blocks["world 2, lm_head vocab-parallel"]["ranks"]
    replicated = blocks["world 2, lm_head replicated"]["ranks"]
    slices = blocks["world 2, only its slices allocated"]["ranks"]
    assert all(r["weight_bytes"] < one for r in vocab_parallel + slices), blocks
    assert all(r["weight_bytes"] > v["weight_bytes"] for r, v in zip(replicated, vocab_parallel, strict=True))
    assert [r["weight_bytes"] for r in slices] == [r["weight_bytes"] for r in vocab_parallel]
    assert all(r["regions"] > 0 and r["collective_pct"] > 0 for r in vocab_parallel + replicated + slices)
    assert all(b["read_gbs"] > 0 and b["read_pct"] > 0 for b in blocks.values())
    assert all(r["peak_rss_bytes"] > 0 for b in blocks.values() for r in b["ranks"])
    table = tensor_parallel.markdown(result)
    assert all(f"| {label} |" in table for label in blocks) and "failed" not in table


def test_the_setup_block_shows_each_torch_choice():
    """BENCHMARKS.setup.json's rows as BENCHMARKS.md shows them: one per torch choice, seconds and GB."""
    from pipeline.bench import setup

    result = {
        "date": "2026-01-01",
        "commit": "abc1234",
        "machine": {"cpu": "a CPU", "cores": "2"},
        "rows": [
            {"torch": setup.CHOICES[0], "seconds": 130.04, "venv_gb": 7.21},
            {"torch": setup.CHOICES[1], "seconds": 99.6, "venv_gb": 3.69},
        ],
    }
    text = setup.markdown(result)
    assert f"| `{setup.CHOICES[0]}` | 130 s | 7.2 GB |" in text
    assert f"| `{setup.CHOICES[1]}` | 100 s | 3.7 GB |" in text
    assert "fresh clone of abc1234" in text
