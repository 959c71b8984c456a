"""Every config group option composes and validates; each bad input is one line, exit 2, no run."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch
import transformers
from conftest import REPO_ROOT, compose_cfg, job_of, mlflow_runs, run_pipeline
from hydra.errors import ConfigCompositionException

from pipeline.backend_specs import SPECS
from pipeline.config import (
    CUDA_ONLY_ATTENTION,
    resolve_attention,
    resolve_backend,
    validate,
)
from pipeline.errors import ConfigError
from pipeline.models import zoo


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (REPO_ROOT / "conf" / group).glob("*.yaml"))


@pytest.mark.parametrize("group", ["model", "runtime", "backend", "attention", "capture"])
def test_every_option_composes_and_validates(group):
    for option in _options(group):
        cfg = compose_cfg([f"{group}={option}"])
        needs_cuda = option in CUDA_ONLY_ATTENTION or (option in SPECS and SPECS[option].cuda_only)
        if option == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
            continue  # validated only where the package is installed (test below)
        if option == "hf":  # reads its config from a folder: tests/test_checkpoints.py
            with pytest.raises(ConfigError, match="set model.checkpoint"):
                validate(cfg, cuda_available=False)
            continue
        validate(cfg, cuda_available=needs_cuda)
        if group == "model":
            hf_config = zoo.build_hf_config(cfg.model)
            cls = zoo.resolve_model_class(cfg.model, hf_config)
            assert issubclass(cls, transformers.PreTrainedModel)
            assert cls.__name__ == (cfg.model.architecture or hf_config.architectures[0]), option


def test_groups_have_the_seed_options():
    assert set(_options("model")) >= {"mistral3", "magistral", "llama3_1_8b", "qwen2_5_vl", "llama4_scout"}
    assert set(_options("backend")) == {
        "auto",
        "torch-simple",
        "torch-compile",
        "torch-cudagraph",
        "torch-opt",
    }
    assert set(_options("attention")) == {"auto", "torch", "flashinfer", "triton"}
    assert set(_options("capture")) == {"none", "full", "partial"}
    cfg = compose_cfg()
    assert (cfg.model.name, cfg.capture.mode, cfg.backend.name, cfg.attention.name) == (
        "mistral3",
        "partial",
        "auto",
        "auto",
    )
    assert cfg.runtime.attn_page_size == 64 and cfg.runtime.max_seq_len == 8192


def test_seed_override_is_deep_merged():
    cfg = compose_cfg(["model=mistral3"])
    hf_config = zoo.build_hf_config(cfg.model)
    assert hf_config.text_config.num_hidden_layers == 2
    assert hf_config.vision_config.num_hidden_layers == 24
    assert hf_config.text_config.hidden_size == 5120
    cfg = compose_cfg(["model=magistral", "model.model_kwargs.num_hidden_layers=3"])
    assert zoo.build_hf_config(cfg.model).num_hidden_layers == 3


@pytest.mark.parametrize(
    ("mode", "cuda", "expected"),
    [("none", False, "torch-simple"), ("partial", False, "torch-compile"), ("full", True, "torch-opt")],
)
def test_auto_backend(mode, cuda, expected):
    cfg = compose_cfg([f"capture={mode}"])
    assert resolve_backend(cfg, on_cuda=cuda) == expected
    assert resolve_attention(cfg.attention.name, on_cuda=False) == "torch"


BAD_OVERRIDES = {
    "cuda backend on cpu": (["backend=torch-cudagraph"], "backend=torch-cudagraph needs a CUDA device"),
    "cuda opt on cpu": (["backend=torch-opt"], "use backend=auto"),
    "cuda attention on cpu": (["attention=triton"], "use attention=auto"),
    "device cuda on cpu": (["device=cuda"], "device=cuda"),
    "prompt too long": (["prompt.prompt_len=5000"], "runtime.max_input_len"),
    "seq too long": (["prompt.prompt_len=4096", "prompt.output_len=4097"], "runtime.max_seq_len"),
    "token budget": (
        ["runtime.max_num_tokens=4"],
        "runtime.max_num_tokens=4 is less than runtime.max_batch_size=8",
    ),
    "page multiple": (["runtime.attn_page_size=48"], "not a multiple of runtime.attn_page_size"),
    "world size": (["runtime.world_size=-1"], "runtime.world_size=-1"),
    "unknown dtype": (["dtype=float64"], "dtype=float64"),
    "negative batch": (["prompt.batch_size=-1"], "prompt.batch_size=-1"),
    "cudagraph without capture": (["capture=none", "backend=torch-cudagraph", "device=auto"], "backend="),
    "misspelt hf key": (["model.model_kwargs.text_config.num_hiden_layers=3"], "num_hiden_layers"),
}


@pytest.mark.parametrize("case", sorted(BAD_OVERRIDES))
def test_bad_input_is_a_config_error(case):
    overrides, expected = BAD_OVERRIDES[case]
    with pytest.raises((ConfigError, ConfigCompositionException)) as info:
        cfg = compose_cfg(overrides)
        validate(cfg, cuda_available=False)
        zoo.build_hf_config(cfg.model)
    assert expected in str(info.value)


def test_misspelt_key_in_a_model_file_is_refused():
    cfg = compose_cfg(["model=tiny_magistral", "+model.hf_config.hiden_size=3"])
    with pytest.raises(ConfigError, match="model.hf_config.hiden_size is not a field of MistralConfig"):
        zoo.build_hf_config(cfg.model)


def test_flashinfer_needs_the_package(monkeypatch):
    """Without the package, attention=flashinfer is refused naming it; with it, it validates."""
    cfg = compose_cfg(["attention=flashinfer"])
    find_spec = importlib.util.find_spec
    for installed in (False, True):
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda name, *a, installed=installed: (
                (object() if installed else None) if name == "flashinfer" else find_spec(name, *a)
            ),
        )
        if installed:
            validate(cfg, cuda_available=True)
        else:
            with pytest.raises(ConfigError, match="flashinfer"):
                validate(cfg, cuda_available=True)


CLI_CASES = {
    "unknown model": (["model=gpt5"], "Could not find 'model/gpt5'", "mistral3"),
    "wrong type": (["prompt.batch_size=abc"], "prompt.batch_size", "Integer"),
    "unknown key": (["foo=1"], "foo", "not in"),
    "added unknown key": (["+foo=1"], "foo is not a config key", "has: model"),
    "added unknown nested key": (
        ["+runtime.max_batch=2"],
        "runtime.max_batch is not a config key",
        "max_batch_size",
    ),
    "unknown submodule": (
        ["capture.submodules=[model.language_modle]"],
        "capture.submodules[0]",
        "model.language_model",
    ),
    "unknown backend option": (["backend=tensorrt"], "backend/tensorrt", "torch-compile"),
    "cuda backend": (["backend=torch-cudagraph"], "backend=torch-cudagraph", "backend=auto"),
    "token budget": (
        ["runtime.max_num_tokens=4"],
        "runtime.max_num_tokens=4",
        "raise runtime.max_num_tokens",
    ),
    "page multiple": (["runtime.max_seq_len=8100"], "runtime.max_seq_len=8100", "attn_page_size"),
    "world size": (["runtime.world_size=4"], "runtime.world_size=4", "num_key_value_heads=2"),
    "stateful layers": (["model=tiny_lfm2_vl", "capture=partial"], "has conv layers", "use capture=none"),
    "image layout": (["prompt.image_layout=hf"], "prompt.image_layout=hf", "family, generic"),
    "transform order": (
        ["transforms=none", "+transforms.fuse_add_rmsnorm={}", "+transforms.match_rmsnorm={}"],
        "match_rmsnorm must run before fuse_add_rmsnorm",
        "put transforms.match_rmsnorm above transforms.fuse_add_rmsnorm",
    ),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_cli_config_mistake_exits_2_with_one_line_and_no_run(case, tmp_path, tracking_uri):
    overrides, *expected = CLI_CASES[case]
    proc = run_pipeline(
        ["model=tiny_mistral3", f"tracking.uri={tracking_uri}", *overrides], tmp_path, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    lines = [
        line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("[transformers]")
    ]
    assert len(lines) == 1 and lines[0].startswith("config error: "), proc.stderr
    for text in expected:
        assert text in lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    _, runs = mlflow_runs(tracking_uri)
    assert runs == []


def test_dry_run_prints_config_and_builds_nothing(tmp_path, tracking_uri):
    proc = run_pipeline(["dry_run=true", f"tracking.uri={tracking_uri}"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "name: mistral3" in proc.stdout and "num_hidden_layers: 2" in proc.stdout
    _, runs = mlflow_runs(tracking_uri)
    assert runs == []


def test_seed_prompt_queries_compose():
    """The seed's mixed query list: plain strings, {prompt: ...} and chat-message lists with images."""
    queries = (
        '[How big is the universe?,{prompt:"Explain gravity: "},'
        "[{role:user,content:[{type:text,text:Describe},{type:image,url:/tmp/x.png}]}]]"
    )
    cfg = compose_cfg([f"prompt.queries={queries}"])
    validate(cfg, cuda_available=False)
    assert cfg.prompt.queries[0] == "How big is the universe?"
    assert cfg.prompt.queries[1]["prompt"] == "Explain gravity: "
    assert cfg.prompt.queries[2][0]["content"][1]["type"] == "image"


def test_cuda_graph_replays_of_cross_attended_images_are_refused_up_front():
    """Mllama's steps take as many vision states as their sequences bring: a backend that replays
    CUDA graphs is refused naming the fix, and backend=auto picks torch-compile for it on CUDA."""
    from pipeline.config import resolve_backend
    from pipeline.jobs import check_replays

    config = compose_cfg(["model=tiny_mllama", "backend=torch-cudagraph", "device=cuda"])
    hf_config = zoo.build_hf_config(config.model)
    with pytest.raises(
        ConfigError, match="backend=torch-cudagraph replays CUDA graphs.*use backend=torch-compile"
    ):
        check_replays(config, hf_config, cuda_available=True)
    auto = compose_cfg(["model=tiny_mllama", "device=cuda"])
    check_replays(auto, hf_config, cuda_available=True)
    assert resolve_backend(auto, True, replays=False) == "torch-compile"
    assert resolve_backend(auto, True) == "torch-opt"


@pytest.mark.parametrize(
    ("name", "attention", "refused"),
    [
        ("tiny_llama4_scout", "flashinfer", "no chunked attention"),
        ("tiny_gemma3", "flashinfer", "no bidirectional attention"),
        ("tiny_paligemma", "flashinfer", "no bidirectional attention"),
        ("tiny_gemma2", "flashinfer", None),  # its window and logit cap flashinfer has
        ("tiny_gemma3", "triton", None),
    ],
)
def test_an_attention_backend_without_what_the_model_needs_is_refused_up_front(name, attention, refused):
    from pipeline.jobs import check_attention_options

    config = compose_cfg([f"model={name}", f"attention={attention}", "device=cuda"])
    hf_config = zoo.build_hf_config(config.model)
    if refused is None:
        check_attention_options(config, hf_config, cuda_available=True)
        return
    with pytest.raises(
        ConfigError, match=f"attention={attention} has {refused}.*use attention=torch or attention=triton"
    ):
        check_attention_options(config, hf_config, cuda_available=True)
    # nothing to refuse where no cached attention is inserted
    off = compose_cfg([f"model={name}", f"attention={attention}", "device=cuda", "capture=none"])
    check_attention_options(off, hf_config, cuda_available=True)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["runtime.tp_weights=shard"], "runtime.world_size=0 is one process"),
        (["model=tiny_mistral3", "capture.submodules=[model.no_such]"], "capture.submodules"),
    ],
)
def test_the_tests_and_the_bench_build_only_jobs_the_cli_runs(tmp_path, overrides, message):
    """One maker of jobs (jobs.checked_job): what the CLI refuses, the tests' staged jobs and the
    bench's prepared ones are refused with the same line, before a model is built."""
    from pipeline.bench.prepare import job as bench_job

    cli = run_pipeline([*overrides, "dry_run=true"], tmp_path / "cli")
    assert cli.returncode == 2 and message in cli.stderr, cli.stderr
    with pytest.raises(ConfigError, match=re.escape(message)):
        job_of(overrides, tmp_path / "test")
    with pytest.raises(ConfigError, match=re.escape(message)):
        bench_job(overrides, torch.float32, torch.device("cpu"), tmp_path / "bench")
