"""The MLflow UI's address of an experiment's runs table in the classic (model training) view:
MLflow 3.17 opens an experiment in its GenAI view unless the URL asks for the other.

python -m pipeline.tools.ui_url [--port 5000] [--tracking-uri URI] [--experiment pipeline]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.tracking import default_uri

CLASSIC_VIEW = "workflowType=machine_learning"


def runs_url(base: str, experiment_id: str | None) -> str:
    if experiment_id is None:
        return f"{base}/#/experiments?{CLASSIC_VIEW}"
    return f"{base}/#/experiments/{experiment_id}/runs?{CLASSIC_VIEW}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--tracking-uri", default=None, help="default: the embedded store")
    parser.add_argument("--experiment", default="pipeline")
    args = parser.parse_args(argv)
    uri = args.tracking_uri or default_uri()
    experiment_id = None
    if not uri.startswith("sqlite:///") or Path(uri.removeprefix("sqlite:///")).exists():
        from mlflow.tracking import MlflowClient

        experiment = MlflowClient(uri).get_experiment_by_name(args.experiment)
        experiment_id = experiment.experiment_id if experiment else None
    print(
        f"MLflow UI, runs of '{args.experiment}': {runs_url(f'http://127.0.0.1:{args.port}', experiment_id)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
