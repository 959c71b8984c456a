"""runtime.world_size=2 as a user runs it: `python -m pipeline runtime.world_size=2` spawns two gloo
ranks on this CPU. One MLflow run per job holds every rank's folder; both ranks generate the tokens
of one process; the all-reduces sit in the layers' profile and Holistic Trace Analysis reads the
traces as two ranks; a world size that does not divide the model is a config error (its exit 2: test_config.py);
a rank killed mid-run fails the job naming it, and an interrupt ends both ranks KILLED."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import (
    REPO_ROOT,
    child_runs,
    compose_dict,
    generated_tokens,
    mlflow_runs,
    run_pipeline,
    start_paused,
    sweep_parent,
)

from pipeline.errors import ConfigError
from pipeline.jobs import check_config
from pipeline.parallel import free_port

ARGS = [
    "model=tiny_llama3_1_8b",
    "capture=partial",
    "backend=torch-simple",
    "prompt.output_len=4",
    "profile.decode_steps=2",
]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["runtime.world_size=3"], "runtime.world_size=3 does not divide the model's num_attention_heads=4"),
        (["runtime.world_size=4"], "runtime.world_size=4 does not divide the model's num_key_value_heads=2"),
        (["runtime.world_size=2", "capture=none"], "capture=none exports none; use capture=partial"),
        (["runtime.world_size=2", "transforms.shard.enabled=false"], "transforms.shard is off"),
        (["runtime.world_size=-1"], "runtime.world_size=-1: use 0 (one process) or N > 1"),
        (["runtime.world_size=2", "runtime.collective_timeout_s=0"], "runtime.collective_timeout_s"),
        (["runtime.tp_weights=half"], "runtime.tp_weights=half"),
        (["runtime.tp_weights=shard"], "runtime.world_size=0 is one process"),
        (["runtime.world_size=2", "runtime.tp_weights=shard"], "set profile.reference=none"),
        (
            [
                "runtime.world_size=2",
                "runtime.tp_weights=shard",
                "profile.reference=none",
                "transforms.shard.scope=subgraph",
            ],
            "leaves weights of the eager model or the graph unfilled",
        ),
    ],
)
def test_a_world_the_model_cannot_split_is_a_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_config(compose_dict(["model=tiny_llama3_1_8b", *overrides]), cuda_available=False)


def _communication_parents(node: dict, parents: tuple[str, ...] = ()) -> set[str]:
    """The module fqns (layer parts) whose kernels include the communication category."""
    found = set()
    if node["kind"] == "kernel" and node.get("category") == "communication":
        found.add(next((p for p in reversed(parents) if p), ""))
    for child in node["children"]:
        found |= _communication_parents(child, (*parents, node["fqn"] if node["kind"] == "module" else ""))
    return found


@pytest.mark.slow
def test_two_ranks_are_one_run_with_the_tokens_of_one_process(tmp_path, tracking_uri):
    two = run_pipeline([*ARGS, "runtime.world_size=2", f"tracking.uri={tracking_uri}"], tmp_path / "two")
    assert two.returncode == 0, two.stderr[-3000:]
    assert "[rank 1]" in two.stderr
    one = run_pipeline(
        [*ARGS, "profile.enabled=false", "report.enabled=false", "tracking.enabled=false"], tmp_path / "one"
    )
    assert one.returncode == 0, one.stderr[-3000:]
    root = tmp_path / "two" / "run"
    reference = generated_tokens(tmp_path / "one" / "run")
    assert reference and generated_tokens(root) == reference == generated_tokens(root / "rank1")

    client, runs = mlflow_runs(tracking_uri)
    assert len(runs) == 1  # one per job, never one per rank
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == "2"
    metrics = run.data.metrics
    assert metrics["profile/comm_pct"] > 0 and metrics["ranks/rank1_comm_pct"] > 0
    assert metrics["ranks/rank0_decode_ms"] > 0 and metrics["ranks/rank1_decode_ms"] > 0
    rank1 = {f.path for f in client.list_artifacts(run.info.run_id, "rank1")}
    assert {"rank1/summary.json", "rank1/pipeline.log", "rank1/profile", "rank1/generation"} <= rank1
    traces = {f.path for f in client.list_artifacts(run.info.run_id, "traces/decode_1")}
    assert traces == {"traces/decode_1/rank0.json", "traces/decode_1/rank1.json"}

    # each rank's all-reduces under the projection issuing them, the logits' all-gather under lm_head
    for folder in (root, root / "rank1"):
        decode = json.loads((folder / "profile" / "profile.json").read_text())["phases"]["decode"]
        parents = _communication_parents(decode["summary_stats"])
        assert parents == {"model.layers.*.self_attn.o_proj", "model.layers.*.mlp.down_proj", "lm_head"}, (
            parents
        )
    report = (root / "report" / "report.md").read_text()
    assert "Tensor-parallel ranks (2)" in report and "rank 1 comm ms" in report

    hta = pytest.importorskip("hta.trace_analysis")
    analysis = hta.TraceAnalysis(trace_dir=str(root / "traces" / "decode_1"))
    assert analysis.t.get_ranks() == [0, 1]


def _start_paused(stage: str, tmp_path, uri: str) -> subprocess.Popen:
    return start_paused(stage, [*ARGS, "runtime.world_size=2", f"tracking.uri={uri}"], tmp_path / "run")


def _wait_until_paused(proc: subprocess.Popen, root, stage: str, timeout: float = 300) -> None:
    """Both ranks inside the stage's pause."""
    deadline = time.monotonic() + timeout
    for log in (root / "pipeline.log", root / "rank1" / "pipeline.log"):
        while not (log.exists() and f"[{stage}] ..." in log.read_text()):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, f"never reached {stage}"
            time.sleep(0.2)
    time.sleep(0.5)


@pytest.mark.slow
def test_a_killed_rank_fails_the_job_naming_it(tmp_path, tracking_uri):
    proc = _start_paused("generate", tmp_path, tracking_uri)
    root = tmp_path / "run"
    _wait_until_paused(proc, root, "generate")
    os.kill(json.loads((root / "rank1" / "logs" / "progress.json").read_text())["pid"], signal.SIGKILL)
    # liveness, not speed: the job ends within seconds plus the peers' 30 s grace; 180 s holds on a
    # host three times slower
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 1, stderr[-3000:]
    assert "run failed: stage 'generate' failed: rank 1 was killed by SIGKILL in stage generate" in stderr
    _, runs = mlflow_runs(tracking_uri)
    assert len(runs) == 1 and runs[0].info.status == "FAILED"
    tags = runs[0].data.tags
    assert tags["failed_stage"] == "generate" and tags["failed_rank"] == "1"
    assert "rank 1 was killed by SIGKILL" in tags["error"]
    summary = json.loads((root / "summary.json").read_text())
    assert summary["status"] == "FAILED" and summary["failed_stage"] == "generate"
    assert "rank 1 was killed by SIGKILL" in (root / "pipeline.log").read_text()  # rank 0 heard it


@pytest.mark.slow
def test_an_interrupt_ends_both_ranks_killed(tmp_path, tracking_uri):
    proc = _start_paused("generate", tmp_path, tracking_uri)
    root = tmp_path / "run"
    _wait_until_paused(proc, root, "generate")
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)  # liveness: seconds here, 120 s on any host
    assert proc.returncode == 130, stderr[-3000:]
    _, runs = mlflow_runs(tracking_uri)
    assert len(runs) == 1 and runs[0].info.status == "KILLED"
    assert runs[0].data.tags["failed_stage"] == "generate"
    for folder in (root, root / "rank1"):
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["status"] == "KILLED" and summary["failed_stage"] == "generate", folder


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch-simple", "torch-cudagraph"])
def test_two_gpu_ranks_give_the_tokens_of_one_gpu(backend, tmp_path, tracking_uri):
    """NCCL, one GPU per rank, float32: the greedy tokens of one GPU, the all-reduces profiled as
    communication kernels (NCCL's) under the projections that issue them."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    args = [
        *(a for a in ARGS if not a.startswith("backend=")),
        f"backend={backend}",
        "device=cuda",
        "dtype=float32",
        f"tracking.uri={tracking_uri}",
    ]
    two = run_pipeline([*args, "runtime.world_size=2"], tmp_path / "two")
    assert two.returncode == 0, two.stderr[-3000:]
    one = run_pipeline([*args, "profile.enabled=false"], tmp_path / "one")
    assert one.returncode == 0, one.stderr[-3000:]
    root = tmp_path / "two" / "run"
    assert (
        generated_tokens(root)
        == generated_tokens(tmp_path / "one" / "run")
        == generated_tokens(root / "rank1")
    )
    decode = json.loads((root / "profile" / "profile.json").read_text())["phases"]["decode"]
    assert _communication_parents(decode["summary_stats"]), "no NCCL kernel in the profile"


@pytest.mark.slow
def test_torchrun_runs_the_same_job(tmp_path, tracking_uri):
    """`torchrun --nproc-per-node 2 -m pipeline runtime.world_size=2`: torchrun's processes join one
    group, take rank 0's run folder (rank 1 drops the one Hydra made for it) and make one MLflow run."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
            str(free_port()), "-m", "pipeline", *ARGS, "profile.enabled=false", "runtime.world_size=2",
            f"tracking.uri={tracking_uri}", f"hydra.run.dir={run_dir}",
        ],
        cwd=REPO_ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert generated_tokens(run_dir) == generated_tokens(run_dir / "rank1")
    _, runs = mlflow_runs(tracking_uri)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert (run_dir / "rank1" / "summary.json").exists()


@pytest.mark.slow
def test_torchrun_over_two_nodes_meets_at_a_rendezvous(tmp_path, tracking_uri):
    """Two torchrun agents, one process each, meeting at a c10d rendezvous as two hosts would
    (`--nnodes 2 --rdzv-backend c10d --rdzv-endpoint host0:port`): each agent's Hydra makes a run
    folder of its own, as on two hosts; the job's run folder is rank 0's, rank 1 writes `rank1/` in
    it and drops its own, and the job is one MLflow run."""
    endpoint, job = f"127.0.0.1:{free_port()}", f"job{os.getpid()}"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", job, "-m", "pipeline",
        *ARGS, "profile.enabled=false", "runtime.world_size=2", f"tracking.uri={tracking_uri}",
    ]  # fmt: skip
    agents = [
        subprocess.Popen(
            [*command, f"hydra.run.dir={tmp_path / f'node{node}'}"],
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for node in (0, 1)
    ]
    ended = [agent.communicate(timeout=600) for agent in agents]
    for agent, (_, stderr) in zip(agents, ended, strict=True):
        assert agent.returncode == 0, stderr[-3000:]
    # Which agent's process became rank 0 is the rendezvous's choice: the job's folder is its.
    roots = [tmp_path / f"node{node}" for node in (0, 1) if (tmp_path / f"node{node}" / "rank1").exists()]
    assert len(roots) == 1, sorted(p.name for p in tmp_path.iterdir())
    root = roots[0]
    assert generated_tokens(root) and generated_tokens(root) == generated_tokens(root / "rank1")
    assert {p.name for p in tmp_path.iterdir() if p.name.startswith("node")} == {root.name}
    _, runs = mlflow_runs(tracking_uri)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.params["world_size"] == "2"


@pytest.mark.slow
def test_a_sweep_of_tensor_parallel_jobs_through_submitit(tmp_path, tracking_uri):
    """hydra/launcher=local (hydra-submitit-launcher's local executor, the SLURM launcher's code
    path): each job, a process of submitit's, spawns its own two ranks; each job is one child run of
    the sweep's parent, holding rank 1's folder, and the two ways of finding the tuples give the same
    tokens."""
    proc = run_pipeline(
        [
            "-m",
            "hydra/launcher=local",
            *ARGS,
            "profile.enabled=false",
            "runtime.world_size=2",
            "transforms.shard.source=heuristic,tp_plan",
            f"tracking.uri={tracking_uri}",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    client, runs = mlflow_runs(tracking_uri)
    parent = sweep_parent(runs)
    children = child_runs(runs, parent)
    assert len(runs) == 3 and len(children) == 2, [r.info.run_name for r in runs]
    assert all(r.info.status == "FINISHED" and r.data.params["world_size"] == "2" for r in children)
    for run in children:
        assert "rank1/summary.json" in {f.path for f in client.list_artifacts(run.info.run_id, "rank1")}
    jobs = sorted(p for p in (tmp_path / "multirun").glob("*") if (p / "rank1").is_dir())
    assert len(jobs) == 2, sorted(p.name for p in (tmp_path / "multirun").iterdir())
    tokens = [generated_tokens(job) for job in jobs]
    assert tokens[0] and tokens[0] == tokens[1] == generated_tokens(jobs[0] / "rank1")
    assert len(list((tmp_path / "multirun" / ".submitit").glob("*/*_log.out"))) == 2
