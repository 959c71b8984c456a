"""The only module that imports mlflow: one run per job, params, metrics, artifacts, status.

Tracking never decides whether a job succeeds: when the store cannot be reached or written, the
job goes on with its local outputs, says once and clearly what was not logged, and leaves
`tracking_offline.txt` in the run folder.
"""

from __future__ import annotations

import getpass
import logging
import math
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline import REPO_ROOT

log = logging.getLogger(__name__)

MAX_PARAM_KEY = 250
MAX_PARAM_VALUE = 6000
BATCH = 100  # params per log_batch call, MLflow's limit
SIGNIFICANT_DIGITS = 4  # timings on a shared machine do not mean more
SYSTEM_METRICS_INTERVAL_S = 2.0  # psutil samples (system/*): a tiny run lasts 20-60 s
# The experiment opens in the UI's classic runs view where MLflow reads this (3.17 still opens the
# GenAI view unless the URL says ?workflowType=machine_learning: `make ui` prints that URL).
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}


def default_uri() -> str:
    return f"sqlite:///{REPO_ROOT / 'mlflow.db'}"


def artifact_root(uri: str) -> str | None:
    """Artifacts beside an embedded SQLite store (absolute); a server decides its own."""
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").resolve().as_uri()
    return None


def flatten_params(cfg: DictConfig | Any) -> dict[str, str]:
    """The resolved config (a DictConfig or the typed PipelineConfig) as dotted keys, within
    MLflow's key and value limits."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    flat: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            text = str(node)
            if len(prefix) <= MAX_PARAM_KEY:
                flat[prefix] = text if len(text) <= MAX_PARAM_VALUE else text[: MAX_PARAM_VALUE - 3] + "..."

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return flat


def rounded(value: float) -> float:
    """A metric's value to SIGNIFICANT_DIGITS; whole numbers (counts, bytes) stay exact."""
    value = float(value)
    if not math.isfinite(value) or value.is_integer():
        return value
    return float(f"{value:.{SIGNIFICANT_DIGITS}g}")


def source_tags() -> dict[str, str]:
    """MLflow's own source tags (its Source, Version and User columns)."""
    return {
        "mlflow.source.git.commit": git_commit(),
        "mlflow.source.name": "python -m pipeline",
        "mlflow.source.type": "LOCAL",
        "mlflow.user": _user(),
    }


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class Tracker:
    """One MLflow run. Every call is safe: after the first failure it only writes locally."""

    def __init__(self, uri: str | None, experiment: str, run_dir: Path, enabled: bool = True):
        self.uri = uri or default_uri()
        self.experiment = experiment
        self.run_dir = run_dir
        self.enabled = enabled
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.run_name: str | None = None  # as the store gave it (the asked-for one, or with a suffix)
        self.client = None
        self.unlogged: list[str] = []
        self.system_metrics = None  # MLflow's psutil sampler while the run is open

    @property
    def active(self) -> bool:
        return self.enabled and self.client is not None and self.run_id is not None

    def _offline(self, what: str, exc: BaseException) -> None:
        reason = f"{what}: {short(exc)}"
        if not self.unlogged:  # once: every later call is already local-only
            log.warning(
                "MLflow tracking at %s failed (%s); the run continues with local outputs only in %s",
                self.uri,
                reason,
                self.run_dir,
            )
        self.unlogged.append(reason)
        if self.client is not None and self.run_id is not None:
            # The store took the run but not all of it: say so there and close it, so it never
            # stays RUNNING or passes for complete (pipeline.tools.sync uploads the folder later).
            try:
                self.client.set_tag(self.run_id, "tracking", f"incomplete: {reason}"[:5000])
                self.client.set_terminated(self.run_id, "FAILED")
            except Exception:  # the store is gone altogether
                pass
        self._stop_system_metrics()
        self.client = None
        (self.run_dir / "tracking_offline.txt").write_text(
            f"MLflow store: {self.uri}\nNot logged:\n" + "\n".join(self.unlogged) + "\n"
            f"Upload the finished folder later: python -m pipeline.tools.sync {self.run_dir}\n"
        )

    def start(
        self,
        run_name: str,
        tags: dict[str, str],
        params: dict[str, str],
        description: str = "",
        system_metrics: bool = True,
    ) -> None:
        """Opens the run under `run_name`, made unique in the experiment (`·2` ...), with MLflow's
        source tags, the description and (system_metrics) a psutil sampler until end()."""
        if not self.enabled:
            return
        # A tracking server that does not answer must not hold the job for minutes of retries.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri=self.uri)
            experiment = self.client.get_experiment_by_name(self.experiment)
            if experiment is None:
                try:
                    experiment_id = self.client.create_experiment(
                        self.experiment, artifact_location=artifact_root(self.uri), tags=EXPERIMENT_KIND
                    )
                except Exception:  # created meanwhile by a parallel job
                    experiment_id = self.client.get_experiment_by_name(self.experiment).experiment_id
            else:
                experiment_id = experiment.experiment_id
            self._close_stale_runs(experiment_id)
            tags = {**source_tags(), **tags, "host": socket.gethostname(), "pid": str(os.getpid())}
            if description:
                tags["mlflow.note.content"] = description
            run = self.client.create_run(
                experiment_id, run_name=self._unique(experiment_id, run_name), tags=tags
            )
            self.run_id, self.run_name = run.info.run_id, run.info.run_name
            self.experiment_id = experiment_id
            items = [Param(k, v) for k, v in params.items()]
            for i in range(0, len(items), BATCH):
                self.client.log_batch(self.run_id, params=items[i : i + BATCH])
            log.info(
                "MLflow run '%s' (%s) in experiment '%s' at %s",
                run.info.run_name,
                self.run_id,
                self.experiment,
                self.uri,
            )
        except Exception as exc:
            self._offline("starting the run", exc)
            return
        if system_metrics:
            self._start_system_metrics()

    def resume(self, run_id: str) -> None:
        """Takes up a run another process opened (the supervisor of tensor-parallel ranks closing
        rank 0's run): tags, artifacts and the final status go to it."""
        if not self.enabled:
            return
        try:
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri=self.uri)
            self.run_id = self.client.get_run(run_id).info.run_id
        except Exception as exc:
            self._offline(f"reopening run {run_id}", exc)

    def _unique(self, experiment_id: str, name: str) -> str:
        from pipeline.run_identity import unique

        escaped = name.replace("'", "\\'")
        runs = self.client.search_runs(
            [experiment_id], filter_string=f"attributes.run_name LIKE '{escaped}%'", max_results=1000
        )
        return unique(name, {r.info.run_name for r in runs})

    def _start_system_metrics(self) -> None:
        """MLflow's sampler of CPU, memory, disk, network (and GPU) use; needs psutil."""
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
            self.system_metrics = SystemMetricsMonitor(
                self.run_id, sampling_interval=SYSTEM_METRICS_INTERVAL_S, tracking_uri=self.uri
            )
            self.system_metrics.start()
        except Exception as exc:  # psutil missing: the run goes on without system/* metrics
            log.warning("no system metrics: %s", short(exc))
            self.system_metrics = None

    def _stop_system_metrics(self) -> None:
        if self.system_metrics is not None:
            try:
                self.system_metrics.finish()
            except Exception:  # its last sample could not be written: the run's own data stands
                pass
            self.system_metrics = None

    def _close_stale_runs(self, experiment_id: str) -> None:
        """Runs this host left RUNNING whose process is gone (SIGKILL, a crash, a power cut) are
        marked FAILED, so the store never shows a dead run as running."""
        host = socket.gethostname()
        stale = self.client.search_runs(
            [experiment_id], filter_string=f"attributes.status = 'RUNNING' and tags.host = '{host}'"
        )
        for run in stale:
            pid = int(run.data.tags.get("pid", "0") or 0)
            if pid and _alive(pid):
                continue
            self.client.set_tag(
                run.info.run_id, "error", f"process {pid} on {host} ended without closing the run"
            )
            self.client.set_terminated(run.info.run_id, "FAILED")
            log.warning(
                "run %s (pid %d) was left RUNNING by a process that is gone: marked FAILED",
                run.info.run_id,
                pid,
            )

    def log_params(self, params: dict[str, str]) -> None:
        """Params known only once a stage has run (a param is set once: a key not logged before)."""
        if not self.active:
            return
        try:
            from mlflow.entities import Param

            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in params.items()])
        except Exception as exc:
            self._offline("logging params", exc)

    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Metrics at step 0, rounded (`rounded`)."""
        self._log_metric_items([(k, v, 0) for k, v in metrics.items()])

    def log_steps(self, key: str, values: list[float]) -> None:
        """One metric over steps 1..N (the UI draws it as a line chart)."""
        self._log_metric_items([(key, v, step) for step, v in enumerate(values, start=1)])

    def _log_metric_items(self, items: list[tuple[str, float, int]]) -> None:
        if not self.active or not items:
            return
        try:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            metrics = [Metric(k, rounded(v), now, step) for k, v, step in items]
            for i in range(0, len(metrics), 1000):
                self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])
        except Exception as exc:
            self._offline(f"metrics {sorted({k for k, _, _ in items})}", exc)

    def log_dict(self, dictionary: dict[str, Any], artifact_file: str) -> None:
        """A dict as a YAML or JSON artifact (by the file's suffix)."""
        if not self.active:
            return
        try:
            self.client.log_dict(self.run_id, dictionary, artifact_file)
        except Exception as exc:
            self._offline(f"artifact {artifact_file}", exc)

    def log_table(self, columns: dict[str, list], artifact_file: str) -> None:
        """Columns as an MLflow table: the UI's artifact compare shows it across runs."""
        if not self.active or not columns:
            return
        try:
            import pandas as pd

            self.client.log_table(self.run_id, pd.DataFrame(columns), artifact_file)
        except Exception as exc:
            self._offline(f"table {artifact_file}", exc)

    def log_workload(self, columns: dict[str, list], name: str) -> None:
        """The requests a run served, as its input dataset (the UI's Datasets column)."""
        if not self.active or not columns:
            return
        try:
            import mlflow.data
            import pandas as pd
            from mlflow.entities import DatasetInput, InputTag

            dataset = mlflow.data.from_pandas(pd.DataFrame(columns), name=name)
            context = InputTag(key="mlflow.data.context", value="workload")
            inputs = [DatasetInput(dataset._to_mlflow_entity(), [context])]
            try:
                self.client.log_inputs(self.run_id, inputs)
            except Exception as exc:
                # Parallel jobs of a sweep log the same workload: the store creates a dataset on
                # first use, and a second job that raced it is refused once; the dataset exists then.
                if "UNIQUE constraint" not in str(exc):
                    raise
                time.sleep(0.2)
                self.client.log_inputs(self.run_id, inputs)
        except Exception as exc:
            self._offline(f"workload {name}", exc)

    def log_spans(self, name: str, spans: list[tuple[str, int, int, str, dict[str, Any]]]) -> None:
        """One MLflow trace linked to the run (its Traces tab): a root span over the given
        (name, start ns, end ns, status OK|ERROR, attributes), one child span each."""
        if not self.active or not spans:
            return
        import mlflow

        before = mlflow.get_tracking_uri()
        # Tracing exports through the process's tracking URI: this store, written before return.
        os.environ["MLFLOW_ENABLE_ASYNC_TRACE_LOGGING"] = "false"
        logging.getLogger("mlflow.tracing").setLevel(logging.ERROR)
        try:
            mlflow.set_tracking_uri(self.uri)
            failed = any(status != "OK" for *_, status, _ in spans)
            root = self.client.start_trace(
                name, experiment_id=self.experiment_id, run_id=self.run_id, start_time_ns=spans[0][1]
            )
            for span_name, start_ns, end_ns, status, attributes in spans:
                span = self.client.start_span(
                    span_name, root.trace_id, root.span_id, attributes=attributes, start_time_ns=start_ns
                )
                self.client.end_span(root.trace_id, span.span_id, status=status, end_time_ns=end_ns)
            self.client.end_trace(root.trace_id, status="ERROR" if failed else "OK", end_time_ns=spans[-1][2])
        except Exception as exc:  # a trace is a view of the stage times the run has as metrics
            log.warning("the stage trace was not logged: %s", short(exc))
        finally:
            mlflow.set_tracking_uri(before)

    def set_tags(self, tags: dict[str, str]) -> None:
        if not self.active:
            return
        try:
            for key, value in tags.items():
                self.client.set_tag(self.run_id, key, str(value)[:5000])
        except Exception as exc:
            self._offline(f"tags {sorted(tags)}", exc)

    def log_artifact(self, path: Path) -> None:
        """A file or folder under the run folder, at the same relative place in the run's artifacts."""
        if not self.active or not path.exists():
            return
        try:
            relative = path.resolve().relative_to(self.run_dir.resolve())
            parent = str(relative.parent) if str(relative.parent) != "." else None
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), artifact_path=str(relative))
            else:
                self.client.log_artifact(self.run_id, str(path), artifact_path=parent)
        except Exception as exc:
            self._offline(f"artifact {path}", exc)

    def log_image(self, key: str, path: Path) -> None:
        """A PNG under a fixed key, so the UI's image charts line up the same plot across runs."""
        if not self.active:
            return
        try:
            from PIL import Image

            with Image.open(path) as image:
                self.client.log_image(self.run_id, image.convert("RGB"), key=key, step=0)
        except Exception as exc:
            self._offline(f"image {key}", exc)

    def end(self, status: str) -> None:
        """status: FINISHED, FAILED or KILLED."""
        if not self.active:
            return
        self._stop_system_metrics()
        try:
            self.client.set_terminated(self.run_id, status=status)
        except Exception as exc:
            self._offline(f"final status {status}", exc)


def run_file(run_id: str, relative: str, uri: str | None, into: Path) -> tuple[str, Path]:
    """(run name, the path of a run's file `relative` on this machine): in the run's own folder when
    it is here (its `run_dir` tag), else its artifact downloaded into `into`. LookupError with a
    one-line reason when there is no such run or file."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    uri = uri or default_uri()
    client = MlflowClient(uri)
    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise LookupError(f"{run_id} is neither a run folder nor a run id in {uri}") from None
    name = run.info.run_name or run_id
    local = Path(run.data.tags.get("run_dir", "")) / relative
    if run.data.tags.get("run_dir") and local.exists():
        return name, local
    try:
        return name, Path(client.download_artifacts(run_id, relative, str(into)))
    except (MlflowException, OSError) as exc:
        raise LookupError(f"run {run_id} has no {relative} artifact ({type(exc).__name__})") from None
