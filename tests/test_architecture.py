"""The layering ARCHITECTURE.md describes: every module imports only from layers below its own (or
its own package), function-level imports included (type-only imports under TYPE_CHECKING are not
imports at run time); and a captured graph's contract lives in its
GraphRecord, not in loose attributes."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO_ROOT

# Lowest first: a module may import from its own package and from any layer before its own.
LAYERS = [
    ["errors", "faults", "devices", "library", "parallel", "backend_specs"],
    ["config"],
    ["kernels"],
    ["ops"],
    ["attention"],
    ["graphs"],
    ["models"],
    ["export"],
    ["transforms"],
    ["backends"],
    ["runtime"],
    ["profiler"],
    ["numerics"],
    ["run_identity"],
    ["tracking"],
    ["state"],
    ["correctness"],
    ["report"],
    ["waterfall"],
    ["launchers"],
    ["sweep"],
    ["stages"],
    ["runner"],
    ["ranks"],
    ["jobs"],
    ["__main__", "bench", "tools"],
]
LEVEL = {unit: i for i, units in enumerate(LAYERS) for unit in units}
PACKAGE = REPO_ROOT / "pipeline"


def _unit(module: str) -> str | None:
    """pipeline.transforms.registry -> transforms; pipeline (the root: REPO_ROOT) -> None."""
    parts = module.split(".")
    return parts[1] if parts[0] == "pipeline" and len(parts) > 1 else None


def _type_only(tree: ast.Module) -> set[ast.AST]:
    """Nodes under `if TYPE_CHECKING:`: annotations only, no import at run time."""
    return {
        inner
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
        for inner in ast.walk(node)
    }


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    skip = _type_only(tree)
    found = []
    for node in ast.walk(tree):
        if node in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            if node.module == "pipeline":  # from pipeline import ops, correctness (not REPO_ROOT)
                found += [(node.lineno, f"pipeline.{a.name}") for a in node.names if a.name in LEVEL]
    return [(line, name) for line, name in found if name.startswith("pipeline")]


def test_every_unit_has_a_layer():
    units = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or p.is_dir()}
    units -= {"__init__", "__pycache__"}
    assert units <= set(LEVEL), sorted(units - set(LEVEL))


def test_no_module_imports_upward():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = _unit("pipeline." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts))
        if own is None or own == "__init__":
            continue
        for line, name in _imports(path):
            other = _unit(name)
            if other is None or other == own:
                continue
            if LEVEL[other] >= LEVEL[own]:
                upward.append(f"{path.relative_to(REPO_ROOT)}:{line} ({own}) imports {name} ({other})")
    assert not upward, "\n".join(upward)


def test_graph_modules_carry_no_loose_pipeline_attributes():
    """What stages pass through a graph (its cache layout, runtime inputs, prefix) is set on its
    GraphRecord: no module assigns those names to a graph module."""
    loose = ("cache_specs", "runtime_inputs", "language_model_prefix")
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr in loose:
                    base = target.value
                    if not (
                        isinstance(base, ast.Call) and getattr(base.func, "id", "") == "record_of"
                    ) and not (isinstance(base, ast.Name) and base.id == "record"):
                        offenders.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
    assert not offenders, offenders


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(("pipeline", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def _all_imports(path: Path) -> set[str]:
    """Every pipeline module a file imports, type-only and function-level imports included; a
    `from package import name` counts the submodule where `name` is one."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in names if name.startswith("pipeline")}


def test_no_import_circle():
    """No module reaches itself through imports, within a package or across (a type-only import
    counts: the circle is in the design either way)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {
        name: {m for m in _all_imports(path) if m in modules and m != name} for name, path in modules.items()
    }
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}
    # a package's __init__ importing its own modules is how a package is assembled, not a circle
    graph = {
        name: {m for m in deps if not (name in packages and m.startswith(name + "."))}
        for name, deps in graph.items()
    }
    circles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "\n".join(circles)


def test_a_job_has_one_maker_the_cli_the_bench_and_the_tests_share():
    """A Job is constructed in jobs.py alone, and the three places that start jobs reach it; a job
    the CLI refuses is refused to the bench and the tests alike (tests/test_config.py)."""
    makers = sorted(
        str(p.relative_to(REPO_ROOT))
        for root in (PACKAGE, REPO_ROOT / "tests")
        for p in root.rglob("*.py")
        if re.search(r"(?<![\w.`])Job\(", p.read_text())
    )
    assert makers == ["pipeline/jobs.py"], makers
    for user in ("pipeline/__main__.py", "pipeline/bench/prepare.py", "tests/conftest.py"):
        assert "checked_job(" in (REPO_ROOT / user).read_text(), user


def test_each_stage_reads_as_a_table_of_contents():
    """No function in pipeline/stages/ is over 50 lines: a stage's run names its steps, and each
    step is a function of its own (or lives in the package that does the work)."""
    long = [
        f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted((PACKAGE / "stages").glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 50
    ]
    assert not long, long
