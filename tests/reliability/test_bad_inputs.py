"""Bad model inputs: each is a clear error; a mistake found before the model is built exits 2 with
one line, one found while running fails the run at its stage (exit 1, MLflow FAILED, files kept).
A CUDA out-of-memory during capture (injected) fails that job cleanly and the sweep's next job runs."""

from __future__ import annotations

import json

import pytest
from conftest import build_tiny, mlflow_runs, run_pipeline
from PIL import Image

pytestmark = pytest.mark.slow


def _one_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[-1]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["prompt.queries=[[]]"], "prompt.queries[0]"),
        (["prompt.prompt_len=5000"], "runtime.max_input_len"),
        (["prompt.output_len=0"], "prompt.output_len"),
        (["model.checkpoint=/nonexistent/folder"], "model.checkpoint"),
    ],
)
def test_input_mistakes_found_before_loading(overrides, message, tmp_path, tracking_uri):
    proc = run_pipeline(["model=tiny_llama3_1_8b", *overrides, f"tracking.uri={tracking_uri}"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in _one_line(proc)
    assert not mlflow_runs(tracking_uri)[1]


def _image(path, mode: str, size: tuple[int, int]):
    Image.new(mode, size, 128).save(path)
    return path


@pytest.mark.parametrize(
    ("mode", "size", "refused"),
    [
        ("L", (64, 64), None),  # grayscale: converted to RGB by the model's preprocessing
        ("RGBA", (3, 5), "smaller than one 14-pixel patch"),  # below one vision patch
        ("CMYK", (40, 40), None),  # a CMYK JPEG: converted to RGB
    ],
)
def test_odd_images_are_converted_or_refused_clearly(mode, size, refused, tmp_path, tracking_uri):
    image = _image(tmp_path / "odd.png" if mode != "CMYK" else tmp_path / "odd.jpg", mode, size)
    proc = run_pipeline(
        [
            "model=tiny_mistral3",
            f"prompt.images=[{image}]",
            "prompt.output_len=2",
            # what is under test ends at generate: no compile, no profile
            "backend=torch-simple",
            "profile.enabled=false",
            "report.enabled=false",
            f"tracking.uri={tracking_uri}",
        ],  # fmt: skip
        tmp_path,
    )
    if refused is None:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads((tmp_path / "run" / "generation" / "tokens.json").read_text())
    else:
        assert proc.returncode == 2, proc.stderr[-2000:]
        line = _one_line(proc)
        assert line.startswith("config error: prompt.images[0]=") and refused in line, line
        assert not mlflow_runs(tracking_uri)[1]


def _checkpoint(tmp_path):
    model, _, _ = build_tiny("tiny_llama3_1_8b")
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def test_a_corrupt_checkpoint_fails_the_load_stage(tmp_path, tracking_uri):
    folder = _checkpoint(tmp_path)
    weights = next(folder.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    proc = run_pipeline(
        ["model=tiny_llama3_1_8b", f"model.checkpoint={folder}", f"tracking.uri={tracking_uri}"], tmp_path
    )
    assert proc.returncode == 1
    assert "stage 'load' failed" in _one_line(proc)
    _, runs = mlflow_runs(tracking_uri)
    assert runs[0].info.status == "FAILED" and runs[0].data.tags["failed_stage"] == "load"


def test_a_checkpoint_that_disagrees_with_model_kwargs_is_refused(tmp_path, tracking_uri):
    folder = _checkpoint(tmp_path)
    proc = run_pipeline(
        [
            "model=tiny_llama3_1_8b",
            f"model.checkpoint={folder}",
            "+model.model_kwargs.num_hidden_layers=3",
            f"tracking.uri={tracking_uri}",
        ],  # fmt: skip
        tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = _one_line(proc)
    assert "num_hidden_layers" in line and "checkpoint" in line, line


def test_out_of_memory_in_capture_fails_the_job_and_the_sweep_goes_on(tmp_path, tracking_uri):
    proc = run_pipeline(
        [
            "-m",
            "model=tiny_llama3_1_8b",
            "backend=torch-compile",
            "seed=0,1",
            "prompt.output_len=2",
            "profile.decode_steps=1",
            f"tracking.uri={tracking_uri}",
        ],  # fmt: skip
        tmp_path,
        env={"PIPELINE_INJECT_FAULT": "capture_oom"},
    )
    assert proc.returncode == 1
    jobs = sorted((tmp_path / "multirun").glob("*/summary.json"))
    summaries = [json.loads(p.read_text()) for p in jobs]
    assert len(summaries) == 2
    assert all(s["failed_stage"] == "capture" and "OutOfMemoryError" in s["error"] for s in summaries)
