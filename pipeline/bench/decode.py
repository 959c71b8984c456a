"""Decode, side by side in one process: Hugging Face eager `generate` and demollm on the partly
captured, transformed, cached model, same weights and batch, against the machine's read bandwidth.

Decode of a small batch is memory-bound: every step reads the language model's weights and lm_head
once. Achieved bandwidth = those bytes / step time, as a percent of a large-tensor reduction's
bandwidth measured in the same run.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from pipeline.bench.setup import compose
from pipeline.export import graph_capture
from pipeline.models import build, zoo
from pipeline.models.inputs import make_example_inputs, random_ids, special_ids
from pipeline.runtime.engine import DemoLLM
from pipeline.runtime.requests import Request
from pipeline.runtime.sampling import SamplingParams
from pipeline.transforms import registry


def read_bandwidth_gbs(gib: float = 1.0, repeats: int = 5) -> float:
    """A large float32 reduction: bytes read / time, median after a warm-up."""
    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(times) / 1e9


def _decode_bytes(model: torch.nn.Module, lm_path: str) -> int:
    """Weights one decode step reads: the decoder layers and final norm (not the input embedding,
    of which a step reads B rows) and the lm_head."""
    lm = model.get_submodule(lm_path) if lm_path else model
    embedding = {id(p) for p in model.get_input_embeddings().parameters()}
    params = {id(p): p for p in lm.parameters() if id(p) not in embedding}
    head = model.get_output_embeddings()
    params |= {id(p): p for p in head.parameters()}
    return sum(p.numel() * p.element_size() for p in params.values())


def _hf_step_s(model, prompts: torch.Tensor, steps: int, repeats: int) -> float:
    """HF generate: (time for 1 + steps tokens - time for 1 token) / steps, median over repeats."""

    def timed(new_tokens: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                input_ids=prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
            )
        return time.perf_counter() - start

    timed(2)  # warm-up
    return statistics.median((timed(1 + steps) - timed(1)) / steps for _ in range(repeats))


def bench_decode(name: str, batches: list[int], prompt_len: int, steps: int, repeats: int) -> dict:
    cfg = compose([f"model={name}"])
    hf_config = zoo.build_hf_config(cfg.model)
    model_cls = zoo.resolve_model_class(cfg.model, hf_config)
    model, _ = build.build_random(model_cls, hf_config, torch.float32, torch.device("cpu"), seed=0)
    text_config = zoo.text_config_of(hf_config)
    lm_paths = graph_capture.find_language_models(model, text_config) if zoo.is_vlm(hf_config) else [""]
    weight_bytes = _decode_bytes(model, lm_paths[0])
    generator = torch.Generator().manual_seed(0)
    prompts = {
        b: random_ids((b, prompt_len), text_config.vocab_size, special_ids(hf_config), generator)
        for b in batches
    }

    hf = {b: _hf_step_s(model, prompts[b], steps, repeats) for b in batches}

    examples = make_example_inputs(hf_config, 2, None, torch.float32, torch.device("cpu"), seed=0)
    model, _ = graph_capture.capture(model, lm_paths, examples.image or examples.text)
    transforms = registry.parse(cfg.transforms)
    registry.run_transforms(model, transforms, registry.TransformHistory())
    engine = DemoLLM(model, hf_config, cfg.runtime, torch.device("cpu"), eos_ids=set())  # no early stop
    ours = {}
    for b in batches:
        ours[b], _ = _demollm_step_s(engine, prompts[b], steps, repeats)
    del model, engine
    gc.collect()
    bandwidth = read_bandwidth_gbs()
    rows = []
    for b in batches:
        rows.append(
            {
                "batch": b,
                "hf_eager_ms": 1000 * hf[b],
                "demollm_ms": 1000 * ours[b],
                "speedup": hf[b] / ours[b],
                "demollm_gbs": weight_bytes / ours[b] / 1e9,
                "hf_gbs": weight_bytes / hf[b] / 1e9,
            }
        )
    return {
        "model": name,
        "prompt_len": prompt_len,
        "steps": steps,
        "weight_bytes": weight_bytes,
        "read_bandwidth_gbs": bandwidth,
        "rows": rows,
    }


def _demollm_step_s(engine: DemoLLM, prompts: torch.Tensor, steps: int, repeats: int) -> tuple[float, float]:
    """(median decode step, median prefill) in seconds, after a warm-up generation."""
    requests = [Request(i, prompts[i].tolist()) for i in range(prompts.shape[0])]
    engine.generate(requests, steps + 1, SamplingParams(), seed=0)  # warm-up (and compile)
    runs = [engine.generate(requests, steps + 1, SamplingParams(), seed=0) for _ in range(repeats)]
    return statistics.median(statistics.median(r.decode_step_s) for r in runs), statistics.median(
        r.prefill_s for r in runs
    )


def bench_backends(name: str, batch: int, prompt_len: int, steps: int, repeats: int) -> dict:
    """Per backend, same weights and batch: HF eager, HF static cache + torch.compile, demollm
    with torch-simple and torch-compile."""
    from pipeline.backends.compile import compile_module

    cfg = compose([f"model={name}"])
    hf_config = zoo.build_hf_config(cfg.model)
    model, _ = build.build_random(
        zoo.resolve_model_class(cfg.model, hf_config), hf_config, torch.float32, torch.device("cpu"), seed=0
    )
    text_config = zoo.text_config_of(hf_config)
    generator = torch.Generator().manual_seed(0)
    prompts = random_ids((batch, prompt_len), text_config.vocab_size, special_ids(hf_config), generator)
    rows = {"HF eager generate": _hf_step_s(model, prompts, steps, repeats)}
    model.generation_config.cache_implementation = "static"
    model.forward = torch.compile(model.forward)
    rows["HF static cache + torch.compile"] = _hf_step_s(model, prompts, steps, repeats)
    del model.forward
    model.generation_config.cache_implementation = None

    lm_paths = graph_capture.find_language_models(model, text_config) if zoo.is_vlm(hf_config) else [""]
    examples = make_example_inputs(hf_config, 2, None, torch.float32, torch.device("cpu"), seed=0)
    model, _ = graph_capture.capture(model, lm_paths, examples.image or examples.text)
    registry.run_transforms(model, registry.parse(cfg.transforms), registry.TransformHistory())
    engine = DemoLLM(model, hf_config, cfg.runtime, torch.device("cpu"), eos_ids=set())
    rows["demollm torch-simple"], _ = _demollm_step_s(engine, prompts, steps, repeats)
    compile_module(engine.runner.graph)
    rows["demollm torch-compile"], _ = _demollm_step_s(engine, prompts, steps, repeats)
    eager = rows["HF eager generate"]
    return {
        "model": name,
        "batch": batch,
        "prompt_len": prompt_len,
        "steps": steps,
        "rows": [{"runner": k, "decode_ms": 1000 * v, "vs_hf_eager": v / eager} for k, v in rows.items()],
    }


def backends_markdown(result: dict) -> list[str]:
    lines = [
        f"## Decode per backend, `model={result['model']}` (float32, CPU, batch {result['batch']}, "
        f"prompt {result['prompt_len']} tokens)",
        "",
        "Same weights and batch, one process; median step after a warm-up. Target for torch-compile on "
        "CPU: at most 0.5x Hugging Face eager.",
        "",
        "| runner | decode ms/step | x HF eager |",
        "|---|---|---|",
    ]
    lines += [f"| {r['runner']} | {r['decode_ms']:.2f} | {r['vs_hf_eager']:.2f} |" for r in result["rows"]]
    return lines


def markdown(result: dict) -> list[str]:
    bw = result["read_bandwidth_gbs"]
    lines = [
        f"## Decode, `model={result['model']}` (float32, CPU, prompt {result['prompt_len']} tokens)",
        "",
        f"Measured read bandwidth: {bw:.1f} GB/s. A step reads {result['weight_bytes'] / 1e9:.2f} GB of weights "
        "(decoder layers, final norm, lm_head). Median step over "
        f"{result['steps']} decode steps.",
        "",
        "| batch | HF eager generate | demollm (uncompiled graph, attention=torch) | demollm vs HF | demollm bandwidth | HF bandwidth |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['batch']} | {r['hf_eager_ms']:.1f} ms | {r['demollm_ms']:.1f} ms | {r['speedup']:.2f}x | "
            f"{r['demollm_gbs']:.1f} GB/s ({100 * r['demollm_gbs'] / bw:.0f} %) | "
            f"{r['hf_gbs']:.1f} GB/s ({100 * r['hf_gbs'] / bw:.0f} %) |"
        )
    return lines
