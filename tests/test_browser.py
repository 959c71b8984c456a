"""The MLflow UI in a real headless browser: a small real sweep in a temporary store, the parent
and its children in the runs table, two runs compared, a run's breakdown plot among its
artifacts. Screenshots go to outputs/browser/ (.ci/run installs Debian's chromium when missing)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import REPO_ROOT, mlflow_runs, mlflow_server, run_pipeline

pytestmark = [pytest.mark.slow, pytest.mark.browser]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SHOTS = REPO_ROOT / "outputs" / "browser"


@pytest.fixture
def ui_server(tracking_uri):
    with mlflow_server(tracking_uri) as url:
        yield url


def test_sweep_parent_children_compare_and_plot_in_the_ui(tmp_path, tracking_uri, ui_server):
    sync_api = pytest.importorskip("playwright.sync_api")
    if not shutil.which("chromium") and not Path(CHROMIUM).exists():
        pytest.skip("chromium is not installed (.ci/run installs it)")
    proc = run_pipeline(
        [
            "-m",
            "model=tiny_llama3_1_8b",
            "capture=none,partial",
            "backend=torch-simple",
            "prompt.output_len=4",
            "profile.decode_steps=2",
            f"tracking.uri={tracking_uri}",
        ],  # fmt: skip
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, runs = mlflow_runs(tracking_uri)
    parent = next(r for r in runs if r.data.tags.get("sweep") == "parent")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    experiment = parent.info.experiment_id
    SHOTS.mkdir(parents=True, exist_ok=True)

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1500, "height": 900})
        page.goto(f"{ui_server}/#/experiments/{experiment}/runs")
        page.get_by_text(parent.info.run_name).first.wait_for(timeout=60_000)
        # Children are folded under their parent: expand it, then every child is listed.
        page.locator("button[data-component-id*='runnamecellrenderer']").first.click()
        for child in children:
            page.get_by_text(child.info.run_name, exact=True).first.wait_for(timeout=30_000)
        page.screenshot(path=SHOTS / "runs.png")

        ids = json.dumps([c.info.run_id for c in children])
        page.goto(f"{ui_server}/#/compare-runs?runs={ids}&experiments={json.dumps([experiment])}")
        page.get_by_text("latency/decode_ms").first.wait_for(timeout=60_000)
        for child in children:
            assert page.get_by_text(child.info.run_name).count() > 0
        page.screenshot(path=SHOTS / "compare.png", full_page=True)

        run_id = next(c.info.run_id for c in children if c.data.tags["capture"] == "partial")
        page.goto(
            f"{ui_server}/#/experiments/{experiment}/runs/{run_id}/artifacts/plots/module_breakdown.png"
        )
        image = page.locator("img[src^='blob:']").first  # the artifact viewer's image
        image.wait_for(timeout=60_000)
        assert image.evaluate("img => img.naturalWidth") > 500
        page.screenshot(path=SHOTS / "artifact_plot.png")
        browser.close()
