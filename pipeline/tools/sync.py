"""Upload a finished run folder to MLflow later: for runs whose tracking store was unreachable,
read-only or full while they ran (they say so in tracking_offline.txt).

python -m pipeline.tools.sync <run folder> [--tracking-uri URI] [--experiment NAME]

The run gets the params, tags and metrics of the folder's summary, its config as config.yaml, every
file of the folder as artifacts and its final status (FINISHED, FAILED or KILLED).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omegaconf import OmegaConf

from pipeline.sweep import SUMMARY_FILE
from pipeline.tracking import Tracker, flatten_params


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a run folder (outputs/<date>/<time>_...)")
    parser.add_argument("--tracking-uri", default=None, help="default: the run's own tracking.uri")
    parser.add_argument("--experiment", default=None, help="default: the run's own tracking.experiment")
    args = parser.parse_args(argv)
    summary_path, config_path = args.folder / SUMMARY_FILE, args.folder / ".hydra" / "config.yaml"
    if not summary_path.exists() or not config_path.exists():
        print(
            f"error: {args.folder} is not a finished run folder (no {SUMMARY_FILE} or .hydra/config.yaml)",
            file=sys.stderr,
        )
        return 2
    summary = json.loads(summary_path.read_text())
    cfg = OmegaConf.load(config_path)
    uri = args.tracking_uri or cfg.tracking.uri
    tracker = Tracker(uri, args.experiment or cfg.tracking.experiment, args.folder)
    tags = {k: str(v) for k, v in summary["tags"].items()} | {"synced_from": str(args.folder.resolve())}
    if summary["status"] != "FINISHED":
        tags |= {"failed_stage": summary["failed_stage"], "error": summary["error"]}
    params = summary.get("params") or flatten_params(cfg)  # folders written before params were summarised
    tracker.start(summary["name"], tags, params, summary.get("description", ""), system_metrics=False)
    tracker.log_dict(OmegaConf.to_container(cfg, resolve=True), "config.yaml")
    tracker.log_metrics(summary["metrics"])
    for entry in sorted(args.folder.iterdir()):
        if entry.name != "tracking_offline.txt":
            tracker.log_artifact(entry)
    tracker.end(summary["status"])
    if tracker.unlogged or tracker.run_id is None:
        print(
            f"error: could not write to {tracker.uri}: {tracker.unlogged[0] if tracker.unlogged else 'no run'}",
            file=sys.stderr,
        )
        return 1
    print(f"run {tracker.run_id} in {tracker.uri}: {summary['status']}, {len(summary['metrics'])} metrics")
    return 0


if __name__ == "__main__":
    sys.exit(main())
