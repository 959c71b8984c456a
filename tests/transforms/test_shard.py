"""shard: two gloo ranks on this CPU each run the sharded graph of a tiny model; the logits are the
eager model's, each rank holds half of every sharded linear, and the graph has one all-reduce per
region (2 per dense layer)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import COMPILED_SEEDS, compose_cfg, generated_tokens, staged
from transform_helpers import captured
from two_ranks import WORLD, spawn

from pipeline.graphs import find_graphs
from pipeline.transforms import registry
from pipeline.transforms.shard import ALL_REDUCE


def _layer_linear_numel(module: torch.nn.Module) -> int:
    """Elements of the 2-D weights in decoder layers (the linears; fused or not)."""
    return sum(p.numel() for n, p in module.named_parameters() if ".layers." in f".{n}" and p.dim() == 2)


def _shard_and_check(rank: int, name: str, overrides: list[str]) -> dict:
    """The configured transforms on a tiny model's graph in this rank; its logits against eager."""
    model, calls, reference = captured(name)
    whole = _layer_linear_numel(find_graphs(model)[0][1])
    transforms = registry.parse(compose_cfg(overrides).transforms)
    ctx = registry.TransformContext(
        "torch", 64, torch.device("cpu"), model.config, rank, WORLD, dist.group.WORLD.group_name
    )
    history = registry.TransformHistory()
    registry.run_transforms(model, transforms, ctx, history)
    graph = find_graphs(model)[0][1]
    with torch.no_grad():
        errors = {
            key: ((model(**call).logits - reference[key]).abs().max() / reference[key].abs().max()).item()
            for key, call in calls.items()
        }
    records = [r for r in history.records if r.transform == "shard"]  # scope subgraph, then model
    matched = [t for r in records for t in r.matched]
    return dict(
        errors=errors,
        matches=sum(1 for t in matched if t.startswith("colwise")),
        matched=matched,
        unmatched=[why for r in records for why in r.unmatched],
        lm_head=[t for t in matched if t.startswith("vocab-parallel")],
        all_reduces=sum(1 for n in graph.graph.nodes if n.target == ALL_REDUCE),
        numel=(whole, _layer_linear_numel(graph)),
    )


def _sharded(name: str, overrides: list[str] = ()) -> list[dict]:
    return spawn(_shard_and_check, name, list(overrides))


def _generate(overrides: list[str]) -> tuple[dict[int, list[int]], int]:
    """The pipeline's stages through generate, in this process: the greedy tokens per request and
    the regions split."""
    with staged(overrides, "generate") as state:
        return generated_tokens(state.run_dir), state.transform_history.matches("shard")


def _generate_sharded_then_whole(rank: int, overrides: list[str]) -> dict:
    """Both ranks run the stages on the sharded graph; then rank 0, alone, the same unsharded."""
    tokens, sharded = _generate(overrides)
    dist.destroy_process_group()
    reference, unsharded = _generate(overrides) if rank == 0 else (None, None)
    return dict(tokens=tokens, sharded=sharded, reference=reference, unsharded=unsharded)


def _held_bytes(model: torch.nn.Module) -> int:
    return sum(
        {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}.values()
    )


def _slices_then_whole(rank: int, overrides: list[str]) -> dict:
    """Both ranks run the stages holding only their slices (runtime.tp_weights=shard); then rank
    0, alone, the same model whole."""
    # as the CLI runs each rank (no rank holds the whole eager model to profile beside it)
    shard = [*overrides, "runtime.tp_weights=shard", f"runtime.world_size={WORLD}", "profile.reference=none"]
    with staged(shard, "generate") as state:
        ran = dict(
            tokens=generated_tokens(state.run_dir),
            loaded=state.model_info.bytes,  # what load allocated
            filled=state.deferred.filled_bytes,  # what the shard transform filled
            deferred=state.deferred.whole_bytes(),  # what it would have filled whole
            placeholders=len(state.deferred)
            * state.dtype.itemsize,  # one element each, still held by load's modules
            held=_held_bytes(state.model),
        )
    dist.destroy_process_group()
    if rank == 0:
        with staged(overrides, "generate") as state:
            ran |= dict(reference=generated_tokens(state.run_dir), whole=_held_bytes(state.model))
    return ran


@pytest.mark.slow
# a VLM, multimodal RoPE, mixture-of-experts: the text-only seeds' layers are in these (suite budget)
@pytest.mark.parametrize("name", ["tiny_mistral3", "tiny_qwen2_5_vl", "tiny_llama4_scout"])
def test_ranks_holding_only_their_slices_generate_one_process_tokens(name):
    """runtime.tp_weights=shard: the language model's linears are never allocated whole on a rank,
    only the slices it keeps (and whole, the ones no region splits); the tokens are one process's."""
    overrides = [f"model={name}", "capture=partial", "backend=torch-simple", "prompt.output_len=8"]
    ranks = spawn(_slices_then_whole, overrides)
    whole, reference = ranks[0]["whole"], ranks[0]["reference"]
    assert reference and all(len(t) == 8 for t in reference.values())
    for rank in ranks:
        assert rank["tokens"] == reference, (rank["rank"], rank["tokens"], reference)
        # the rank filled far less than the deferred weights whole (its slices, and whole only the
        # weights no region splits), and holds all it filled (nothing filled whole to be cut)
        assert rank["filled"] < 0.75 * rank["deferred"], rank
        assert rank["loaded"] + rank["filled"] <= rank["held"] + rank["placeholders"], rank
        assert rank["held"] < whole, (rank["held"], whole)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny_llama3_1_8b", "tiny_qwen2_5_vl", "tiny_gemma3"])
def test_dense_layers_split_in_two_with_the_eager_logits(name):
    for rank in _sharded(name):
        assert rank["matches"] == 4, rank  # attention and MLP of both layers
        assert rank["all_reduces"] == 4, rank
        assert rank["errors"] and max(rank["errors"].values()) < 1e-5, rank["errors"]
        whole, mine = rank["numel"]
        assert mine * WORLD == whole, rank["numel"]
        assert any("q_proj" in t and "o_proj" in t for t in rank["matched"]), rank["matched"]
        assert any("gate_proj" in t and "down_proj" in t for t in rank["matched"]), rank["matched"]
        # in the graph (a whole text model captured) or the eager parent's: split, the logits gathered
        assert rank["lm_head"] == ["vocab-parallel lm_head (512 rows) + all_gather"], rank["matched"]


@pytest.mark.slow
def test_moe_layers_stay_replicated_with_the_reason():
    """Llama-4's MoE adds the routed experts beside the shared expert: that region is not closed,
    so only attention splits; the record says why the MLP did not."""
    for rank in _sharded("tiny_llama4_scout"):
        assert rank["matches"] == 2 and rank["all_reduces"] == 2, rank
        assert max(rank["errors"].values()) < 1e-5, rank["errors"]
        left = [why for why in rank["unmatched"] if "feed_forward.router" in why]
        assert len(left) == 2 and all("shared_expert.gate_proj" in why for why in left), rank["unmatched"]


@pytest.mark.slow
def test_tp_plan_source_takes_the_models_plan_and_the_lm_head_can_stay_whole():
    overrides = ["transforms.shard.source=tp_plan", "transforms.shard.lm_head=replicated"]
    for rank in _sharded("tiny_llama3_1_8b", overrides):
        assert rank["matches"] == 4 and max(rank["errors"].values()) < 1e-5, rank
        assert rank["lm_head"] == [], rank["lm_head"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "backend"),
    # the seeds with torch-simple (conftest.COMPILED_SEEDS); torch-compile's collectives in the
    # graph on one (suite budget)
    [*((name, "torch-simple") for name in COMPILED_SEEDS), ("tiny_mistral3", "torch-compile")],
)
def test_greedy_tokens_of_two_ranks_are_one_process_tokens(name, backend):
    """load -> export -> transforms (with their correctness check) -> capture -> generate on each
    rank, the cached attention holding the rank's KV heads: the tokens of one process, on the
    seed models (Llama-4: attention split, MoE replicated)."""
    overrides = [f"model={name}", "capture=partial", f"backend={backend}", "prompt.output_len=8"]
    ranks = spawn(_generate_sharded_then_whole, overrides)
    reference = ranks[0]["reference"]
    assert reference and all(len(t) == 8 for t in reference.values())
    # 2 layers x (attention, MLP), Llama-4's attention only; and the vocab-parallel lm_head
    regions = (2 if name == "tiny_llama4_scout" else 4) + 1
    assert ranks[0]["unsharded"] == 0 and all(rank["sharded"] == regions for rank in ranks), ranks
    assert all(rank["tokens"] == reference for rank in ranks), ranks
