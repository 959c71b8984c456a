"""Tensor-parallel ranks (`runtime.world_size=N`): N processes in one torch.distributed group (gloo
on CPU, NCCL on GPU), each running every stage on its shard of the exported graph.

Two ways in, one program:
- `python -m pipeline runtime.world_size=N`: the Hydra job validates the config once, then spawns
  the N ranks on this host and supervises them (`launch`).
- `torchrun --nproc-per-node N [--nnodes M ...] -m pipeline runtime.world_size=N*M`: torchrun
  started the processes; each validates (the same config, the same answer), joins the group from
  torchrun's environment and takes rank 0's run folder (`run_under_torchrun`).

Rank 0 owns the job's run folder and its one MLflow run; rank k > 0 writes its own run folder as
`<run folder>/rank<k>/` and opens no MLflow run; rank 0 logs those folders as artifacts. The ranks
meet once, at the start of the report stage, so rank 0's report can compare their profiles.

Failure: the supervisor (the spawning job) watches the processes. When one ends badly, the others
are told (SIGUSR1: the stage they are in raises PeerFailed, naming the rank), get GRACE_S to close
their records, and are then killed; the job's MLflow run ends FAILED with the first failed rank,
its stage and its cause (`failed_rank`, `failed_stage`, `error`). Every collective times out after
runtime.collective_timeout_s, so no rank waits forever on a peer that hangs. An interrupt of the job
reaches every rank (each ends KILLED), and a rank whose parent is gone ends itself the same way.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.config import PipelineConfig
from pipeline.errors import ConfigError, RunFailed, StageFailure
from pipeline.parallel import PROGRESS, Rank, free_port, join, rank_dir, stop_signals
from pipeline.state import Job

log = logging.getLogger(__name__)

GRACE_S = 30.0  # after a peer failed or an interrupt: how long ranks get to close their records
PEER_NOTE = Path("logs") / "rank_failure.txt"  # in the job's folder: which rank failed, and how
LOG_FORMAT = "[%(asctime)s][rank {rank}][%(name)s][%(levelname)s] - %(message)s"


class PeerFailed(StageFailure):
    """Raised in a rank's running stage when the supervisor says another rank ended badly."""


def torchrun_world() -> int | None:
    """The world size torchrun (or any launcher of torch.distributed's env:// convention) gave this
    process; None when it was started on its own."""
    if {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
        return int(os.environ["WORLD_SIZE"])
    return None


def check_world(config: PipelineConfig, hf_config, on_cuda: bool, multirun: bool) -> None:
    """Everything about runtime.world_size that can be wrong, before any rank starts: ConfigError
    naming the number and the fix."""
    from pipeline.models.zoo import text_config_of

    world, launched = config.runtime.world_size, torchrun_world()
    if launched is not None and launched > 1 and launched != world:
        raise ConfigError(
            f"torchrun started {launched} processes but runtime.world_size={world}; "
            f"pass runtime.world_size={launched}"
        )
    if config.runtime.tp_weights == "shard":
        check_shard_weights(config, world)
    if world <= 1:
        return
    if launched is not None and multirun:
        raise ConfigError(
            "a sweep (-m) under torchrun: torchrun runs one job; sweep with `python -m pipeline -m "
            "runtime.world_size=N ...` (each job spawns its ranks) or one torchrun per job (docs/tensor-parallel.md)"
        )
    if config.capture.mode == "none":
        raise ConfigError(
            f"runtime.world_size={world} shards the exported graph, and capture=none exports none; "
            "use capture=partial (or full)"
        )
    shard = config.transforms.get("shard")
    if shard is None or (shard or {}).get("enabled", True) is False:
        raise ConfigError(
            f"runtime.world_size={world} needs the shard transform, and transforms.shard is off; "
            "turn it on (transforms.shard.enabled=true)"
        )
    text = text_config_of(hf_config)
    heads = getattr(text, "num_attention_heads", None)
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or heads,
        "intermediate_size": getattr(text, "intermediate_size", None),
        "intermediate_size_mlp": getattr(text, "intermediate_size_mlp", None),  # Llama-4's dense layers
    }
    for key, size in sizes.items():
        if isinstance(size, int) and size % world:
            raise ConfigError(
                f"runtime.world_size={world} does not divide the model's {key}={size}; use a world size "
                f"that divides {size}"
            )
    if on_cuda:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if local > torch.cuda.device_count():
            raise ConfigError(
                f"runtime.world_size={world} needs {local} GPUs on this host and it has "
                f"{torch.cuda.device_count()}; use fewer ranks, or torchrun over several hosts"
            )


def profiles_eager_reference(config: PipelineConfig) -> bool:
    """Whether the run profiles the whole eager model beside it, which runtime.tp_weights=shard
    cannot hold."""
    return config.profile.enabled and config.profile.reference == "eager"


def check_shard_weights(config: PipelineConfig, world: int) -> None:
    """runtime.tp_weights=shard leaves no whole weight on any rank: what needs one is refused."""
    key = "runtime.tp_weights=shard"
    if world <= 1:
        raise ConfigError(
            f"{key} splits the weights among tensor-parallel ranks and runtime.world_size={world} is one "
            "process; set runtime.world_size=N (N > 1) or runtime.tp_weights=whole"
        )
    if config.capture.submodules:
        raise ConfigError(
            f"{key} defers the language model's linears to the shard transform, which sees only the "
            "graph capture.submodules names; leave capture.submodules empty (capture=partial finds the "
            "language model)"
        )
    if profiles_eager_reference(config):
        raise ConfigError(
            f"{key}: no rank holds the whole eager model to profile beside the run; set "
            "profile.reference=none (or runtime.tp_weights=whole)"
        )
    shard = config.transforms.get("shard") or {}
    scope = shard.get("scope", ["subgraph", "model"])
    scopes = [scope] if isinstance(scope, str) else list(scope)
    if not {"subgraph", "model"} <= set(scopes):
        raise ConfigError(
            f"{key}: transforms.shard.scope={','.join(scopes)} leaves weights of the eager model or the "
            "graph unfilled; set transforms.shard.scope=[subgraph,model]"
        )


# -- one rank -------------------------------------------------------------------------------------


def run_rank(me: Rank, job: Job, parent_run_id: str | None) -> None:
    """The stages on this rank (in its group already), in its own folder; RunFailed or
    KeyboardInterrupt as a run does."""
    from pipeline.runner import Runner  # as __main__ does: a config error never waits for the stages' imports

    Runner(replace(job, run_dir=me.run_dir), rank=me, parent_run_id=parent_run_id).run()
    dist.destroy_process_group()


def _join(me: Rank, init_method: str, config: PipelineConfig, on_cuda: bool) -> None:
    join(me.rank, me.world, init_method, config.runtime.collective_timeout_s, on_cuda, me.local_rank)


def _handle_signals(root: Path) -> None:
    """SIGINT/SIGTERM: the stage raises KeyboardInterrupt (KILLED); SIGUSR1, sent by the supervisor
    when a peer failed: PeerFailed with the supervisor's note. Each once: an interrupt from the
    terminal and the supervisor's forwarded one are one interrupt."""

    def interrupted(signum, frame):
        stop_signals()
        raise KeyboardInterrupt(f"signal {signum}")

    def peer_failed(signum, frame):
        stop_signals()
        note = root / PEER_NOTE
        raise PeerFailed(note.read_text().strip() if note.exists() else "another rank failed")

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGUSR1, peer_failed)


def _end_with_parent() -> None:
    """A rank whose launcher is gone (killed with SIGKILL) interrupts itself instead of computing
    for nobody: it ends KILLED."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _log_to(me: Rank, level: int, replace: type[logging.Handler] | None = None) -> None:
    """This rank's lines to its folder's pipeline.log (rank 0: the job's, appended) and stderr,
    each line marked with the rank; replace: handlers of that type (Hydra's file) are dropped."""
    root_logger = logging.getLogger()
    for handler in list(root_logger.handlers):
        if replace is None or isinstance(handler, replace):
            root_logger.removeHandler(handler)
            handler.close()
    me.run_dir.mkdir(parents=True, exist_ok=True)
    formatter = logging.Formatter(LOG_FORMAT.format(rank=me.rank))
    handlers: list[logging.Handler] = [logging.FileHandler(me.run_dir / "pipeline.log")]
    if replace is None:
        handlers.append(logging.StreamHandler())
    for handler in handlers:
        handler.setFormatter(formatter)
        root_logger.addHandler(handler)
    root_logger.setLevel(level)


# -- spawned by the job ---------------------------------------------------------------------------


@dataclass
class RankStart:
    """What a spawned rank needs beside its job, pickled into its process."""

    job: Job  # the checked job, not Hydra's config
    port: int
    threads: int  # intra-op threads per CPU rank: the job's, divided among the ranks
    parent_run_id: str | None
    log_level: int


def _spawned(rank: int, start: RankStart) -> None:
    job = start.job
    me = Rank(rank, job.config.runtime.world_size, rank, job.run_dir)
    _handle_signals(job.run_dir)
    _end_with_parent()
    _log_to(me, start.log_level)
    torch.set_num_threads(start.threads)
    try:
        _join(me, f"tcp://127.0.0.1:{start.port}", job.config, job.device.type == "cuda")
        run_rank(me, job, start.parent_run_id)
    except RunFailed as exc:
        log.error("run failed: %s", exc)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)


def launch(job: Job, parent_run_id: str | None) -> None:
    """Spawn runtime.world_size ranks on this host and supervise them to the end: returns when all
    finished; RunFailed naming the first rank that failed; KeyboardInterrupt when interrupted."""
    config, root, on_cuda = job.config, job.run_dir, job.device.type == "cuda"
    world = config.runtime.world_size
    threads = max(1, torch.get_num_threads() // world)
    start = RankStart(job, free_port(), threads, parent_run_id, logging.getLogger().getEffectiveLevel())
    log.info(
        "starting %d ranks (%s)%s; rank k>0 writes %s/rank<k>/",
        world, "NCCL, a GPU each" if on_cuda else "gloo", "" if on_cuda else f", {threads} threads each", root,
    )  # fmt: skip
    context = mp.get_context("spawn")
    procs = [context.Process(target=_spawned, args=(r, start), name=f"rank{r}") for r in range(world)]
    for proc in procs:
        proc.start()
    Supervisor(procs, root, config).wait()


class Supervisor:
    """Waits for the ranks; on the first one that ends badly, tells the others and, after GRACE_S,
    kills what is left; the job's record then names that rank."""

    def __init__(self, procs: list, root: Path, config: PipelineConfig):
        self.procs, self.root, self.config = procs, root, config
        self.failed: tuple[int, int] | None = None  # (rank, exit code) of the first to fail
        self.interrupted = False
        self.deadline: float | None = None

    def _live(self) -> list:
        return [p for p in self.procs if p.exitcode is None]

    def _signal(self, signum: int) -> None:
        for proc in self._live():
            try:
                os.kill(proc.pid, signum)
            except ProcessLookupError:
                pass

    def _on_interrupt(self, signum, frame) -> None:
        if not self.interrupted:
            log.error("interrupted: stopping every rank")
            self.interrupted = True
            self.deadline = time.monotonic() + GRACE_S
            self._signal(signal.SIGINT)

    def wait(self) -> None:
        previous = {s: signal.signal(s, self._on_interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._watch()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        if self.interrupted:
            self._close_record("KILLED", *self._where(0, "interrupted"))
            raise KeyboardInterrupt("the job was interrupted")
        if self.failed is not None:
            stage, cause = self._where(*self.failed)
            self._close_record("FAILED", stage, cause)
            raise RunFailed(stage, cause)

    def _watch(self) -> None:
        seen: set[int] = set()
        while self._live():
            wait([p.sentinel for p in self._live()], timeout=1.0)
            ended = [r for r, p in enumerate(self.procs) if p.exitcode is not None and r not in seen]
            # Ended together: a rank killed by a signal is the cause, not the peer that then failed
            # on the broken collective.
            for rank in sorted(ended, key=lambda r: (self.procs[r].exitcode >= 0, r)):
                proc = self.procs[rank]
                seen.add(rank)
                if proc.exitcode != 0 and self.failed is None and not self.interrupted:
                    self.failed = (rank, proc.exitcode)
                    _, cause = self._where(rank, proc.exitcode)
                    log.error("%s; stopping the other ranks", cause)
                    (self.root / PEER_NOTE).parent.mkdir(parents=True, exist_ok=True)
                    (self.root / PEER_NOTE).write_text(cause + "\n")
                    self.deadline = time.monotonic() + GRACE_S
                    self._signal(signal.SIGUSR1)
            if self.deadline is not None and time.monotonic() > self.deadline:
                for proc in self._live():
                    log.error("%s did not end within %.0f s: killed", proc.name, GRACE_S)
                    proc.kill()
                self.deadline = None

    def _where(self, rank: int, exitcode: int | str) -> tuple[str, str]:
        """(stage, cause) of a rank that ended with exitcode (or a reason)."""
        folder = rank_dir(self.root, rank)
        progress = _read_json(folder / PROGRESS)
        summary = _read_json(folder / "summary.json")
        stage = summary.get("failed_stage") or progress.get("stage") or "launch"
        if isinstance(exitcode, str):
            return stage, exitcode
        if exitcode < 0:
            cause = f"rank {rank} was killed by {signal.Signals(-exitcode).name}"
        elif summary.get("error"):
            cause = f"rank {rank}: {summary['error']}"
        elif exitcode == 130:
            cause = f"rank {rank} was interrupted"
        else:
            cause = f"rank {rank} exited with code {exitcode} (see {folder / 'pipeline.log'})"
        return stage, f"{cause} in stage {stage}"

    def _close_record(self, status: str, stage: str, cause: str) -> None:
        """The job's summary and MLflow run say how it ended, whatever rank 0 managed to write: its
        status, the failed rank's stage and cause; every rank's folder as artifacts."""
        from pipeline.sweep import SUMMARY_FILE
        from pipeline.tracking import Tracker

        summary_path = self.root / SUMMARY_FILE
        summary = _read_json(summary_path) or {
            "name": self.root.name, "tags": {}, "metrics": {}, "overrides": [], "run_id": None,
        }  # fmt: skip
        failed_rank = str(self.failed[0]) if self.failed else ""
        summary.update(status=status, failed_stage=stage, error=cause)
        summary["tags"]["failed_rank"] = failed_rank
        summary_path.write_text(json.dumps(summary, indent=1))
        run_id = summary.get("run_id") or _read_json(self.root / PROGRESS).get("run_id")
        tracking = self.config.tracking
        if not run_id or not tracking.enabled:
            return
        tracker = Tracker(tracking.uri, tracking.experiment, self.root)
        tracker.resume(run_id)
        tracker.set_tags({"failed_stage": stage, "error": cause, "failed_rank": failed_rank})
        others = [rank_dir(self.root, rank) for rank in range(1, len(self.procs))]
        for path in [self.root / "logs", self.root / "pipeline.log", *others]:
            tracker.log_artifact(path)
        tracker.end(status)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


# -- started by torchrun --------------------------------------------------------------------------


def run_under_torchrun(job: Job) -> None:
    """This process is one of torchrun's: join the group from its environment, take rank 0's run
    folder, run the stages. Rank k > 0 moves its log there and drops the folder Hydra made for it."""
    own_dir, config, on_cuda = job.run_dir, job.config, job.device.type == "cuda"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    _handle_signals(own_dir)
    _end_with_parent()
    _join(Rank(rank, world, local_rank, own_dir), "env://", config, on_cuda)
    shared = [str(own_dir.resolve())]
    dist.broadcast_object_list(shared, src=0)
    me = Rank(rank, world, local_rank, Path(shared[0]))
    if rank > 0:
        _log_to(me, logging.getLogger().getEffectiveLevel(), replace=logging.FileHandler)
        if own_dir.resolve() != me.root and {p.name for p in own_dir.iterdir()} <= {".hydra", "pipeline.log"}:
            shutil.rmtree(own_dir)  # Hydra's folder for this process: rank 0's is the job's
    log.info("rank %d of %d (torchrun), run folder %s", rank, world, me.run_dir)
    run_rank(me, job, None)
