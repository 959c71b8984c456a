"""Freed host memory stays in the process (runtime/host_memory.py): a step's large activation,
allocated again after it was freed, lands on pages already touched, where glibc's default maps and
faults in fresh ones every time. Counted in page faults, not timed. And given back between the
jobs of a sweep: the process's resident memory, not its allocator's word."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import psutil
import pytest
import torch
from conftest import build_tiny, compose_cfg

from pipeline.runtime.host_memory import give_back_freed_memory, retain_freed_memory

# one activation of 64 MiB, above glibc's largest mmap threshold (32 MiB): 16384 pages of 4 KiB
FAULTS_OF_AN_ACTIVATION = textwrap.dedent(
    """
    import resource, torch
    def faults() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(64 * 2**20 // 4)  # allocated, written, freed
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    faults()  # the first one faults in the pages, kept or not
    """
)
PAGES = 64 * 2**20 // 4096


@pytest.fixture
def retained():
    """glibc retuned for the test, its defaults back after it (the rest of the suite keeps them)."""
    assert "kept" in retain_freed_memory()
    yield
    give_back_freed_memory()


def test_an_activation_freed_and_allocated_again_faults_in_no_fresh_pages(retained):
    namespace: dict = {}
    exec(FAULTS_OF_AN_ACTIVATION, namespace)
    # the fewest of three: a test process's other threads may fault pages of their own meanwhile
    faults = min(namespace["faults"]() for _ in range(3))
    assert faults < PAGES // 10, f"{faults} page faults for an activation of {PAGES} pages"


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


def test_without_it_every_activation_faults_in_fresh_pages():
    """The same count in a fresh process with glibc's default: the test above can fail."""
    code = FAULTS_OF_AN_ACTIVATION + "print(faults())"
    faults = int(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    )
    assert faults > PAGES // 2


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
