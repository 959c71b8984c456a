"""The offline zoo: published configs build, random init is seeded and fast-path correct, checkpoints load."""

from __future__ import annotations

import pytest
import torch
from conftest import SEED_MODELS, TINY_FAMILIES, TINY_MODELS, build_tiny, compose_cfg

from pipeline.models import build, zoo

# Published architecture values (../shared/reference/seed-models.md) as the zoo builds them.
PUBLISHED = {
    "mistral3": (
        "text_config",
        dict(
            vocab_size=131072,
            hidden_size=5120,
            intermediate_size=32768,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
        ),
    ),
    "magistral": (None, dict(vocab_size=131072, hidden_size=5120, intermediate_size=32768, head_dim=128)),
    "llama3_1_8b": (
        None,
        dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_key_value_heads=8),
    ),
    "qwen2_5_vl": (
        "text_config",
        dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_attention_heads=28,
            num_key_value_heads=4,
        ),
    ),
    "llama4_scout": (
        "text_config",
        dict(
            vocab_size=202048,
            hidden_size=5120,
            intermediate_size=8192,
            intermediate_size_mlp=16384,
            num_attention_heads=40,
            num_local_experts=16,
        ),
    ),
}


@pytest.mark.parametrize("name", SEED_MODELS)
def test_seed_model_configs_are_the_published_ones(name):
    hf_config = zoo.build_hf_config(compose_cfg([f"model={name}"]).model)
    part, values = PUBLISHED[name]
    config = getattr(hf_config, part) if part else hf_config
    for key, value in values.items():
        assert getattr(config, key) == value, key
    assert zoo.text_config_of(hf_config).num_hidden_layers == 2  # the seed's override


def test_llama3_rope_scaling_survives():
    hf_config = zoo.build_hf_config(compose_cfg(["model=llama3_1_8b"]).model)
    assert hf_config.rope_parameters["rope_type"] == "llama3"
    assert hf_config.rope_parameters["factor"] == 8.0


@pytest.mark.parametrize(("name", "billions"), [("mistral3", 2.89), ("llama4_scout", 7.2)])
def test_seed_parameter_counts_on_meta(name, billions):
    """Counted on the meta device: no memory. Llama-4 Scout at 2 layers is ~7 B (issue: 29 GB fp32)."""
    cfg = compose_cfg([f"model={name}"])
    hf_config = zoo.build_hf_config(cfg.model)
    with build.parameters_on_meta():
        model = zoo.resolve_model_class(cfg.model, hf_config)._from_config(hf_config)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert params / 1e9 == pytest.approx(billions, rel=0.03)


@pytest.mark.parametrize("name", TINY_MODELS + TINY_FAMILIES)
def test_tiny_models_are_debug_size(name):
    model, hf_config, _ = build_tiny(name)
    text = zoo.text_config_of(hf_config)
    assert text.hidden_size == 64 and text.num_hidden_layers == 2
    if zoo.is_vlm(hf_config):
        vision = hf_config.vision_config
        assert getattr(vision, "num_hidden_layers", None) or vision.depth <= 2
    assert not any(p.device.type == "meta" for p in model.parameters())
    assert not any(b.device.type == "meta" for b in model.buffers())


def test_random_init_is_seeded_and_reproducible():
    a, _, _ = build_tiny("tiny_mistral3", seed=0)
    b, _, _ = build_tiny("tiny_mistral3", seed=0)
    c, _, _ = build_tiny("tiny_mistral3", seed=1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if pa.numel() > 16 and pa.std() > 0:
            assert not torch.equal(pa, pc), name


def test_random_init_distribution():
    model, hf_config, _ = build_tiny("tiny_llama3_1_8b")
    std = hf_config.initializer_range
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.std().item() == pytest.approx(std, rel=0.1)
    assert q.abs().max().item() <= std * 3**0.5 + 1e-6
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    # Same shape, different parameter: different values (a seed mix that dropped the parameter
    # index once made every layer's q_proj identical).
    assert not torch.equal(q, model.model.layers[1].self_attn.q_proj.weight)
    assert not torch.equal(
        model.model.layers[0].mlp.gate_proj.weight, model.model.layers[0].mlp.up_proj.weight
    )


def test_tied_embeddings_stay_tied():
    cfg = compose_cfg(["model=tiny_magistral", "+model.hf_config.tie_word_embeddings=true"])
    hf_config = zoo.build_hf_config(cfg.model)
    model, report = build.build_random(
        zoo.resolve_model_class(cfg.model, hf_config), hf_config, torch.float32, torch.device("cpu"), 0
    )
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert report.params == sum(p.numel() for p in model.parameters())  # parameters() dedups


def test_bfloat16_materializes_in_bfloat16_and_keeps_rotary_tables_float32():
    cfg = compose_cfg(["model=tiny_llama3_1_8b"])
    hf_config = zoo.build_hf_config(cfg.model)
    model, report = build.build_random(
        zoo.resolve_model_class(cfg.model, hf_config), hf_config, torch.bfloat16, torch.device("cpu"), 0
    )
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert report.bytes == report.params * 2


def test_a_model_that_does_not_fit_is_refused_before_loading(monkeypatch):
    from pipeline.errors import ConfigError
    from pipeline.models import memory, meta

    cfg = compose_cfg(["model=llama4_scout"])
    hf_config = zoo.build_hf_config(cfg.model)
    params = meta.parameter_count(meta.meta_model(zoo.resolve_model_class(cfg.model, hf_config), hf_config))
    monkeypatch.setattr(memory, "free_bytes", lambda device: 24 * 10**9)
    with pytest.raises(ConfigError, match=r"7\.3\d B parameters in float32.*use dtype=bfloat16"):
        memory.check_fits(params, hf_config, cfg.runtime, "llama4_scout", torch.float32, torch.device("cpu"))
    memory.check_fits(params, hf_config, cfg.runtime, "llama4_scout", torch.bfloat16, torch.device("cpu"))


def test_dtype_auto_picks_bfloat16_on_cpu_only_when_float32_does_not_fit(monkeypatch):
    from pipeline.models import memory, meta

    cfg = compose_cfg(["model=llama4_scout"])
    hf_config = zoo.build_hf_config(cfg.model)
    params = meta.parameter_count(meta.meta_model(zoo.resolve_model_class(cfg.model, hf_config), hf_config))
    cpu = torch.device("cpu")
    monkeypatch.setattr(memory, "free_bytes", lambda device: 24 * 10**9)
    dtype, note = memory.auto_dtype(params, hf_config, cfg.runtime, cpu)
    assert dtype == torch.bfloat16 and "float32 would need about" in note
    monkeypatch.setattr(memory, "free_bytes", lambda device: 100 * 10**9)
    assert memory.auto_dtype(params, hf_config, cfg.runtime, cpu) == (torch.float32, None)
    monkeypatch.setattr(memory, "free_bytes", lambda device: 5 * 10**9)  # neither fits: check_fits says so
    assert memory.auto_dtype(params, hf_config, cfg.runtime, cpu) == (torch.float32, None)


def test_tensor_parallel_ranks_are_counted_in_what_must_fit(monkeypatch):
    """A rank with tp_weights=whole holds the whole model beside its slices, with shard only its
    slices; one CPU host holds every rank's, a GPU one rank's."""
    from pipeline.errors import ConfigError
    from pipeline.models import memory, meta

    def fits(overrides: list[str], device: str, free_gb: float, dtype: torch.dtype = torch.bfloat16) -> None:
        cfg = compose_cfg(["model=llama4_scout", *overrides])
        hf_config = zoo.build_hf_config(cfg.model)
        params = meta.parameter_count(
            meta.meta_model(zoo.resolve_model_class(cfg.model, hf_config), hf_config)
        )
        monkeypatch.setattr(memory, "free_bytes", lambda device: free_gb * 10**9)
        memory.check_fits(params, hf_config, cfg.runtime, "llama4_scout", dtype, torch.device(device))

    two = ["runtime.world_size=2"]
    fits([], "cpu", 24)  # 14.7 GB of bfloat16 weights, once
    with pytest.raises(ConfigError, match=r"3x the weights for 2 ranks.*use runtime.tp_weights=shard"):
        fits(two, "cpu", 24)
    fits([*two, "runtime.tp_weights=shard"], "cpu", 24)  # the two ranks' slices: one model
    with pytest.raises(ConfigError, match=r"1.5x the weights for 2 ranks"):
        fits(two, "cuda", 12)
    fits([*two, "runtime.tp_weights=shard"], "cuda", 12)  # half a model per GPU
    # float32: every change that fits is named with what it needs, bfloat16 alone does not fit
    with pytest.raises(
        ConfigError,
        match=r"use runtime.tp_weights=shard \(about [\d.]+ GB\) or dtype=bfloat16 runtime.tp_weights=shard \(about",
    ):
        fits(two, "cpu", 40, torch.float32)


def test_kv_cache_estimate_reads_hf_defaults():
    """A text config without num_key_value_heads (Hugging Face then uses the attention heads)."""
    from types import SimpleNamespace

    from pipeline.config import RuntimeConfig
    from pipeline.models.memory import kv_cache_bytes

    text = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=64)
    runtime = RuntimeConfig(max_batch_size=2, max_seq_len=128)
    assert kv_cache_bytes(text, runtime, torch.float32) == 2 * 2 * 4 * 16 * 2 * 128 * 4
