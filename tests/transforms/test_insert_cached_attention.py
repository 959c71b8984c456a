"""insert_cached_attention: the graph's record gains its KV cache layout and a fresh-cache provider,
so a plain forward of the cached graph still computes the eager result."""

from __future__ import annotations

import pytest
from conftest import transform_context
from transform_helpers import assert_same, captured

from pipeline.graphs import find_graphs, record_of
from pipeline.transforms import registry


@pytest.mark.parametrize("page_size", [4, 64])
def test_the_record_carries_the_cache_layout(page_size):
    model, calls, reference = captured("tiny_llama3_1_8b")
    graph = find_graphs(model)[0][1]
    assert not record_of(graph).has_cache
    history = registry.TransformHistory()
    transforms = registry.parse({"cleanup": {}, "match_attention": {}, "insert_cached_attention": {}})
    registry.run_transforms(model, transforms, transform_context(page_size=page_size), history)
    record = record_of(graph)
    assert [(s.input_name, s.num_kv_heads, s.head_dim) for s in record.cache_specs] == [
        ("kv_cache_0", 2, 16),
        ("kv_cache_1", 2, 16),
    ]
    inputs = record.runtime_inputs({"input_ids": calls["text"]["input_ids"]})
    assert inputs["kv_cache_0"].shape[2] == page_size
    assert history.matches("insert_cached_attention") == 2
    assert not hasattr(graph, "cache_specs")  # the record is the one place a graph's contract lives
    assert_same(model, calls, reference)
