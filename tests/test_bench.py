"""The bench code runs on a tiny configuration and writes well-formed results (no timing asserted)."""

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
            "1",
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
    assert results["load"]["params"] > 0 and results["load"]["ours_s"] > 0 and "hf_init_s" in results["load"]
    assert results["export"]["submodule"] == "model.language_model"
    text = output.read_text()
    assert "| load, random init" in text and "| export of `model.language_model`" in text
    assert [d["dtype"] for d in results["decode"]] == ["float32", "bfloat16"]
    assert all(d["gemv_read_gbs"] > 0 for d in results["decode"])
    for decode in results["decode"]:
        assert [r["batch"] for r in decode["rows"]] == [1, 2] and decode["read_bandwidth_gbs"] > 0
        # Well-formed numbers only: a tiny model's step-time differences can be noise of either sign.
        assert all(math.isfinite(r["demollm_ms"]) and math.isfinite(r["hf_eager_ms"]) for r in decode["rows"])
        assert f"## Decode, `model=tiny_mistral3` ({decode['dtype']}, CPU" in text
    assert [b["model"] for b in results["backends"]] == ["tiny_llama3_1_8b"]
    for backends in results["backends"]:
        assert [r["runner"] for r in backends["rows"]] == [
            "HF eager generate",
            "HF static cache + torch.compile",
            "demollm torch-simple",
            "demollm torch-compile",
        ]
        assert all(math.isfinite(r["decode_ms"]) and math.isfinite(r["prefill_ms"]) for r in backends["rows"])
        assert f"## Decode per backend, `model={backends['model']}`" in text
    assert [(r["backend"], r["batch"]) for r in results["engine_work"]["rows"]] == [
        ("torch-simple", 1), ("torch-simple", 2), ("torch-cudagraph", 1), ("torch-cudagraph", 2)
    ]  # fmt: skip
    assert all(math.isfinite(r["host_ms"]) for r in results["engine_work"]["rows"])
    assert "## Host work per decode step" in text
    assert [r["tokens"] for r in results["prefill"]["rows"]] == [16, 32]
    assert all(
        math.isfinite(r["tflops"]) and math.isfinite(r["gemm_tflops"]) for r in results["prefill"]["rows"]
    )
    run = results["run"]
    assert run["status"] == "FINISHED" and run["stages"]["stage/load_s"] > 0
    assert run["profile"]["profile/overhead_ratio"] > 0
    assert "## Whole run" in text and "## Prefill" in text
    assert (tmp_path / "bench.png").stat().st_size > 10_000
