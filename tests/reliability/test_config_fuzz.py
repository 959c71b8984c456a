"""Bad configuration, fuzzed: random override sets from every group and key (wrong types, negative
and huge numbers, unknown names, contradictory combinations). Each one either passes every check
that needs no model, or fails before any model is built with one line that names a key; no other
exception type (a traceback) ever comes out. A sample goes through the real command line too:
exit code 2, one line on stderr, no MLflow store touched."""

from __future__ import annotations

import pytest
from conftest import compose_dict, run_pipeline
from hydra.errors import HydraException
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf.errors import OmegaConfBaseException

from pipeline.__main__ import one_line
from pipeline.errors import ConfigError
from pipeline.jobs import check_config

# 500 drawn configs and whole runs: minutes (CI and `make test-all` run them)
pytestmark = pytest.mark.slow

NUMBERS = st.one_of(
    st.integers(-10, 10), st.integers(-(2**40), 2**40), st.sampled_from(["abc", "1.5", "null", "[]", "-0"])
)
FLOATS = st.one_of(st.floats(-5, 5, allow_nan=False), st.sampled_from(["nan", "inf", "x"]))
GROUPS = {
    "model": [
        "tiny_mistral3",
        "tiny_magistral",
        "tiny_llama3_1_8b",
        "tiny_qwen2_5_vl",
        "tiny_llama4_scout",
        "gpt5",
        "",
    ],
    "capture": ["none", "full", "partial", "half"],
    "backend": ["auto", "torch-simple", "torch-compile", "torch-cudagraph", "torch-opt", "tensorrt"],
    "attention": ["auto", "torch", "triton", "flashinfer", "xformers"],
    "runtime": ["demollm", "vllm"],
    "transforms": ["default", "none", "all"],
}
KEYS = {
    "prompt.batch_size": NUMBERS,
    "prompt.prompt_len": NUMBERS,
    "prompt.output_len": NUMBERS,
    "prompt.image_size": NUMBERS,
    "runtime.max_batch_size": NUMBERS,
    "runtime.max_num_tokens": NUMBERS,
    "runtime.max_seq_len": NUMBERS,
    "runtime.attn_page_size": NUMBERS,
    "runtime.kv_cache_mb": NUMBERS,
    "runtime.world_size": NUMBERS,
    "runtime.sampling.temperature": FLOATS,
    "runtime.sampling.top_p": FLOATS,
    "runtime.sampling.top_k": NUMBERS,
    "profile.decode_steps": NUMBERS,
    "profile.table_depth": NUMBERS,
    "report.top_k": NUMBERS,
    "report.formats": st.sampled_from(["[png]", "[pdf]", "[png,svg]", "[gif]", "png"]),
    "benchmark.iterations": NUMBERS,
    "seed": NUMBERS,
    "dtype": st.sampled_from(["auto", "float32", "bfloat16", "float16", "int8"]),
    "device": st.sampled_from(["auto", "cpu", "cuda", "tpu"]),
    "backend.fallback": st.sampled_from(["eager", "null", "retry"]),
    "backend.cuda_graph_batch_sizes": st.sampled_from(["[1,2]", "[0]", "[100]", "null"]),
    "transforms.fuse_gemms.enabled": st.sampled_from(["true", "false", "maybe"]),
    "transforms.match_rope.scope": st.sampled_from(["subgraph", "model", "everywhere"]),
    "profile.kernel_categories.gemm": st.sampled_from(["mm", "'(unclosed'", "'[a-'"]),
    "prompt.images": st.sampled_from(["[/nonexistent.png]", "['http://example.com/x.png']", "null"]),
    "unknown_key": NUMBERS,
    "prompt.bogus": NUMBERS,
    "+added_key": NUMBERS,
    "+runtime.added": NUMBERS,
    "capture.submodules": st.sampled_from(
        ["[model.language_model]", "[model.language_modle]", "[nope]", "null"]
    ),
}


@st.composite
def override_sets(draw) -> list[str]:
    overrides = []
    for group in draw(st.lists(st.sampled_from(sorted(GROUPS)), max_size=3, unique=True)):
        overrides.append(f"{group}={draw(st.sampled_from(GROUPS[group]))}")
    for key in draw(st.lists(st.sampled_from(sorted(KEYS)), min_size=1, max_size=4, unique=True)):
        overrides.append(f"{key}={draw(KEYS[key])}")
    return overrides


def _outcome(overrides: list[str]) -> str | None:
    """None when every pre-model check passes, else the one-line error a user would see."""
    try:
        cfg = compose_dict(overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        return one_line(exc)
    try:
        check_config(cfg, cuda_available=False)
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(600)  # its runs take 40-60 s on 2 cores
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(override_sets())
def test_every_config_mistake_is_one_line_naming_a_key(overrides):
    message = _outcome(overrides)
    if message is None:
        return
    assert "\n" not in message, message
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    named = any(k in message or k.rsplit(".", 1)[-1] in message for k in keys)
    assert named, (overrides, message)


def test_config_mistakes_on_the_command_line_exit_2_with_one_line(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for i, overrides in enumerate(
        (
            ["prompt.batch_size=-3"],
            ["backend=tensorrt"],
            ["runtime.sampling.top_p=abc"],
            ["profile.kernel_categories.gemm='(unclosed'"],
            ["model=tiny_mistral3", "capture=none", "backend=torch-cudagraph"],
            ["hydra.callbacks.evil._target_=os.system"],
        )
    ):
        proc = run_pipeline([*overrides, f"tracking.uri={uri}"], tmp_path / str(i))
        assert proc.returncode == 2, (overrides, proc.stderr[-1000:])
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("config error:"), (overrides, lines)
        assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.timeout(600)  # its runs take 80-100 s on 2 cores
def test_configs_that_validate_run_on_a_tiny_model(tmp_path):
    """Valid draws from the same groups and keys run end to end (seeded, so the same three every
    run; each is a whole pipeline, so three, not five hundred)."""
    import random

    rng = random.Random(0)
    for i in range(3):
        overrides = [
            f"model={rng.choice([m for m in GROUPS['model'] if m.startswith('tiny_')])}",
            f"capture={rng.choice(['none', 'partial'])}",
            f"backend={rng.choice(['auto', 'torch-simple', 'torch-compile'])}",
            f"attention={rng.choice(['auto', 'torch'])}",
            f"prompt.batch_size={rng.randint(1, 3)}",
            f"prompt.prompt_len={rng.randint(8, 40)}",
            f"prompt.output_len={rng.randint(1, 4)}",
            f"profile.decode_steps={rng.randint(1, 2)}",
            f"seed={rng.randint(0, 1000)}",
        ]
        assert _outcome(overrides) is None, overrides
        # whether each config runs, not where its compiled kernels sit: no profiled variant
        proc = run_pipeline(
            [*overrides, "tracking.enabled=false", "profile.kernel_provenance=false"], tmp_path / str(i)
        )
        assert proc.returncode == 0, (overrides, proc.stderr[-2000:])
