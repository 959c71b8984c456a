"""Run names and the params runs are compared by (pipeline/run_identity.py)."""

from __future__ import annotations

import torch
from conftest import compose_cfg

from pipeline import run_identity as ri
from pipeline.sweep import fixed_overrides, job_values, swept
from pipeline.tracking import flatten_params
from pipeline.transforms.registry import TransformHistory, TransformRecord


def test_single_run_names_fit_the_runs_table_in_one_style():
    for model in ("mistral3", "llama4_scout", "qwen2_5_vl", "tiny_llama4_scout", "tiny_paligemma"):
        for capture in ("partial", "full", "none"):
            for backend in ("torch-simple", "torch-compile", "torch-cudagraph", "torch-opt"):
                cfg = compose_cfg([f"model={model}", f"capture={capture}"])
                name = ri.run_name(cfg, backend)
                # a name that cannot fit is one whose model name alone takes most of the column
                assert ri.text_px(name) <= ri.TOP_LEVEL_PX or ri.text_px(model) > 80, name
                assert name.startswith(f"{model}·")
                assert name.count("·") == (1 if capture == "none" else 2), name
    assert ri.run_name(compose_cfg(["model=mistral3"]), "torch-simple") == "mistral3·partial·simple"
    # one word shorter at a time: capture first, then the backend
    assert ri.run_name(compose_cfg(["model=mistral3"]), "torch-compile") == "mistral3·part·compile"
    assert ri.run_name(compose_cfg(["model=tiny_llava"]), "torch-compile") == "tiny_llava·part·compile"
    assert ri.run_name(compose_cfg(["model=llama4_scout"]), "torch-cudagraph") == "llama4_scout·part·cg"
    assert (
        ri.run_name(compose_cfg(["model=qwen2_5_vl", "capture=none"]), "torch-simple") == "qwen2_5_vl·eager"
    )
    # a switch on is said: a piecewise run is not named like a plain one
    piecewise = compose_cfg(["model=mistral3", "backend.piecewise=true"])
    assert ri.run_name(piecewise, "torch-simple") == "mistral3·part·fx·p"  # `piecewise` does not fit
    assert ri.run_name(compose_cfg(["model=tiny_mistral3", "backend.piecewise=true"]), "torch-compile") == (
        "tiny_mistral3·part·tc·p"
    )


def test_child_names_are_the_swept_values_without_their_shared_prefix():
    overrides = ["model=tiny_qwen3,tiny_gemma2", "capture=none,partial", "prompt.output_len=4",
                 "prompt.batch_size=1,4"]  # fmt: skip
    keys = swept(overrides)
    assert keys == {"model": ["tiny_qwen3", "tiny_gemma2"], "capture": ["none", "partial"],
                    "prompt.batch_size": ["1", "4"]}  # fmt: skip
    assert fixed_overrides(overrides) == ["prompt.output_len=4"]
    job = ["model=tiny_qwen3", "capture=partial", "prompt.output_len=4", "prompt.batch_size=4"]
    values = job_values(job, list(keys))
    assert values == {"model": "tiny_qwen3", "capture": "partial", "prompt.batch_size": "4"}
    name = ri.child_name(list(values.items()), keys)
    assert name == "qwen3·part·bs=4" and ri.text_px(name) <= ri.NESTED_PX
    assert ri.child_name([("model", "tiny_qwen3"), ("capture", "none")], keys) == "qwen3·eager"
    # one model swept: nothing to leave out
    assert ri.child_name([("model", "mistral3")], {"model": ["mistral3"]}) == "mistral3"
    assert swept(["seed=range(3)"]) == {"seed": ["0", "1", "2"]}
    assert ri.parent_name(keys) == "sweep·model×capture×bs"  # `batch_size` would not fit 122 px
    assert ri.parent_name({"model": [], "seed": []}) == "sweep·model×seed"
    # switches by their name, on or off; every job of a sweep shortened alike, so they read as a set
    keys = swept(["profile.waterfall=true,false"])
    switch = [ri.child_name([("profile.waterfall", w)], keys) for w in ("true", "false")]
    assert switch == ["waterfall", "no-waterfall"]
    keys = swept(["model=tiny_mistral3,tiny_llama3_1_8b", "profile.waterfall=true,false"])
    names = [
        ri.child_name([("model", m), ("profile.waterfall", w)], keys)
        for m in keys["model"]
        for w in ("true", "false")
    ]
    # `llama3_1_8b·no-w` is 98.06 px, past a child's 98: a switch that is off is left out
    assert names == ["mistral3·w", "mistral3", "llama3_1_8b·w", "llama3_1_8b"]
    keys = swept(["model=tiny_mistral3,tiny_llama3_1_8b", "profile.waterfall=true,false",
                  "backend.piecewise=true,false"])  # fmt: skip
    names = [
        ri.child_name([("model", m), ("profile.waterfall", w), ("backend.piecewise", p)], keys)
        for m in keys["model"]
        for w in ("true", "false")
        for p in ("true", "false")
    ]
    assert names[:4] == ["mistral3·w·p", "mistral3·w", "mistral3·p", "mistral3"]
    assert len(set(names)) == 8 and all(ri.text_px(n) <= ri.NESTED_PX for n in names)
    # names that do not fit stay distinct: no switch left out where two switches share an initial
    keys = {"profile.waterfall": ["true", "false"], "a.warm": ["true", "false"],
            "prompt.output_len": ["1000000001000000001"]}  # fmt: skip
    names = {ri.child_name([("profile.waterfall", w), ("a.warm", v), ("prompt.output_len", "1000000001000000001")],
                           keys) for w in ("true", "false") for v in ("true", "false")}  # fmt: skip
    assert len(names) == 4 and "w·no-w·ol=1000000001000000001" in names


def test_names_are_made_unique():
    assert ri.unique("a·b", set()) == "a·b"
    assert ri.unique("a·b", {"a·b"}) == "a·b·2"
    assert ri.unique("a·b", {"a·b", "a·b·2"}) == "a·b·3"


def test_compared_params_are_few_and_say_what_ran():
    overrides = ["model=tiny_llava", "backend.piecewise=true", "tracking.uri=sqlite:////tmp/x/mlflow.db",
                 "+model.checkpoint=/data/ckpts/my_llava/", "hydra.run.dir=/tmp/run"]  # fmt: skip
    cfg = compose_cfg(
        ["model=tiny_llava", "backend.piecewise=true", "model.checkpoint=/data/ckpts/my_llava/"]
    )
    params = ri.compared_params(
        cfg, backend="torch-compile", attention="torch", dtype=torch.float32, device=torch.device("cpu"),
        text_layers=2, overrides=overrides, flat=flatten_params(cfg),
    )  # fmt: skip
    assert 14 <= len(params) <= 20
    assert params["backend"] == "auto" and params["backend_resolved"] == "torch-compile"
    # each choice its own param under its full key, resolved; where runs are stored is none
    assert params["backend.piecewise"] == "True" and params["model.checkpoint"] == "my_llava"
    assert not any(k.startswith(("tracking", "hydra")) or "/" in v for k, v in params.items()), params
    assert params["overrides"] == "model=tiny_llava backend.piecewise=true model.checkpoint=my_llava"
    assert all(len(v) < 500 and not v.startswith("[") for v in params.values())
    assert ri.description(params).startswith("tiny_llava (2 text layers, float32, cpu), capture=partial")


def test_the_transforms_param_lists_what_ran_in_order():
    history = TransformHistory(
        [
            TransformRecord("match_attention", "lm", "applied", matches=2),
            TransformRecord("fuse_gemms", "lm", "applied", matches=0),
            TransformRecord("split_piecewise", "lm", "applied", matches=1),
            TransformRecord("match_attention", "vision", "applied", matches=1),
            TransformRecord("onednn_linear", "model", "disabled"),
        ]
    )
    assert ri.transforms_param(history) == "match_attention,split_piecewise"
    assert ri.transforms_param(TransformHistory()) == "none"


def test_make_ui_prints_the_classic_runs_view(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from pipeline.tools.ui_url import main

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    experiment = MlflowClient(uri).create_experiment("pipeline")
    assert main(["--tracking-uri", uri, "--port", "5001"]) == 0
    printed = capsys.readouterr().out
    assert f"http://127.0.0.1:5001/#/experiments/{experiment}/runs?workflowType=machine_learning" in printed
    assert main(["--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}"]) == 0  # no store yet
    assert "/#/experiments?workflowType=machine_learning" in capsys.readouterr().out


def test_graph_metrics_are_named_by_role_not_path():
    from pipeline.stages.export import graph_role

    assert graph_role("model.language_model", True, ("model.language_model",)) == "language_model"
    assert graph_role("language_model", True, ("language_model",)) == "language_model"
    assert graph_role("", False, ("model",)) == "language_model"  # a text model captured whole
    assert graph_role("", True, ("model.language_model",)) == "whole_model"
    assert graph_role("model.vision_tower", True, ("model.language_model",)) == "model.vision_tower"
