"""The MLflow UI in a real headless browser: a small real sweep in a temporary store, the parent
and its children in the runs table, two runs compared, a run's breakdown plot among its
artifacts; a two-rank tensor-parallel run's per-rank metrics and artifacts. Screenshots go to outputs/browser/ (.ci/run installs Debian's chromium when missing)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import REPO_ROOT, mlflow_runs, mlflow_server, run_pipeline, sweep_parent

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


def _names_fit(page, names: list[str]) -> dict[str, tuple[int, int]]:
    """name -> (text width, cell width) in the runs table, for names the table cuts."""
    cut = {}
    for name in names:
        link = page.get_by_text(name, exact=True).first
        scroll, client = link.evaluate("e => [e.scrollWidth, e.clientWidth]")
        if scroll > client:
            cut[name] = (scroll, client)
    return cut


# The sweep's eight children: two models (a text model whose name is long, a VLM) x waterfall x
# piecewise; `llama3_1_8b·no-w·no-p` would not fit a child's 98 px, so a switch that is off is left out
CHILDREN = [f"{m}{w}{p}" for m in ("llama3_1_8b", "llava") for w in ("·w", "") for p in ("·p", "")]


@pytest.mark.timeout(1800)  # eight compiled jobs, four with a waterfall: ~2.5 min here, x3 for a slow host
def test_sweep_in_the_ui_names_charts_tables_and_compare(tmp_path, tracking_uri, ui_server):
    """A sweep over model x profile.waterfall x backend.piecewise, as a user opens it: names
    unique and whole in the runs table at 1600 and 1280 px, the table filtered by a swept override
    and grouped by each swept key, each run's breakdown image in the chart view, the waterfall's
    steps in one chart section, the module table of two children side by side in the artifact
    compare view, the compare page without a params dump and with a text model's and a VLM's graph
    metrics on one row."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not shutil.which("chromium") and not Path(CHROMIUM).exists():
        pytest.skip("chromium is not installed (.ci/run installs it)")
    sweep = [
        "model=tiny_llama3_1_8b,tiny_llava",
        "profile.waterfall=true,false",
        "backend.piecewise=true,false",
    ]
    common = [
        "capture=partial",
        "backend=torch-compile",
        "prompt.prompt_len=32",
        "prompt.output_len=4",
        "profile.decode_steps=2",
        "profile.waterfall_rounds=2",
        "profile.kernel_provenance=false",  # one compile per graph: the UI is what is checked here
        f"tracking.uri={tracking_uri}",
    ]
    proc = run_pipeline(["-m", *sweep, *common], tmp_path / "sweep", timeout=1500)
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, runs = mlflow_runs(tracking_uri)
    parent = sweep_parent(runs)
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    names = [r.info.run_name for r in runs]
    assert sorted(names) == sorted(["sweep·model×w×p", *CHILDREN])
    assert parent.data.metrics["sweep/jobs"] == 8 and parent.data.metrics["sweep/failed"] == 0
    assert parent.data.params["sweep.model"] == "tiny_llama3_1_8b,tiny_llava"
    experiment = parent.info.experiment_id
    SHOTS.mkdir(parents=True, exist_ok=True)

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        # Every action waits up to a minute (Playwright's default is 30 s): beside the other test
        # worker's compiles, the chart view's search box took longer than 30 s to appear once here.
        page.set_default_timeout(60_000)
        runs_view = f"{ui_server}/#/experiments/{experiment}/runs?workflowType=machine_learning"
        page.goto(runs_view)
        page.get_by_text(parent.info.run_name).first.wait_for(timeout=60_000)
        close_assistant(page)
        # Children are folded under their parent: expand it, then every child is listed.
        page.locator("button[data-component-id*='runnamecellrenderer']").first.click()
        for child in children:
            page.get_by_text(child.info.run_name, exact=True).first.wait_for(timeout=30_000)
        assert _names_fit(page, names) == {}
        page.set_viewport_size({"width": 1280, "height": 1000})  # a laptop's width: still whole
        page.wait_for_timeout(1000)
        assert _names_fit(page, names) == {}
        page.screenshot(path=SHOTS / "runs.png")
        page.set_viewport_size({"width": 1600, "height": 1000})
        # Each override is a param under its full key: the table filters by a swept one
        search = page.get_by_placeholder('metrics.rmse < 1 and params.model = "tree"')
        search.fill("params.`profile.waterfall` = 'True'")
        search.press("Enter")
        page.get_by_text("llava·w·p", exact=True).first.wait_for(timeout=30_000)
        page.get_by_text("llava·p", exact=True).first.wait_for(state="detached", timeout=30_000)
        page.screenshot(path=SHOTS / "runs_filtered.png")
        search.fill("")  # the views below keep the table's search: clear it
        search.press("Enter")
        page.get_by_text("llava·p", exact=True).first.wait_for(timeout=30_000)

        # Chart view: each run's module breakdown image (its card expanded: MLflow 3.17 centres
        # the thumbnail in a square as wide as the chart area, below a small card's fold).
        page.goto(f"{runs_view}&compareRunsMode=CHART")
        page.get_by_placeholder("Search metric charts").fill("breakdown_module_breakdown")
        title = page.get_by_text("breakdown_module_breakdown", exact=True).first
        title.wait_for(timeout=60_000)
        box = title.bounding_box()
        expand = [
            b for b in page.locator("button").all()
            if (bb := b.bounding_box()) and abs(bb["y"] - box["y"]) < 20 and bb["x"] > box["x"]
        ]  # fmt: skip
        expand[0].click()
        modal = page.get_by_role("dialog")
        images = modal.locator("img[src*='breakdown_module_breakdown']")
        images.first.wait_for(timeout=60_000)
        images.nth(len(children) - 1).wait_for(timeout=60_000)  # the modal adds them one by one
        shown = set()
        for i in range(images.count()):
            image = images.nth(i)
            image.scroll_into_view_if_needed()
            assert _image_loads(page, image, min_width=100), i
            shown.add(image.evaluate("e => new URL(e.src).searchParams.get('run_uuid')"))

        child_ids = {c.info.run_id for c in children}
        assert child_ids <= shown
        images.first.scroll_into_view_if_needed()
        images.first.click()  # the thumbnail opens the full-size plot
        full = page.locator(".rc-image-preview img").first
        full.wait_for(timeout=30_000)
        assert _image_loads(page, full, min_width=1000)
        page.screenshot(path=SHOTS / "chart_view.png")

        # The per-part times of both sides (profile stage, layers/*), each a chart of every run
        page.goto(f"{runs_view}&compareRunsMode=CHART")
        page.get_by_placeholder("Search metric charts").fill("mlp_ms")
        for metric in ("layers/decode/mlp_ms", "layers/decode_eager/mlp_ms"):
            page.get_by_text(metric, exact=True).first.wait_for(timeout=60_000)
        page.screenshot(path=SHOTS / "chart_view_layers.png")

        # The waterfall: one chart section per phase, a chart per step in the steps' order
        page.get_by_placeholder("Search metric charts").fill("waterfall/decode")
        page.get_by_text("waterfall/decode/00_eager_ms", exact=True).first.wait_for(timeout=60_000)
        steps = {k for r in children for k in r.data.metrics if k.startswith("waterfall/decode/")}
        assert {"waterfall/decode/00_eager_ms", "waterfall/decode/01_graph_and_cache_saved_ms"} <= steps
        section = page.get_by_text(re.compile(rf"^waterfall/decode\s*\({len(steps)}\)$"))
        assert (
            section.count() >= 1
            and page.get_by_text(re.compile(r"^waterfall/decode/\d\d_\w+ \(")).count() == 0
        )
        page.wait_for_timeout(2000)
        page.screenshot(path=SHOTS / "chart_view_waterfall.png", full_page=True)

        # Artifact compare: the module tables (log_table) of one model's two capture modes.
        compare_module_tables(
            page,
            runs_view,
            parent.info.run_name,
            "params.model = 'tiny_llama3_1_8b' and params.`profile.waterfall` = 'False'",
            ["llama3_1_8b·p", "llama3_1_8b"],
        )
        page.set_viewport_size({"width": 2200, "height": 1000})  # both runs' columns in the picture
        page.wait_for_timeout(1500)
        page.screenshot(path=SHOTS / "table_compare.png")
        page.set_viewport_size({"width": 1600, "height": 1000})

        # The compare page: metrics side by side, params a person compares (no hf_config dump).
        ids = json.dumps([c.info.run_id for c in children])
        page.goto(f"{ui_server}/#/compare-runs?runs={ids}&experiments={json.dumps([experiment])}")
        page.get_by_text("Run details").first.wait_for(timeout=60_000)
        for child in children:
            assert page.get_by_text(child.info.run_name).count() > 0
        assert page.get_by_text("hf_config").count() == 0
        # a text model's graph and a VLM's language model share their metrics' names: one row (no
        # child logs it by the graph's path)
        assert _scrolled_to(page, "graph/language_model/nodes")  # the rows are in name order
        assert page.get_by_text("graph/language_model/nodes", exact=True).count() == 1
        assert _scrolled_to(page, "latency/decode_ms")
        assert not any("graph/model.language_model/nodes" in c.data.metrics for c in children)
        page.screenshot(path=SHOTS / "compare.png", full_page=True)

        run_id = next(c.info.run_id for c in children if c.info.run_name == "llava·p")
        page.goto(
            f"{ui_server}/#/experiments/{experiment}/runs/{run_id}/artifacts/plots/module_breakdown.png"
        )
        image = page.locator("img[src^='blob:']").first  # the artifact viewer's image
        image.wait_for(timeout=60_000)
        assert _image_loads(page, image, min_width=500)
        page.screenshot(path=SHOTS / "artifact_plot.png")

        # The runs table grouped by each swept key in turn (MLflow adds each to the grouping), the
        # artifact view's search cleared
        page.goto(runs_view)
        page.get_by_text(parent.info.run_name).first.wait_for(timeout=60_000)
        close_assistant(page)
        search = page.get_by_placeholder('metrics.rmse < 1 and params.model = "tree"')
        search.fill("")
        search.press("Enter")
        page.get_by_text("9 matching runs").wait_for(timeout=30_000)
        expected = [  # group label -> runs in it, after each key is added
            {"False": 4, "True": 4},
            {f"profile.waterfall: {w}, backend.piecewise: {p}": 2 for w in ("False", "True") for p in ("False", "True")},
            {f"profile.waterfall: {w}, backend.piecewise: {p}, model: {m}": 1
             for w in ("False", "True") for p in ("False", "True") for m in ("tiny_llama3_1_8b", "tiny_llava")},
        ]  # fmt: skip
        for key, groups in zip(("profile.waterfall", "backend.piecewise", "model"), expected, strict=True):
            assert _grouped_by(page, key) == groups, key
            page.screenshot(path=SHOTS / f"runs_grouped_{key.rsplit('.', 1)[-1]}.png")
        assert _names_fit(page, CHILDREN) == {}
        browser.close()


def _grouped_by(page, key: str) -> dict[str, int]:
    """Add the param `key` to the runs table's grouping; each group's label -> its number of runs
    (the sweep's parent, without the param, is MLflow's "Additional runs")."""
    page.get_by_text("Group by").first.click()
    page.get_by_placeholder("Search").last.fill(key)
    page.get_by_role("menuitemcheckbox", name=key, exact=True).last.click()  # params come after tags
    page.keyboard.press("Escape")
    rows = page.locator("[role=row]").filter(has_text="Group: ")
    rows.first.wait_for(timeout=30_000)
    page.wait_for_timeout(1500)
    groups = {}
    for text in rows.all_inner_texts():
        label, count = re.search(r"Group: (.+?)\s+(\d+)\s", text + " ").groups()
        groups[label.strip()] = int(count)
    return groups


# The compare page's tables are virtualised (React Virtualized): a row is in the page only while
# it is scrolled into its table's 300 px window
_SCROLL_TABLES = """(step) => {
    const grids = [...document.querySelectorAll('.ReactVirtualized__Grid')];
    for (const grid of grids.filter(g => g.scrollHeight > g.clientHeight)) {
        grid.scrollTop += step;
        grid.dispatchEvent(new Event('scroll'));
    }
}"""


def _scrolled_to(page, text: str, steps: int = 200) -> bool:
    """Whether a row reading `text` appears while the compare page's tables scroll down (the page
    scrolled first: the tables render once in view)."""
    page.mouse.wheel(0, 3000)
    for _ in range(steps):
        if page.get_by_text(text, exact=True).count():
            return True
        page.evaluate(_SCROLL_TABLES, 250)
        page.wait_for_timeout(150)
    return False


def _image_loads(page, image, min_width: int, timeout_ms: int = 60_000) -> bool:
    """Whether `image` finishes loading at least `min_width` pixels wide within the timeout. An
    <img> is visible before its bytes arrive: the full-size preview once read complete=false right
    after it appeared (CI, beside the other test worker), so the check waits for the load."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(
            "([e, w]) => e.complete && e.naturalWidth > w",
            arg=[image.element_handle(), min_width],
            timeout=timeout_ms,
        )
    except PlaywrightTimeout:
        state = image.evaluate("e => [e.complete, e.naturalWidth, e.src.slice(0, 120)]")
        print(f"image not loaded after {timeout_ms} ms: [complete, naturalWidth, src] = {state}")
        return False
    return True


def close_assistant(page) -> None:
    """MLflow 3.17 opens an assistant panel beside the runs; it takes a third of the width."""
    close = page.get_by_role("button", name="Close")
    if close.count():
        close.last.click()


def _select(page, opener: str, wanted: set[str]) -> None:
    """Open the dropdown whose button starts with `opener` and leave exactly `wanted` selected."""
    page.get_by_text(opener).first.click()
    options = page.get_by_role("option")
    options.first.wait_for(timeout=30_000)
    labels = [o.inner_text().strip() for o in options.all()]
    assert wanted <= set(labels), (opener, labels)
    # wanted ones first: the last selected entry cannot be unselected
    for label in sorted(labels, key=lambda x: x not in wanted):
        option = page.get_by_role("option", name=label, exact=True).first
        if (label in wanted) != (option.get_attribute("aria-selected") == "true"):
            option.click()
    page.keyboard.press("Escape")


def compare_module_tables(
    page, runs_view: str, parent_name: str, search_for: str, children: list[str]
) -> None:
    """The artifact compare view on the runs a search finds: their module table, rows phase x module,
    device ms per run side by side (the engine's `demollm.step_inputs` among them: every run has it, a
    compiled graph without kernel provenance has no lm_head row)."""
    page.goto(f"{runs_view}&compareRunsMode=ARTIFACT")
    page.get_by_text(parent_name).first.wait_for(timeout=60_000)
    close_assistant(page)
    search = page.get_by_placeholder('metrics.rmse < 1 and params.model = "tree"')
    search.fill(search_for)
    search.press("Enter")
    page.get_by_text(f"{len(children) + 1} matching runs").wait_for(timeout=30_000)  # and the parent
    if page.get_by_role("link", name=children[0], exact=True).count() == 0:  # folded under the parent
        page.locator("button[data-component-id*='runnamecellrenderer']").first.click()
    page.get_by_role("link", name=children[-1], exact=True).first.wait_for(timeout=30_000)
    _select(page, "Table:", {"tables/module_breakdown.json"})
    _select(page, "Group by:", {"phase", "module"})
    _select(page, "Compare:", {"device_ms"})
    page.get_by_text("demollm.step_inputs", exact=True).first.wait_for(timeout=30_000)
    for child in children:  # in the runs list and as a column of the table
        assert page.get_by_role("link", name=child, exact=True).count() >= 2


def test_a_two_rank_run_in_the_ui_shows_each_ranks_artifacts(tmp_path, tracking_uri, ui_server):
    """A tensor-parallel job as a user opens it (issue 24): one run in the table, its per-rank
    metrics on the run page, rank 1's folder and each rank's trace among the artifacts, rank 1's
    summary readable there, and the report's section comparing the ranks."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not shutil.which("chromium") and not Path(CHROMIUM).exists():
        pytest.skip("chromium is not installed (.ci/run installs it)")
    proc = run_pipeline(
        [
            "model=tiny_llama3_1_8b",
            "capture=partial",
            "backend=torch-simple",
            "prompt.output_len=4",
            "profile.decode_steps=2",
            "runtime.world_size=2",
            f"tracking.uri={tracking_uri}",
        ],
        tmp_path / "two",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, runs = mlflow_runs(tracking_uri)
    assert len(runs) == 1  # one run per job, never one per rank
    run = runs[0]
    run_page = f"{ui_server}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    SHOTS.mkdir(parents=True, exist_ok=True)

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        # Every action waits up to a minute (Playwright's default is 30 s): beside the other test
        # worker's compiles, the chart view's search box took longer than 30 s to appear once here.
        page.set_default_timeout(60_000)
        page.goto(f"{ui_server}/#/experiments/{run.info.experiment_id}/runs?workflowType=machine_learning")
        page.get_by_text(run.info.run_name, exact=True).first.wait_for(timeout=60_000)
        close_assistant(page)
        assert _names_fit(page, [run.info.run_name]) == {}

        # The run page: the communication share of the job and of each rank among its metrics.
        page.goto(run_page)
        for metric in ("profile/comm_pct", "ranks/rank0_comm_pct", "ranks/rank1_comm_pct"):
            page.get_by_text(metric, exact=True).first.wait_for(timeout=60_000)
        close_assistant(page)
        page.screenshot(path=SHOTS / "ranks_run.png", full_page=True)

        # Rank 1's summary in the artifact viewer, beside the rank's folder in the tree.
        page.goto(f"{run_page}/artifacts/rank1/summary.json")
        page.get_by_text("failed_stage").first.wait_for(timeout=60_000)  # the summary's text, shown
        for folder in ("rank1", "traces", "report"):
            assert page.get_by_text(folder, exact=True).count() > 0, folder
        page.screenshot(path=SHOTS / "ranks_artifacts.png")

        # Each rank's decode trace, listed under the step's folder as a user unfolds it in the tree.
        page.get_by_text("traces", exact=True).first.click()
        page.get_by_text("decode_1", exact=True).first.click()
        for trace in ("rank0.json", "rank1.json"):
            page.get_by_text(trace, exact=True).first.wait_for(timeout=60_000)

        # The report (HTML, shown in the viewer's frame): its section comparing the ranks.
        page.get_by_text("report", exact=True).first.click()
        page.get_by_text("report.html", exact=True).first.click()
        page.frame_locator("iframe").first.get_by_text("Tensor-parallel ranks (2)").wait_for(timeout=60_000)
        page.screenshot(path=SHOTS / "ranks_report.png", full_page=True)
        browser.close()
