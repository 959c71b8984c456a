"""The user's own model folder: sharded safetensors saved by Hugging Face, a tokenizer and chat
template built offline, the family's image processor config. For every tiny seed model the
pipeline (load from the folder, partial capture, transforms, demollm) generates the tokens Hugging
Face's own `from_pretrained` + `generate` does from the same folder, for text, chat and chat-with-image
queries, and so do two tensor-parallel ranks; a folder with a weight or a shard missing fails
naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoints import save_checkpoint
from conftest import (
    TINY_FAMILIES,
    TINY_MODELS,
    TINY_MOE,
    YAML_ONLY_VLMS,
    build_tiny,
    compose_cfg,
    compose_dict,
    generated_tokens,
    job_of,
    run_pipeline,
    staged,
)
from PIL import Image
from test_runtime import hf_inputs
from two_ranks import WORLD, spawn

from pipeline.errors import ConfigError, StageFailure
from pipeline.jobs import check_config
from pipeline.models import checkpoint, zoo
from pipeline.models.deferred import DeferredWeights
from pipeline.runner import advance, new_state, run_stage
from pipeline.runtime.engine import DemoLLM
from pipeline.runtime.requests import build_requests
from pipeline.runtime.sampling import SamplingParams

LANGUAGE_MODEL = {
    "tiny_mistral3": "model.language_model",
    "tiny_qwen2_5_vl": "model.language_model",
    "tiny_llama4_scout": "language_model.model",
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Each tiny seed model saved as a Hugging Face folder (float32 weights in 40 KB shards)."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: save_checkpoint(build_tiny(name, seed=7)[0], root / name) for name in TINY_MODELS}


@pytest.fixture(scope="module")
def photo(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("images") / "photo.png"
    pixels = torch.randint(0, 256, (60, 90, 3), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    Image.fromarray(pixels.numpy()).save(path)
    return path


def _queries(name: str, photo: Path) -> list:
    queries = [
        "how big is the universe?",
        {"prompt": "explain gravity in simple words and a single sentence:"},
        [{"role": "user", "content": [{"type": "text", "text": "how to fix slicing in golf?"}]}],
    ]
    if name in LANGUAGE_MODEL:
        queries.append(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "please describe the natural scenery you see in this image"},
                        {"type": "image", "url": f"file://{photo}"},
                    ],
                }
            ]
        )
    return queries


def hydra_value(value) -> str:
    """A Python value in Hydra's override grammar: quoted strings, bare keys."""
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, list):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def _hf_reference(cls: type, folder: Path, requests, dtype: torch.dtype, new_tokens: int) -> dict:
    """Hugging Face's own: from_pretrained on the folder, generate on each request alone."""
    model = cls.from_pretrained(folder, dtype=dtype, local_files_only=True).eval()
    out = {}
    with torch.no_grad():
        for request in requests:
            ids = model.generate(
                **hf_inputs(model.config, request), max_new_tokens=new_tokens, do_sample=False
            )
            out[request.seq_id] = ids[0, len(request.prompt) :].tolist()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", TINY_MODELS)
def test_a_checkpoint_folder_generates_what_hugging_face_generates(name, dtype, folders, photo, tmp_path):
    queries = hydra_value(_queries(name, photo))
    overrides = [
        "model=hf",
        f"model.checkpoint={folders[name]}",
        f"prompt.queries={queries}",
        "prompt.output_len=6",
    ]
    checked = check_config(compose_dict(overrides), cuda_available=False)  # every query checked up front
    assert (
        checked.model_cls.__name__
        == json.loads((folders[name] / "config.json").read_text())["architectures"][0]
    )
    with staged(overrides, "transforms", tmp_path, dtype) as state:
        if name in LANGUAGE_MODEL:  # found by structure, though from_pretrained copied the configs
            assert state.model_info.language_model_paths == [LANGUAGE_MODEL[name]]
            assert [c.path for c in state.captured] == [LANGUAGE_MODEL[name]]
        assert state.model_info.source == str(folders[name])
        cfg = state.cfg
        requests = build_requests(
            cfg.prompt, cfg.runtime, cfg.seed, state.hf_config, dtype, state.device, state.sources
        )
        assert len(requests) == len(_queries(name, photo))
        engine = DemoLLM(
            state.model, state.hf_config, cfg.runtime, state.device, zoo.eos_ids(state.hf_config)
        )
        tokens = engine.generate(requests, 6, SamplingParams(), seed=0).tokens
        assert tokens == _hf_reference(checked.model_cls, folders[name], requests, dtype, 6)


def _generate_on_rank(rank: int, overrides: list[str]) -> dict:
    """The stages through generate on this rank; its tokens, the requests and the regions split."""
    with staged(overrides, "generate") as state:
        cfg = state.cfg
        requests = build_requests(
            cfg.prompt, cfg.runtime, cfg.seed, state.hf_config, state.dtype, state.device, state.sources
        )
        held = {
            p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in state.model.parameters()
        }
        return dict(
            tokens=generated_tokens(state.run_dir),
            requests=requests,
            sharded=[t for r in state.transform_history.records if r.transform == "shard" for t in r.matched],
            # tp_weights=shard: what load read whole, what the shard transform read of the rest (and
            # what it would have read whole); held: with load's placeholders, one element each
            read=state.model_info.bytes + (state.deferred.filled_bytes if state.deferred else 0),
            sliced=(state.deferred.filled_bytes, state.deferred.whole_bytes()) if state.deferred else None,
            held=sum(held.values()) + (len(state.deferred) * state.dtype.itemsize if state.deferred else 0),
        )


@pytest.mark.slow
@pytest.mark.parametrize("tp_weights", ["whole", "shard"])
def test_two_ranks_generate_what_hugging_face_generates_from_the_folder(tp_weights, folders, photo):
    """runtime.world_size=2's stages on a saved mistral3 folder (text, chat and chat-with-image
    queries): each rank loads the folder (whole, or with tp_weights=shard only its slices of the
    split weights, read from the files alone), shards the graph and the eager lm_head, and both
    generate the tokens of Hugging Face's from_pretrained + generate, which knows nothing of the ranks."""
    name = "tiny_mistral3"
    overrides = [
        "model=hf",
        f"model.checkpoint={folders[name]}",
        f"prompt.queries={hydra_value(_queries(name, photo))}",
        "prompt.output_len=6",
        "capture=partial",
    ]
    world = [f"runtime.tp_weights={tp_weights}", f"runtime.world_size={WORLD}", "profile.reference=none"]
    ranks = spawn(_generate_on_rank, [*overrides, *world])
    cls = check_config(compose_dict(overrides), cuda_available=False).model_cls
    reference = _hf_reference(cls, folders[name], ranks[0]["requests"], torch.float32, 6)
    for rank in ranks:
        assert len(rank["sharded"]) == 5, rank["sharded"]  # attention and MLP of 2 layers, the lm_head
        assert rank["tokens"] == reference, (rank["rank"], rank["tokens"], reference)
        if tp_weights == "shard":  # far less than the split weights whole, and nothing read to be cut
            filled, whole = rank["sliced"]
            assert filled < 0.75 * whole and rank["read"] <= rank["held"], rank


@pytest.fixture(scope="module")
def moe_folders(tmp_path_factory) -> dict[str, Path]:
    """The tiny MoE text models saved as Hugging Face folders: save_pretrained writes each
    expert's gate/up/down (Mixtral's w1/w3/w2) as a tensor of its own, which the model stacks on load."""
    root = tmp_path_factory.mktemp("moe_checkpoints")
    return {name: save_checkpoint(build_tiny(name, seed=7)[0], root / name) for name in TINY_MOE}


@pytest.mark.parametrize("name", TINY_MOE)
def test_a_ranks_load_builds_the_experts_hugging_face_stacks(name, moe_folders):
    """runtime.tp_weights=shard's load (checkpoint.load_slices) of a folder whose experts are saved
    one by one holds every weight Hugging Face's from_pretrained holds, stacked experts included."""
    folder = moe_folders[name]
    keys = json.loads((folder / checkpoint.INDEX).read_text())["weight_map"]
    assert any(".experts.0." in k for k in keys) and not any(k.endswith("experts.gate_up_proj") for k in keys)
    cls = check_config(
        compose_dict(["model=hf", f"model.checkpoint={folder}"]), cuda_available=False
    ).model_cls
    reference = cls.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    model, report = checkpoint.load_slices(
        cls,
        str(folder),
        reference.config,
        torch.float32,
        torch.device("cpu"),
        None,
        lambda path, module, name: False,  # nothing deferred: every weight read here
        DeferredWeights(),
    )
    assert report.unexpected == []
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys() and any("experts.gate_up_proj" in k for k in ours)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


@pytest.mark.slow
# Qwen3-MoE's folder alone (suite budget): Mixtral's per-expert names are checked by the load test above
@pytest.mark.parametrize("name", ["tiny_qwen3_moe"])
def test_two_ranks_with_sliced_weights_generate_what_hugging_face_generates_from_a_moe_folder(
    name, moe_folders
):
    """runtime.world_size=2, tp_weights=shard on a saved Qwen3-MoE folder: each rank reads its
    slices of the attention linears and the lm_head, the experts built whole from their per-expert
    tensors, and both generate the tokens of Hugging Face's from_pretrained + generate."""
    overrides = [
        "model=hf",
        f"model.checkpoint={moe_folders[name]}",
        f"prompt.queries={hydra_value(_queries(name, None))}",
        "prompt.output_len=6",
        "capture=partial",
    ]
    world = ["runtime.tp_weights=shard", f"runtime.world_size={WORLD}", "profile.reference=none"]
    ranks = spawn(_generate_on_rank, [*overrides, *world])
    cls = check_config(compose_dict(overrides), cuda_available=False).model_cls
    reference = _hf_reference(cls, moe_folders[name], ranks[0]["requests"], torch.float32, 6)
    for rank in ranks:
        assert rank["sharded"], rank  # the attention regions at least, and the lm_head
        assert rank["tokens"] == reference, (rank["rank"], rank["tokens"], reference)
        filled, whole = rank["sliced"]
        assert filled < whole, rank


def _copy(folder: Path, into: Path) -> Path:
    into.mkdir()
    for path in folder.iterdir():
        (into / path.name).write_bytes(path.read_bytes())
    return into


def _load(folder: Path, tmp_path: Path, *extra: str):
    overrides = ["model=hf", f"model.checkpoint={folder}", *extra]
    check_config(compose_dict(overrides), cuda_available=False)
    state = new_state(job_of(overrides, tmp_path / "run"))
    return state, advance(state, "load")


def test_a_missing_tensor_fails_the_load_naming_it(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(folders["tiny_llama3_1_8b"], tmp_path / "broken")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.down_proj.weight"
    shard = folder / index["weight_map"].pop(name)
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(StageFailure, match=rf"lacks 1 weight\(s\) of LlamaForCausalLM: {name}"):
        _load(folder, tmp_path)


def test_weights_the_model_does_not_use_are_reported(folders, tmp_path):
    """Two layers saved, one run (model_kwargs): the second layer's weights are reported, not loaded."""
    state, _ = _load(folders["tiny_magistral"], tmp_path, "+model.model_kwargs.num_hidden_layers=1")
    record = state.model_info
    assert record.source == str(folders["tiny_magistral"]) and state.model.config.num_hidden_layers == 1
    state.release()
    overrides = [
        "model=hf",
        f"model.checkpoint={folders['tiny_magistral']}",
        "+model.model_kwargs.num_hidden_layers=1",
    ]
    state = new_state(job_of(overrides, tmp_path / "again"))
    result = run_stage(state, "load")
    assert result.metrics["model/unused_checkpoint_weights"] == 9  # 7 linears and 2 norms of layer 1
    assert any("model.layers.1." in note for note in result.notes)
    state.release()


def test_a_missing_shard_is_refused_up_front_naming_the_file(folders, tmp_path):
    folder = _copy(folders["tiny_mistral3"], tmp_path / "partial")
    shard = sorted(folder.glob("model-*.safetensors"))[3]
    shard.unlink()
    with pytest.raises(ConfigError, match=rf"names 1 shard\(s\) that are not there: {shard.name}"):
        check_config(compose_dict(["model=hf", f"model.checkpoint={folder}"]), cuda_available=False)


def test_skip_loading_weights_runs_the_folders_config_with_random_weights(folders, tmp_path):
    folder = _copy(folders["tiny_qwen2_5_vl"], tmp_path / "config-only")
    for shard in folder.glob("*.safetensors"):
        shard.unlink()
    with pytest.raises(ConfigError, match="skip_loading_weights=true"):
        check_config(compose_dict(["model=hf", f"model.checkpoint={folder}"]), cuda_available=False)
    state, _ = _load(folder, tmp_path, "model.skip_loading_weights=true")
    assert state.model_info.source == f"random (seed 0), config from {folder}"
    assert state.model_info.language_model_paths == ["model.language_model"]
    state.release()


@pytest.mark.parametrize(
    ("query", "message"),
    [
        (
            '[[{role: user, content: [{type: image, url: "https://example.com/a.png"}]}]]',
            "download it and give its local path",
        ),
        ("[[{role: user, content: [{type: image, url: /no/such.png}]}]]", "not a file here"),
        ("[[{role: wizard, content: hi}]]", "must be a message"),
        ("[[{role: user, content: [{type: audio}]}]]", r"content\[0\] must be"),
    ],
)
def test_query_mistakes_are_config_errors_before_loading(folders, query, message):
    overrides = ["model=hf", f"model.checkpoint={folders['tiny_mistral3']}", f"prompt.queries={query}"]
    with pytest.raises(ConfigError, match=message):
        check_config(compose_dict(overrides), cuda_available=False)


def test_chat_queries_need_a_chat_template(folders, tmp_path):
    folder = _copy(folders["tiny_magistral"], tmp_path / "no-template")
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    overrides = ["model=hf", f"model.checkpoint={folder}", "prompt.queries=[[{role: user, content: hi}]]"]
    with pytest.raises(
        ConfigError, match=r"prompt.queries\[0\] is chat messages, and model.checkpoint has no chat template"
    ):
        check_config(compose_dict(overrides), cuda_available=False)
    check_config(
        compose_dict([*overrides[:2], "prompt.queries=[hi there]"]), cuda_available=False
    )  # text is fine


def test_a_vlm_without_a_language_model_lists_the_candidates():
    """A text config that no module matches (4 layers asked, the model has 2): exit 2 listing every
    module with layers."""
    overrides = ["model=tiny_mistral3", "+model.model_kwargs.text_config.vocab_size=1000"]
    checked = check_config(compose_dict(overrides), cuda_available=False)  # found: vocab follows the config
    assert checked.model_cls.__name__ == "Mistral3ForConditionalGeneration"
    from pipeline.models import meta

    skeleton = meta.meta_model(checked.model_cls, checked.hf_config)
    text = zoo.text_config_of(checked.hf_config)
    text.num_hidden_layers = 4  # the config no longer describes the built model
    with pytest.raises(
        ConfigError,
        match=r"found no language model.*candidates: model.vision_tower.transformer \(PixtralTransformer, 1 layers\); model.language_model \(MistralModel, 2 layers, token embedding\)",
    ):
        meta.check_language_model(skeleton, text)


@pytest.mark.slow
def test_the_command_line_runs_a_checkpoint_with_chat_and_image_queries(
    folders, photo, tmp_path, tracking_uri
):
    queries = hydra_value(_queries("tiny_qwen2_5_vl", photo))
    proc = run_pipeline(
        [
            "model=hf",
            f"model.checkpoint={folders['tiny_qwen2_5_vl']}",
            "+model.model_kwargs.text_config.num_hidden_layers=1",
            f"prompt.queries={queries}",
            "prompt.batch_size=6",
            "runtime.max_batch_size=2",
            "prompt.output_len=4",
            "profile.decode_steps=2",
            "profile.kernel_provenance=false",  # the windows it checks, not their attribution
            f"tracking.uri={tracking_uri}",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    metrics = summary["metrics"]
    assert metrics["generation/requests"] == 6 and metrics["model/unused_checkpoint_weights"] > 0
    assert metrics["latency/ttft_ms"] >= metrics["latency/queue_ms"] and metrics["latency/tpot_ms"] > 0
    assert "language model at: model.language_model" in (tmp_path / "run" / "pipeline.log").read_text()
    phases = json.loads((tmp_path / "run" / "profile" / "profile.json").read_text())["phases"]
    assert {"prefill", "prefill_2", "decode_1", "decode"} <= set(phases)  # a window per step, queued ones too


def test_piecewise_capture_generates_what_hugging_face_generates(folders, photo, tmp_path):
    """backend=torch-compile backend.piecewise=true on a saved mistral3 folder: text, chat and
    chat-with-image queries in one batch of mixed prompt lengths prefill through the token buckets'
    segments, and the tokens are those of Hugging Face's from_pretrained + generate."""
    name = "tiny_mistral3"
    overrides = [
        "model=hf", f"model.checkpoint={folders[name]}", f"prompt.queries={hydra_value(_queries(name, photo))}",
        "prompt.output_len=6", "backend=torch-compile", "backend.piecewise=true", "profile.enabled=false",
        "report.enabled=false", "tracking.enabled=false",
    ]  # fmt: skip
    checked = check_config(compose_dict(overrides), cuda_available=False)
    with staged(overrides, "generate", tmp_path) as state:
        assert next(r for r in state.stages if r.name == "generate").metrics["piecewise/steps"] >= 1
        cfg = state.cfg
        requests = build_requests(
            cfg.prompt, cfg.runtime, cfg.seed, state.hf_config, state.dtype, state.device, state.sources
        )
        assert len({len(r.prompt) for r in requests}) > 1 and any(r.images for r in requests)
    tokens = generated_tokens(tmp_path)
    expected = _hf_reference(checked.model_cls, folders[name], requests, torch.float32, 6)
    assert tokens == {r.seq_id: expected[r.seq_id] for r in requests}


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory) -> dict[str, Path]:
    """Each tiny family saved by Hugging Face's save_pretrained: its config.json in the published
    shape (nested rope_parameters, layer_types, sizes as lists or dicts), weights in one file."""
    root = tmp_path_factory.mktemp("families")
    return {
        name: save_checkpoint(build_tiny(name, seed=3)[0], root / name, shard="50MB", tokenizer=False)
        for name in [*TINY_FAMILIES, *YAML_ONLY_VLMS, "tiny_mllama"]
    }


@pytest.mark.parametrize("name", [*TINY_FAMILIES, *YAML_ONLY_VLMS, "tiny_mllama"])
def test_each_family_loads_from_its_published_config(name, family_folders, tmp_path):
    """`model=hf model.checkpoint=<folder>`: the config read back from config.json is the YAML's,
    and the pipeline's partly captured model generates, for the synthetic workload (an image in
    every request of a VLM), the tokens from_pretrained + generate does on the folder."""
    folder = family_folders[name]
    overrides = ["model=hf", f"model.checkpoint={folder}", "prompt.batch_size=2", "prompt.output_len=4"]
    overrides.append("prompt.prompt_len=256")  # room beside PaddleOCR-VL's 196 image tokens
    checked = check_config(compose_dict(overrides), cuda_available=False)
    from_yaml = zoo.build_hf_config(compose_cfg([f"model={name}"]).model)
    assert _comparable(checked.hf_config) == _comparable(from_yaml)
    with staged(overrides, "transforms", tmp_path) as state:
        cfg = state.cfg
        requests = build_requests(
            cfg.prompt, cfg.runtime, cfg.seed, state.hf_config, torch.float32, state.device, state.sources
        )
        assert all(bool(r.images) == zoo.is_vlm(state.hf_config) for r in requests)
        engine = DemoLLM(
            state.model, state.hf_config, cfg.runtime, state.device, zoo.eos_ids(state.hf_config)
        )
        tokens = engine.generate(requests, 4, SamplingParams(), seed=0).tokens
    assert tokens == _hf_reference(checked.model_cls, folder, requests, torch.float32, 4)


def _comparable(values) -> dict:
    """A config as its values, nested configs too: without what saving adds (architectures, dtype,
    versions)."""
    skip = {"architectures", "dtype", "transformers_version", "_name_or_path"}
    values = values.to_diff_dict() if hasattr(values, "to_diff_dict") else values
    return {k: _comparable(v) if isinstance(v, dict) else v for k, v in values.items() if k not in skip}


def _image_chat(photo: Path) -> list:
    return [
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "please describe the natural scenery you see in this image"},
                    {"type": "image", "url": f"file://{photo}"},
                ],
            }
        ]
    ]


@pytest.mark.parametrize("name", ["tiny_idefics3", "tiny_mllama", "tiny_aya_vision"])
def test_chat_images_are_laid_out_by_the_familys_processor(name, photo, tmp_path_factory, tmp_path):
    """A folder with the family's processor (processor_config.json, tokenizer, image processor):
    a chat-with-image query is what that processor makes of the template's text and the image
    (Idefics3's `<fake_token_around_image><global-img>` around its tile tokens, which the model
    cannot tell; Mllama's one `<|image|>` and the cross-attention mask it computes beside the ids;
    Aya Vision's `<|START_OF_IMG|>`, tile and `TILE_GLOBAL` tokens around its patch tokens),
    and the tokens equal Hugging Face's processor + generate on the folder."""
    folder = save_checkpoint(build_tiny(name, seed=5)[0], tmp_path_factory.mktemp("processed") / name)
    queries = _image_chat(photo)
    overrides = ["model=hf", f"model.checkpoint={folder}", f"prompt.queries={hydra_value(queries)}"]
    overrides += ["prompt.batch_size=1", "prompt.output_len=5"]
    checked = check_config(compose_dict(overrides), cuda_available=False)
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    text = processor.apply_chat_template(queries[0], add_generation_prompt=True)
    inputs = processor(text=[text], images=[Image.open(photo).convert("RGB")], return_tensors="pt")
    model = checked.model_cls.from_pretrained(folder, local_files_only=True).eval()
    with torch.no_grad():
        want = model.generate(**inputs, max_new_tokens=5, do_sample=False)[0, inputs["input_ids"].shape[1] :]
    with staged(overrides, "transforms", tmp_path) as state:
        assert state.sources.processor is not None
        cfg = state.cfg
        (request,) = build_requests(
            cfg.prompt, cfg.runtime, cfg.seed, state.hf_config, torch.float32, state.device, state.sources
        )
        assert request.prompt == inputs["input_ids"][0].tolist()
        if "cross_attention_mask" in inputs:
            assert torch.equal(request.cross_attention_mask, inputs["cross_attention_mask"][0])
        engine = DemoLLM(
            state.model, state.hf_config, cfg.runtime, state.device, zoo.eos_ids(state.hf_config)
        )
        tokens = engine.generate([request], 5, SamplingParams(), seed=0).tokens
    assert tokens[0] == want.tolist()


@pytest.mark.parametrize("processor", [True, False], ids=["processor", "no-processor"])
def test_a_chat_with_two_images_cross_attends_each_from_its_token(
    processor, photo, tmp_path_factory, tmp_path
):
    """Mllama, two images in one chat message: each token attends the tiles of the last image
    before it. With the folder's processor the request is its output; without one (no
    processor_config.json) the images go through the image processor into one sequence's
    [1, images, tiles, ...] and the mask through the family's processor code: the same ids, pixels
    (to float rounding) and cross-attention mask either way, and the tokens of processor + generate on the folder."""
    folder = save_checkpoint(build_tiny("tiny_mllama", seed=5)[0], tmp_path_factory.mktemp("two") / "mllama")
    second = tmp_path / "second.png"
    Image.new("RGB", (40, 70), (10, 200, 30)).save(second)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "url": f"file://{photo}"},
                {"type": "text", "text": "compare this image"},
                {"type": "image", "url": f"file://{second}"},
                {"type": "text", "text": "with this one"},
            ],
        }
    ]
    from transformers import AutoProcessor, MllamaForConditionalGeneration

    hf_processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    text = hf_processor.apply_chat_template(messages, add_generation_prompt=True)
    pictures = [[Image.open(p).convert("RGB") for p in (photo, second)]]
    inputs = hf_processor(text=[text], images=pictures, return_tensors="pt")
    with torch.no_grad():
        reference = MllamaForConditionalGeneration.from_pretrained(folder, local_files_only=True).eval()
        want = reference.generate(**inputs, max_new_tokens=5, do_sample=False)[
            0, inputs["input_ids"].shape[1] :
        ]
    if not processor:
        (folder / "processor_config.json").unlink()
    overrides = ["model=hf", f"model.checkpoint={folder}", f"prompt.queries={hydra_value([messages])}"]
    with staged([*overrides, "prompt.output_len=5"], "transforms", tmp_path / "run") as state:
        assert (state.sources.processor is not None) == processor
        cfg = state.cfg
        (request,) = build_requests(
            cfg.prompt, cfg.runtime, cfg.seed, state.hf_config, torch.float32, state.device, state.sources
        )
        assert request.prompt == inputs["input_ids"][0].tolist()
        assert torch.equal(request.cross_attention_mask, inputs["cross_attention_mask"][0])
        # the same pixels up to float rounding: torchvision's image processor resizes a batch of
        # images together, the pipeline each image alone
        assert all(torch.allclose(request.images[k], inputs[k], rtol=0, atol=1e-6) for k in request.images)
        engine = DemoLLM(
            state.model, state.hf_config, cfg.runtime, state.device, zoo.eos_ids(state.hf_config)
        )
        tokens = engine.generate([request], 5, SamplingParams(), seed=0).tokens
    assert tokens[0] == want.tolist()


def test_a_processor_that_disagrees_with_the_model_fails_the_load_naming_its_config(
    photo, tmp_path_factory, tmp_path
):
    """GOT-OCR2's processor writes 256 image tokens per image (its published 1024-pixel images); the
    tiny model makes one of its 64-pixel image. The tokens come from the processor alone (no model
    counts them before load); the loaded model's vision path, run once on its own weights, makes 1:
    the load stage fails naming the processor config, before any graph is made."""
    folder = save_checkpoint(build_tiny("tiny_got_ocr2")[0], tmp_path_factory.mktemp("got") / "got")
    overrides = [
        "model=hf",
        f"model.checkpoint={folder}",
        f"prompt.queries={hydra_value(_image_chat(photo))}",
    ]
    check_config(compose_dict(overrides), cuda_available=False)
    with pytest.raises(StageFailure, match=r"wrote \[256\] image tokens.*makes \[1\].*processor_config.json"):
        with staged(overrides, "load", tmp_path):
            pass
