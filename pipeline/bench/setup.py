"""`python -m pipeline.bench.setup [--torch SPEC ...] [--output FILE]`

`make setup` as a new user pays it: the committed HEAD cloned into an empty folder, then `make
setup` there, timed, once per torch choice (`TORCH=...`), the venv's size on disk after it. pip's
own cache and the wheels on this machine's disk serve every choice alike. Saved in
BENCHMARKS.setup.json; BENCHMARKS.md shows it (`python -m pipeline.bench --render`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from pipeline import REPO_ROOT
from pipeline.bench.machine import machine

RESULTS = REPO_ROOT / "BENCHMARKS.setup.json"
# The Makefile's default first (its TORCH), then the CPU build alone
CHOICES = ("torch==2.14.1 torchvision==0.29.1", "torch==2.13.0")


def _size_gb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink()) / 1e9


def timed_setup(torch_spec: str) -> dict:
    """One `make setup TORCH=torch_spec` in a fresh clone of HEAD: seconds and the venv's GB."""
    with tempfile.TemporaryDirectory(prefix="pipeline-setup-") as root:
        clone = Path(root) / "clone"
        subprocess.run(["git", "clone", "-q", str(REPO_ROOT), str(clone)], check=True)
        start = time.perf_counter()
        proc = subprocess.run(
            ["make", "setup", f"TORCH={torch_spec}"], cwd=clone, capture_output=True, text=True
        )
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"make setup TORCH={torch_spec} failed:\n{proc.stderr[-2000:]}")
        venv_gb = _size_gb(clone / ".venv")
        shutil.rmtree(clone)
    return {"torch": torch_spec, "seconds": round(seconds, 1), "venv_gb": round(venv_gb, 2)}


def markdown(result: dict) -> str:
    lines = [
        "## Set-up",
        "",
        f"`make setup` in a fresh clone of {result['commit']}, recorded {result['date']} on "
        f"{result['machine']['cpu']} ({result['machine']['cores']} threads) with `python -m "
        f"pipeline.bench.setup` (saved in {RESULTS.name}); once per torch choice, pip's cache and the "
        "wheels on the machine's disk serving each alike. Target: under 5 minutes for the default.",
        "",
        "| `TORCH=` | set-up | venv on disk |",
        "|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(f"| `{row['torch']}` | {row['seconds']:.0f} s | {row['venv_gb']:.1f} GB |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", action="append", help=f"a TORCH choice (repeatable); default: {CHOICES}")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    rows = [timed_setup(spec) for spec in args.torch or CHOICES]
    result = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "machine": machine(), "rows": rows}
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
