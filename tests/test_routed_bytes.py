"""A run's decode read rate counts the bytes a step reads: with pipeline::moe only the routed experts',
checked against the count the model's config gives (at batch 1 a token reads exactly its k experts)."""

from __future__ import annotations

import pytest
from conftest import staged

from pipeline.runner import run_stage

FP32 = 4


def _generate(tmp_path, *overrides: str):
    overrides = [
        "model=tiny_mixtral",
        "backend=torch-simple",
        "prompt.prompt_len=6",
        "prompt.output_len=5",
        *overrides,
    ]
    with staged(overrides, "capture", tmp_path) as state:
        return state.model_info.decode_bytes, run_stage(state, "generate"), state.hf_config


def _expert_bytes(cfg) -> int:
    # one expert: gate and up [2I, H], down [H, I]
    return 3 * cfg.intermediate_size * cfg.hidden_size * FP32


def test_batch_one_reads_its_k_experts_per_layer(tmp_path):
    every_expert, result, cfg = _generate(tmp_path)
    unread = cfg.num_hidden_layers * (cfg.num_local_experts - cfg.num_experts_per_tok) * _expert_bytes(cfg)
    routed = result.metrics["model/decode_routed_bytes"]
    assert routed == every_expert - unread
    step_s = result.metrics["latency/decode_ms"] / 1000
    assert result.metrics["throughput/decode_gbs"] == pytest.approx(routed / step_s / 1e9)
    assert any("counts the routed experts only" in n for n in result.notes), result.notes


def test_a_batch_reads_between_k_and_every_expert(tmp_path):
    every_expert, result, cfg = _generate(tmp_path, "prompt.batch_size=4")
    experts, k = cfg.num_local_experts, cfg.num_experts_per_tok
    least_read = cfg.num_hidden_layers * k * _expert_bytes(cfg)  # all 4 tokens on the same k experts
    most_unread = cfg.num_hidden_layers * (experts - k) * _expert_bytes(cfg)
    routed = result.metrics["model/decode_routed_bytes"]
    assert every_expert - most_unread <= routed <= every_expert
    assert routed >= least_read


def test_without_match_moe_every_expert_counts(tmp_path):
    every_expert, result, _ = _generate(tmp_path, "transforms.match_moe.enabled=false")
    assert "model/decode_routed_bytes" not in result.metrics
    step_s = result.metrics["latency/decode_ms"] / 1000
    assert result.metrics["throughput/decode_gbs"] == pytest.approx(every_expert / step_s / 1e9)
