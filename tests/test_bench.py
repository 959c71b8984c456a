"""The bench code runs on a tiny configuration and writes well-formed results: rounds, per-round
ratios with their spread, noisy flags (no timing asserted)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

from pipeline.bench import compare
from pipeline.kernels import cpu_gemv

pytestmark = pytest.mark.slow


def test_bench_runs_on_a_tiny_model(tmp_path):
    output = tmp_path / "BENCH.md"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.bench",
            "--model",
            "tiny_mistral3",
            "--repeats",
            "2",
            "--decode-batches",
            "1,2",
            "--decode-steps",
            "2",
            "--backend-steps",
            "2",
            "--backend-repeats",
            "2",
            "--prompt-len",
            "16",
            "--small-model",
            "tiny_llama3_1_8b",
            "--small-moe-model",
            "tiny_qwen3_moe",
            "--moe-model",
            "tiny_llama4_scout",
            "--moe-prompt-len",
            "8",
            "--moe-batches",
            "1,2",
            "--prefill-tokens",
            "16,32",
            "--run-repeats",
            "2",
            "--load-rounds",
            "2",
            "--output",
            str(output),
            "--plot",
            str(tmp_path / "bench.png"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(output.with_suffix(".json").read_text())
    assert results["model"] == "tiny_mistral3"
    load = results["load"]
    assert load["params"] > 0 and all(is_spread(load[k], 2) for k in ("ours_s", "hf_init_s", "speedup"))
    assert results["machine_load"]["other_cores"] >= 0 and "loadavg_1m" in results["machine_load"]["start"]
    assert results["export"]["submodule"] == "model.language_model"
    text = output.read_text()
    assert "| load, random init" in text and "| export of `model.language_model`" in text
    assert [(d["model"], d["dtype"]) for d in results["decode"]] == [
        ("tiny_mistral3", "float32"), ("tiny_mistral3", "bfloat16"), ("tiny_llama4_scout", "bfloat16")
    ]  # fmt: skip
    for decode in results["decode"]:
        assert [r["batch"] for r in decode["rows"]] == [1, 2] and is_spread(decode["read_limit_gbs"], 2)
        # demollm again with F.linear in place of the linear kernels (onednn_linear in float32,
        # bf16_gemv in bfloat16), the MoE model with Hugging Face's all-experts form in place of the
        # routed experts
        kernel = decode["dtype"] == "float32" or not cpu_gemv.unsupported()
        runners = ["HF eager", "demollm"] + (["demollm F.linear"] if kernel else [])
        moe = decode["model"] == "tiny_llama4_scout"
        runners += ["demollm all experts"] if moe else []
        # Well-formed numbers only: a tiny model's step-time differences can be noise of either sign.
        for row in decode["rows"]:
            assert is_spread(row["gemv_pass_gbs"], 2)
            # routed experts only: fewer bytes than every expert (4 experts, top 1, batch <= 2)
            assert (0 < row["routed_bytes"] < decode["weight_bytes"]) if moe else "routed_bytes" not in row
            assert [r["runner"] for r in row["runners"]] == runners
            hf, *ours = row["runners"]
            for runner in row["runners"]:
                for key in ("decode_ms", "pct_of_read", "pct_of_gemv", "gbs"):
                    assert is_spread(runner[key], 2), (runner["runner"], key)
                assert isinstance(runner["noisy"], bool)
            assert all(is_spread(r["vs_reference"], 2) for r in ours) and "vs_reference" not in hf
            assert set(hf["noisy_figures"]) <= {"pct_of_read", "pct_of_gemv"}
        assert f"## Decode, `model={decode['model']}` ({decode['dtype']}, CPU" in text
    # every decode runner's line: median (p10-p90) cells for the step time, the ratio and the percents
    decode_lines = [
        line
        for line in text.splitlines()
        if any(f"| {r} |" in line for r in ("HF eager", "demollm", "demollm F.linear", "demollm all experts"))
    ]
    assert len(decode_lines) == (20 if not cpu_gemv.unsupported() else 14) and all(
        line.count("(") >= 3 for line in decode_lines
    )
    assert "routed: " in text
    assert [b["model"] for b in results["backends"]] == ["tiny_llama3_1_8b", "tiny_qwen3_moe"]
    for backends in results["backends"]:
        assert [r["runner"] for r in backends["rows"]] == [
            "HF eager generate",
            "HF static cache + torch.compile",
            "demollm torch-simple",
            "demollm torch-compile",
            "demollm torch-simple, F.linear",
        ]
        assert all(is_spread(r["decode_ms"], 2) and is_spread(r["prefill_ms"], 2) for r in backends["rows"])
        assert all(is_spread(r["vs_reference"], 2) for r in backends["rows"][1:])
        assert all(isinstance(r["noisy"], bool) for r in backends["rows"])
        assert f"## Decode per backend, `model={backends['model']}`" in text
    assert [(r["backend"], r["batch"]) for r in results["engine_work"]["rows"]] == [
        ("torch-simple", 1), ("torch-simple", 2), ("torch-cudagraph", 1), ("torch-cudagraph", 2)
    ]  # fmt: skip
    assert all(is_spread(r["host_ms"], 5) for r in results["engine_work"]["rows"])
    assert "## Host work per decode step" in text
    assert [r["tokens"] for r in results["prefill"]["rows"]] == [16, 32]
    assert all(
        is_spread(r[key], 2)
        for r in results["prefill"]["rows"]
        for key in ("tflops", "gemm_tflops", "pct_of_gemm")
    )
    run = results["run"]
    assert "error" not in run and is_spread(run["wall_s"], 2)
    assert all(is_spread(run["metrics"][k], 2) for k in ("stage/load_s", "profile/overhead_ratio"))
    assert "## Whole run" in text and "## Prefill" in text
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    # the run-to-run comparison reads the results: against itself every ratio holds
    lines, moved = compare.compare(results, results, 10.0)
    assert moved == [] and sum("| holds |" in line or "NOISY in a run" in line for line in lines) > 10


def is_spread(value: dict, rounds: int) -> bool:
    """A figure as the bench reports it: median with p10 and p90 over `rounds` rounds."""
    return (
        value["n"] == rounds
        and all(math.isfinite(value[k]) for k in ("median", "p10", "p90"))
        and value["p10"] <= value["median"] <= value["p90"]
    )
