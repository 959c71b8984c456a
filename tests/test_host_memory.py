"""Freed host memory stays in the process (runtime/host_memory.py): a step's large activation,
allocated again after it was freed, lands on pages already touched, where glibc's default maps and
faults in fresh ones every time. Counted in page faults, not timed. And given back between the
jobs of a sweep: the process's resident memory, not its allocator's word."""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import torch
from conftest import build_tiny, compose_cfg

from pipeline.runtime.host_memory import give_back_freed_memory, retain_freed_memory

# a step of an MLP at 1024 tokens: its activations of 64 MiB each (gate, up, silu, product), above
# glibc's largest mmap threshold (32 MiB): 16384 pages of 4 KiB each (PAGES: of this host's size). A single 64 MiB tensor freed
# and allocated again is no test of it: each of its TensorImpls, allocated above the data and kept
# in glibc's tcache when freed, fences the freed block off the heap's top, and posix_memalign's
# 64-byte alignment asks for a little more than the block holds, so the same tensor landed on fresh
# pages for up to 9 times in a row; a step's several activations free neighbours that
# merge after a few steps, as a model's steps do.
FAULTS_OF_STEPS = textwrap.dedent(
    """
    import resource, torch
    x = torch.randn(1024, 256)  # [T, H]
    w_in, w_out = torch.randn(256, 16384) * 0.01, torch.randn(16384, 256) * 0.01
    def step() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        gate, up = x @ w_in, x @ w_in  # [T, I]
        y = (torch.nn.functional.silu(gate) * up) @ w_out  # [T, H]
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    # the first steps fault their pages in, kept or not: with the memory kept, up to 3 did here
    # (the TensorImpls glibc's tcache holds fence freed blocks off until it is full), so 6 more
    later = [step() for _ in range(12)][6:]
    print(max(later) if KEPT else min(later))
    """
)
PAGES = 64 * 2**20 // resource.getpagesize()  # one activation's pages


def allocator_unlike_glibcs_default() -> str:
    """Why page faults here would not count what these tests count, or '': they need glibc's malloc
    with its defaults, mapping a large block in pages of the base size (no huge pages)."""
    if platform.libc_ver()[0] != "glibc":
        return "not glibc's malloc"
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return f"glibc's malloc tuned (GLIBC_TUNABLES={os.environ['GLIBC_TUNABLES']})"
    if os.environ.get("THP_MEM_ALLOC_ENABLE"):
        return "torch asks for transparent huge pages (THP_MEM_ALLOC_ENABLE)"
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[always]" in thp.read_text():
        return "transparent huge pages are always on: a large block faults in 2 MiB at a time"
    return ""


counts_faults = pytest.mark.skipif(
    bool(allocator_unlike_glibcs_default()), reason=allocator_unlike_glibcs_default() or "-"
)


def faults_of_later_steps(kept: bool) -> int:
    """In a fresh process: the most page faults of steps 7-12 where memory is kept, else the fewest."""
    code = (
        (
            "from pipeline.runtime.host_memory import retain_freed_memory\nassert 'kept' in retain_freed_memory()\n"
            if kept
            else ""
        )
        + f"KEPT = {kept}\n"
        + FAULTS_OF_STEPS
    )
    return int(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    )


@pytest.fixture
def retained():
    """glibc retuned for the test, its defaults back after it (the rest of the suite keeps them)."""
    assert "kept" in retain_freed_memory()
    yield
    give_back_freed_memory()


@counts_faults
def test_a_steps_activations_freed_and_allocated_again_fault_in_no_fresh_pages():
    """In a fresh process, as a run keeps its memory from its first step on."""
    faults = faults_of_later_steps(kept=True)
    assert faults < PAGES // 10, f"{faults} page faults in a step of 4 activations of {PAGES} pages"


@counts_faults
def test_the_memory_a_job_kept_goes_back_between_a_sweeps_jobs(retained):
    """A sweep's job allocated its weights while memory was retained: from the heap, where freed
    below a later allocation they stayed resident, and the next job's fit check found them taken.
    give_back_freed_memory (run between a sweep's jobs, pipeline/__main__.py) returns them."""
    rss = psutil.Process().memory_info
    weights = torch.ones(256 * 2**20 // 4)  # 256 MiB from the heap while retained
    later = torch.ones(1024)  # allocated above it: the weights' chunk is not the heap's top
    before = rss().rss
    del weights
    kept = before - rss().rss
    give_back_freed_memory()
    given_back = before - rss().rss
    assert kept < 64 * 2**20, f"{kept / 2**20:.0f} MiB went back without give_back_freed_memory"
    assert given_back > 200 * 2**20, f"only {given_back / 2**20:.0f} MiB of 256 went back"
    assert later.sum() == 1024


@counts_faults
def test_without_it_every_step_faults_in_fresh_pages():
    """The same count with glibc's default: the test above can fail."""
    assert faults_of_later_steps(kept=False) > 2 * PAGES


@pytest.mark.parametrize("retain", [True, False])
def test_demollm_on_cpu_keeps_freed_memory_unless_told_not_to(monkeypatch, retain):
    import pipeline.runtime.engine as engine

    calls = []
    monkeypatch.setattr(engine, "retain_freed_memory", lambda: calls.append(1))
    model, hf_config, _ = build_tiny("tiny_llama3_1_8b")
    cfg = compose_cfg(["model=tiny_llama3_1_8b", f"runtime.retain_host_memory={str(retain).lower()}"])
    engine.DemoLLM(model, hf_config, cfg.runtime, torch.device("cpu"), set())
    assert calls == ([1] if retain else [])


@pytest.mark.parametrize("fails", [False, True])
def test_a_sweeps_job_gives_the_kept_memory_back_however_it_ends(monkeypatch, fails):
    """pipeline/__main__.job, as a sweep runs each job in one process: the host memory the job
    kept goes back before the next job's memory check, whether the job finished or failed."""
    import pipeline.__main__ as main

    def job_body(cfg):
        retain_freed_memory()
        if fails:
            raise RuntimeError("a stage failed")

    given_back = []
    monkeypatch.setattr(main, "_multirun", lambda: True)
    monkeypatch.setattr(main, "_job", job_body)
    monkeypatch.setattr(main, "_record_failure", lambda cfg, exc: None)
    monkeypatch.setattr(main, "free_memory", lambda: None)
    monkeypatch.setattr(main, "give_back_freed_memory", lambda: given_back.append(give_back_freed_memory()))
    main.job(None)
    assert given_back == [True]


@counts_faults
def test_the_load_bench_loads_on_the_pages_its_touch_faulted_in():
    """bench/load.py touches a model's bytes in one block and frees it into a heap that keeps all
    of it (above the 2 GiB a retaining run keeps); the parameters allocated after land there. In a
    fresh process, as the bench runs it: in this one, earlier tests' trimmed heap holds free chunks
    without pages, where the parameters may land instead."""
    code = textwrap.dedent(
        """
        import resource, torch
        from pipeline.bench.load import touch_and_keep
        from pipeline.models.build import first_touch
        touch_and_keep(128 * 2**20, torch.device("cpu"))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        params = [first_touch(torch.Size([1024, 1024]), torch.float32, torch.device("cpu")) for _ in range(24)]
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        """
    )
    faults = int(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    )
    assert faults < PAGES // 10, f"{faults} page faults for 96 MiB of parameters"
