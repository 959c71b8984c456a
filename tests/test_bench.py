"""The bench code runs on a tiny configuration and writes well-formed results: rounds, per-round
ratios with their spread, noisy flags (no timing asserted)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

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
            "--prompt-len",
            "16",
            "--small-model",
            "tiny_llama3_1_8b",
            "--prefill-tokens",
            "16,32",
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
    assert load["params"] > 0 and is_spread(load["ours_s"], 2) and "hf_init_s" in load
    assert results["machine_load"]["other_cores"] >= 0 and "loadavg_1m" in results["machine_load"]["start"]
    assert results["export"]["submodule"] == "model.language_model"
    text = output.read_text()
    assert "| load, random init" in text and "| export of `model.language_model`" in text
    assert [d["dtype"] for d in results["decode"]] == ["float32", "bfloat16"]
    assert all(d["gemv_read_gbs"] > 0 for d in results["decode"])
    for decode in results["decode"]:
        assert [r["batch"] for r in decode["rows"]] == [1, 2] and is_spread(decode["read_limit_gbs"], 2)
        # Well-formed numbers only: a tiny model's step-time differences can be noise of either sign.
        for row in decode["rows"]:
            for key in ("decode_ms", "pct_of_limit", "gbs"):
                assert is_spread(row["demollm"][key], 2) and is_spread(row["hf_eager"][key], 2), key
            assert is_spread(row["demollm"]["vs_reference"], 2) and "vs_reference" not in row["hf_eager"]
            assert isinstance(row["demollm"]["noisy"], bool)
            assert set(row["hf_eager"]["noisy_figures"]) <= {"pct_of_limit"}
        assert f"## Decode, `model=tiny_mistral3` ({decode['dtype']}, CPU" in text
    # every decode row: median (p10-p90) cells for the step times, the ratio and the percents
    decode_rows = [line for line in text.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert len(decode_rows) == 4 and all(line.count("(") >= 5 for line in decode_rows)
    assert [b["model"] for b in results["backends"]] == ["tiny_llama3_1_8b"]
    for backends in results["backends"]:
        assert [r["runner"] for r in backends["rows"]] == [
            "HF eager generate",
            "HF static cache + torch.compile",
            "demollm torch-simple",
            "demollm torch-compile",
        ]
        assert all(is_spread(r["decode_ms"], 2) and is_spread(r["prefill_ms"], 2) for r in backends["rows"])
        assert all(is_spread(r["vs_reference"], 2) for r in backends["rows"][1:])
        assert all(isinstance(r["noisy"], bool) for r in backends["rows"])
        assert f"## Decode per backend, `model={backends['model']}`" in text
    assert [(r["backend"], r["batch"]) for r in results["engine_work"]["rows"]] == [
        ("torch-simple", 1), ("torch-simple", 2), ("torch-cudagraph", 1), ("torch-cudagraph", 2)
    ]  # fmt: skip
    assert all(math.isfinite(r["host_ms"]) for r in results["engine_work"]["rows"])
    assert "## Host work per decode step" in text
    assert [r["tokens"] for r in results["prefill"]["rows"]] == [16, 32]
    assert all(
        is_spread(r[key], 2)
        for r in results["prefill"]["rows"]
        for key in ("tflops", "gemm_tflops", "pct_of_gemm")
    )
    run = results["run"]
    assert run["status"] == "FINISHED" and run["stages"]["stage/load_s"] > 0
    assert run["profile"]["profile/overhead_ratio"] > 0
    assert "## Whole run" in text and "## Prefill" in text
    assert (tmp_path / "bench.png").stat().st_size > 10_000


def is_spread(value: dict, rounds: int) -> bool:
    """A figure as the bench reports it: median with p10 and p90 over `rounds` rounds."""
    return (
        value["n"] == rounds
        and all(math.isfinite(value[k]) for k in ("median", "p10", "p90"))
        and value["p10"] <= value["median"] <= value["p90"]
    )
