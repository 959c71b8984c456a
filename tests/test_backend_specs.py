"""Each capture backend is declared once (pipeline/backend_specs.py): what validates a config, names
a run, puts the backend on the graphs and tells the profile what it sees reads the spec, so a
backend registered once is known everywhere, and no module outside backends/ tests a backend's
name."""

from __future__ import annotations

import io
import tokenize

import pytest
import torch
from conftest import REPO_ROOT, compose_cfg

from pipeline import backend_specs
from pipeline.backend_specs import SPECS, BackendSpec
from pipeline.backends import install
from pipeline.config import PipelineConfig, resolve_backend, validate
from pipeline.errors import ConfigError
from pipeline.run_identity import run_name

# An experiment's own list of backends to time (the bench's rows) may name them; nothing decides by them
NAMES_ALLOWED = ("pipeline/backend_specs.py", "pipeline/bench/")


def test_no_backend_is_told_by_its_name_outside_its_spec():
    quoted = {f'"{name}"' for name in SPECS} | {f"'{name}'" for name in SPECS}
    found = []
    for path in sorted((REPO_ROOT / "pipeline").rglob("*.py")):
        relative = str(path.relative_to(REPO_ROOT))
        if relative.startswith(NAMES_ALLOWED):
            continue
        for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if token.type == tokenize.STRING and token.string in quoted:
                found.append(f"{relative}:{token.start[0]} {token.string}")
    assert not found, found


@pytest.fixture
def registered(monkeypatch) -> BackendSpec:
    """A backend that only compiles, registered by its spec alone."""
    new = BackendSpec(
        "torch-inductor-only", "inductor", "ind", compiles=True, replays=False, cuda_only=False,
        sees="Inductor's kernels",
    )  # fmt: skip
    monkeypatch.setitem(SPECS, new.name, new)
    return new


def test_a_backend_registered_once_is_known_to_config_names_and_install(registered, monkeypatch):
    cfg = compose_cfg([f"backend.name={registered.name}", "capture=partial"])
    validate(cfg, cuda_available=False)
    assert resolve_backend(cfg, on_cuda=False) == registered.name
    assert "inductor" in run_name(cfg, registered.name)
    compiled = []
    monkeypatch.setattr(install, "compile_module", lambda module, name: compiled.append(module))
    target = torch.nn.Linear(2, 2)
    assert install.apply(registered.name, [("lm", target)], cfg.runtime, cfg.backend, on_cuda=False) == {}
    assert compiled == [target]  # compiles, replays nothing: no runner, no cached graph asked for
    with pytest.raises(ConfigError, match="backend.name=torch-nonesuch is not known"):
        validate(compose_cfg(["backend.name=torch-nonesuch"]), cuda_available=False)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_what_each_backend_does_follows_its_spec(name):
    """A CUDA-only backend is refused on CPU, one that replays is refused with capture=none, and
    backend=auto picks the specs the registry names (compiled; replayed on CUDA)."""
    spec = SPECS[name]
    cfg: PipelineConfig = compose_cfg([f"backend.name={name}", "capture=partial"])
    if spec.cuda_only:
        with pytest.raises(ConfigError, match="needs a CUDA device"):
            validate(cfg, cuda_available=False)
    else:
        validate(cfg, cuda_available=False)
    if spec.replays:
        with pytest.raises(ConfigError, match="capture=none has none"):
            validate(compose_cfg([f"backend.name={name}", "capture=none"]), cuda_available=True)
    auto = compose_cfg(["capture=partial"])
    assert SPECS[resolve_backend(auto, on_cuda=False)].compiles
    chosen = SPECS[resolve_backend(auto, on_cuda=True)]
    assert chosen.compiles and chosen.replays and backend_specs.AUTO_CUDA == chosen.name
