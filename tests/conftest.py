"""Shared helpers: Hydra compose API, tiny models, subprocess runs against a temporary MLflow store."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

# Each test process's torch (a worker's, and every run and rank it starts: they inherit the
# variable) takes its share of the cores: two workers with the machine's threads each oversubscribe
# them, and OpenMP's spinning waits made tests/test_runtime.py take half as long again on 2 cores.
# Set in each worker (never in xdist's controller, whose environment the workers inherit) before
# torch is imported, which reads it then.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault(
        "OMP_NUM_THREADS",
        str(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))),
    )
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; it is chosen when a
# kernel is defined, so before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from pipeline import REPO_ROOT
from pipeline.config import PipelineConfig, register_schemas, typed
from pipeline.devices import dtype_name
from pipeline.export import graph_capture
from pipeline.graphs import find_language_models
from pipeline.jobs import checked_job
from pipeline.models import build, meta, probe, zoo
from pipeline.models.inputs import make_example_inputs
from pipeline.parallel import free_port
from pipeline.runner import advance, new_state
from pipeline.state import Job
from pipeline.transforms.registry import TransformContext

# The kernel choices tests time (kernels/linear_choice.py) go to a file of the suite's own, never
# the user's ~/.cache/pipeline; subprocesses inherit it.
os.environ["PIPELINE_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="pipeline-test-kernels-")
atexit.register(shutil.rmtree, os.environ["PIPELINE_KERNEL_CACHE"], ignore_errors=True)

# The imports' objects (they live as long as the worker) left out of the collector's full passes
gc.freeze()

# Inductor compiles in its own process (and the runs this suite starts in theirs): with the workers
# on every core already, a pool of compile workers per process adds its start-up and no throughput.
os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
torch._inductor.config.compile_threads = 1

CONF_DIR = str(REPO_ROOT / "conf")
TINY_MODELS = ["tiny_mistral3", "tiny_magistral", "tiny_llama3_1_8b", "tiny_qwen2_5_vl", "tiny_llama4_scout"]
TINY_VLMS = ["tiny_mistral3", "tiny_qwen2_5_vl", "tiny_llama4_scout"]
TINY_TEXT = ["tiny_magistral", "tiny_llama3_1_8b"]
# The seeds the compile, shard and piecewise matrices run (suite budget): tiny_magistral's language
# model is tiny_llama3_1_8b's layer for layer (dense, grouped KV heads, the same decoder layer), so
# those matrices take the other four; every family test and the every-stage matrix keep all five.
COMPILED_SEEDS = [m for m in TINY_MODELS if m != "tiny_magistral"]
# Families the project was not written for (issues 20 and 53): a YAML each, nothing else per
# family. These VLMs and two text families run in every family test, the every-stage matrix included.
MATRIX_VLMS = [
    "tiny_llava",
    "tiny_gemma3",
    "tiny_paligemma",
    "tiny_qwen2_vl",
    "tiny_llava_next",
    "tiny_idefics3",
    "tiny_internvl",
    "tiny_aya_vision",
    "tiny_smolvlm",
    "tiny_llava_onevision",
    "tiny_glm4v",
    "tiny_qwen3_vl",
]
TINY_FAMILIES = [*MATRIX_VLMS, "tiny_gemma2", "tiny_qwen3"]
# VLM families tried by a YAML of their published config alone, after the image path became
# generic (no line of the pipeline names them): in the parity, export, image and checkpoint tests,
# not in the every-stage matrix
YAML_ONLY_VLMS = ["tiny_vipllava", "tiny_deepseek_vl", "tiny_paddleocr_vl", "tiny_got_ocr2"]
FAMILY_VLMS = [*MATRIX_VLMS, *YAML_ONLY_VLMS]
# Mixture-of-experts text models beside Llama-4 (issue 23): their experts in transformers' grouped form
TINY_MOE = ["tiny_mixtral", "tiny_qwen3_moe"]
SEED_MODELS = ["mistral3", "magistral", "llama3_1_8b", "qwen2_5_vl", "llama4_scout"]

register_schemas()


def compose_dict(overrides: list[str] | None = None) -> DictConfig:
    """The config as Hydra composes it (what `python -m pipeline` receives)."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=overrides or [])


def compose_cfg(overrides: list[str] | None = None) -> PipelineConfig:
    """The typed config the packages receive."""
    return typed(compose_dict(overrides))


def transform_context(
    device: str = "cpu", attention: str = "torch", page_size: int = 64, hf_config=None
) -> TransformContext:
    return TransformContext(attention, page_size, torch.device(device), hf_config)


def build_tiny(
    name: str, seed: int = 0, device: str = "cpu", attn_implementation: str | None = None, overrides=()
):
    """(model, hf_config, example inputs) for a tiny model, float32 (on CPU unless told);
    overrides: more Hydra overrides of its config."""
    cfg = compose_cfg([f"model={name}", f"seed={seed}", *overrides])
    hf_config = zoo.build_hf_config(cfg.model)
    model_cls = zoo.resolve_model_class(cfg.model, hf_config)
    model, _ = build.build_random(
        model_cls, hf_config, torch.float32, torch.device(device), seed, attn_implementation
    )
    skeleton = meta.meta_model(model_cls, hf_config)  # counts a fixed-size family's image tokens
    examples = make_example_inputs(hf_config, 2, None, torch.float32, torch.device(device), seed, skeleton)
    return model, hf_config, examples


def capture_tiny(model, hf_config, examples, paths: list[str] | None = None):
    """The load and export stages' capture: the language model of a VLM (the whole model of a text
    model), from the image call where there is one, positions counted as the model counts them."""
    lm_paths = find_language_models(model, zoo.text_config_of(hf_config))
    if paths is None:
        paths = lm_paths if zoo.is_vlm(hf_config) else [""]
    offset = probe.first_position(
        model, lm_paths[0] if len(lm_paths) == 1 else "", examples.text["input_ids"][:1, :2]
    )
    return graph_capture.capture(model, paths, examples.image or examples.text, offset, examples.text)


def job_of(overrides: list[str], run_dir: Path, dtype=torch.float32, device: str = "cpu") -> Job:
    """The job `python -m pipeline OVERRIDES dtype=.. device=..` would run, in run_dir, checked as
    the CLI checks it (a ConfigError where the CLI would stop)."""
    chosen = [*overrides, f"dtype={dtype_name(dtype)}", f"device={device}"]
    return checked_job(compose_dict(chosen), run_dir, torch.cuda.is_available(), overrides=tuple(overrides))


@contextlib.contextmanager
def staged(
    overrides: list[str], until: str, run_dir: Path | None = None, dtype=torch.float32, device: str = "cpu"
):
    """The runner's state for OVERRIDES advanced through stage `until`, its files in run_dir (a
    temporary folder, removed afterwards, where none is given); released afterwards."""
    with contextlib.ExitStack() as stack:
        folder = run_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        state = new_state(job_of(overrides, folder, dtype, device))
        try:
            yield advance(state, until)
        finally:
            state.release()


def pytest_collection_modifyitems(items):
    """The longest tests first (those given more than the default time limit, the longest limit
    first), so that two workers finish together rather than one waiting out a long test picked
    last; `cuda` tests need a GPU, and are skipped without one."""
    items.sort(key=lambda item: -max((m.args[0] for m in item.iter_markers("timeout")), default=0))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# Orphans of a test's subprocesses (the ranks or workers of a job whose launcher was killed) are
# re-parented to this process rather than to init, so the test's teardown still finds them.
PR_SET_CHILD_SUBREAPER = 36
if sys.platform == "linux":
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

# Helpers a library keeps for the whole process, started by whichever test first needs them.
PROCESS_WIDE_HELPERS = ("multiprocessing.resource_tracker", "torch._inductor.compile_worker")


def _descendants() -> dict[int, psutil.Process]:
    return {p.pid: p for p in psutil.Process().children(recursive=True)}


@pytest.fixture(autouse=True)
def no_process_outlives_its_test():
    """Every process a test started, and every process those started, ends with the test: one that
    timed out (pytest-timeout) or failed leaves no job, rank or worker behind to load the suite."""
    before = set(_descendants())
    yield
    left = []
    for pid, proc in _descendants().items():
        with contextlib.suppress(psutil.Error):
            if pid in before or any(h in " ".join(proc.cmdline()) for h in PROCESS_WIDE_HELPERS):
                continue
            proc.kill()
            left.append(proc)
    psutil.wait_procs(left, timeout=30)


@pytest.fixture(scope="session")
def empty_store(tmp_path_factory) -> Path:
    """An MLflow SQLite store with its tables made (once a worker: making them takes a run 1-2 s)."""
    import mlflow

    path = tmp_path_factory.mktemp("empty_store") / "mlflow.db"
    mlflow.MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def tracking_uri(tmp_path: Path, empty_store: Path) -> str:
    """A store of the test's own, as a run that found it already made would."""
    shutil.copyfile(empty_store, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def run_pipeline(
    args: list[str], tmp_path: Path, timeout: int = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python -m pipeline ARGS` with its Hydra folders under tmp_path."""
    multirun = "-m" in args
    folder = (
        ["hydra.sweep.dir=" + str(tmp_path / "multirun")]
        if multirun
        else ["hydra.run.dir=" + str(tmp_path / "run")]
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args, *folder],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
        env=env,
    )


def signals_as_in_a_terminal() -> None:
    """A subprocess's preexec_fn: SIGINT and SIGTERM at their defaults. A shell running a background
    job (`make test &`) starts it with SIGINT ignored, children inherit that, and Python then never
    installs its Ctrl-C handler: the interrupt a test sends would be dropped."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def start_paused(stage: str, args: list[str], run_dir: Path) -> subprocess.Popen:
    """`python -m pipeline ARGS` held at the start of `stage` (PIPELINE_PAUSE_AT), its signals as
    in a terminal, so a test can interrupt or kill it there."""
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline", *args, f"hydra.run.dir={run_dir}"],
        cwd=REPO_ROOT,
        env={**os.environ, "PIPELINE_PAUSE_AT": stage, "PYTHONUNBUFFERED": "1"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=signals_as_in_a_terminal,
    )


def generated_tokens(run_dir: Path) -> dict[int, list[int]]:
    """seq_id -> the tokens a run generated (tokens.json without its timings)."""
    import json

    return {
        e["seq_id"]: e["tokens"] for e in json.loads((run_dir / "generation" / "tokens.json").read_text())
    }


def _tree_nodes(node: dict):
    yield node
    for child in node["children"]:
        yield from _tree_nodes(child)


def _kernels(node: dict) -> int:
    """Kernel invocations under a profile tree node, less torch.compile's runtime leaves (guards,
    wrappers: no module's work)."""
    from pipeline.profiler.tree import RUNTIME

    return sum(
        n["invocations"] for n in _tree_nodes(node) if n["kind"] == "kernel" and n["category"] != RUNTIME
    )


# Shares of kernel invocations, not of time: counted, they do not move with the machine's load as
# the profile's time shares (coverage_pct, layer_coverage_pct) do on a busy 2-core machine.
def attributed_kernel_pct(model_stats: dict) -> float:
    """Percent of a profile tree's kernel invocations inside some module."""
    outside = sum(_kernels(n) for n in model_stats["children"] if n["kind"] == "unattributed")
    total = _kernels(model_stats)
    return 100 * (total - outside) / total if total else 0.0


def layer_kernel_pct(model_stats: dict) -> float:
    """Percent of the kernel invocations in a profile tree's layer stacks (the modules holding
    `layers.N`) that lie inside a layer."""
    from pipeline.profiler.tree import LAYER

    nodes = list(_tree_nodes(model_stats))
    layers = [n for n in nodes if n["kind"] == "module" and LAYER.search(n["fqn"])]
    stack_names = {LAYER.sub("", n["fqn"]) for n in layers}
    in_stacks = sum(_kernels(n) for n in nodes if n["kind"] == "module" and n["fqn"] in stack_names)
    return 100 * sum(_kernels(n) for n in layers) / in_stacks if in_stacks else 0.0


def check_busy_gap_split(profile: dict) -> None:
    """Every module with device time, in every phase of a saved profile.json and of its eager
    reference, has its calls' span split into busy time and gaps (within 1 %) and counts launches."""
    sides = [profile["phases"]] + ([profile["reference"]["phases"]] if "reference" in profile else [])
    for phases in sides:
        for name, phase in phases.items():
            for node in _tree_nodes(phase["summary_stats"]):
                if node["kind"] == "module" and node["device_time_us"] > 0:
                    assert node["launches"] >= 1 and node["span_us"] >= node["busy_us"] > 0, (
                        name,
                        node["fqn"],
                    )
                    assert node["busy_us"] + node["gap_us"] == pytest.approx(
                        node["span_us"], rel=0.01, abs=2e-3
                    )


def mlflow_runs(uri: str, experiment: str = "pipeline"):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return client, ([] if exp is None else client.search_runs([exp.experiment_id]))


def sweep_parent(runs):
    """The parent run a sweep made (tagged `sweep=parent`)."""
    return next(r for r in runs if r.data.tags.get("sweep") == "parent")


def child_runs(runs, parent) -> list:
    """The runs of a sweep whose MLflow parent is `parent`."""
    return [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]


@contextlib.contextmanager
def mlflow_server(store_uri: str, *extra: str):
    """`mlflow server` on a free 127.0.0.1 port for the duration; yields its URL once /health answers.
    One worker process (MLflow starts four by default, each importing MLflow again): a test's
    requests are few, and the others' start-up was CPU the other test worker waited for."""
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            store_uri,
            *extra,
            "--workers",
            "1",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],  # fmt: skip
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    pytest.fail("the MLflow server did not come up")
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)
