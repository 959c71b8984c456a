"""`python -m pipeline.bench.tensor_parallel [--model mistral3] [--dtype bfloat16] [--device cpu|cuda]
[--worlds 1,2] [--repeats 5] [--steps 8] [--output FILE]`

Decode of the language model sharded over N ranks (the pipeline's own stages on every rank: load,
export, transforms with the shard transform, capture; demollm torch-simple) against one process.
On CPU the machine's cores are divided among the ranks (world 2: one thread each, world 1: two
threads), so the rows say what tensor parallelism costs and gains on one memory bus; on GPUs each
rank has its own device and memory.

Each block runs in its own processes (a world-2 rank with `runtime.tp_weights=whole` holds the
whole model beside its shards, so two blocks do not fit in memory together): world 1; each larger
world with the lm_head vocab-parallel (the shard transform's default) and replicated
(`transforms.shard.lm_head`), the measured choice, and with `runtime.tp_weights=shard` (each rank
allocates only its slices); world 1 again, so the drift of a noisy machine shows as the gap between
the two world-1 blocks. Each rank's peak resident memory (getrusage's ru_maxrss of its process,
less the read limit's buffer) says what a rank needs. Within a block: `repeats` samples after a warm-up, each the median decode step of
`steps` steps; a world's step is its slowest rank's. Beside the times, per rank: the bytes of
weights a step reads (its shards and its lm_head), the share of a profiled step spent in the
collectives (functional all_reduce / all_gather + wait_tensor, waits for the peer included), one
all-reduce of a decode step's activation alone and one all-gather of a step's logits alone (the
collectives' own latency). Beside them, the block's read limit: every rank reads a buffer of its
own at once, before and after the samples, so the table says what fraction of the bandwidth its
threads reach each world's step takes (what limits it).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline import REPO_ROOT
from pipeline.bench import rounds
from pipeline.bench.limits import ReadLimit
from pipeline.bench.machine import machine
from pipeline.bench.prepare import engine_of, prepared
from pipeline.graphs import eager_graphs
from pipeline.models import zoo
from pipeline.models.inputs import random_ids, special_ids
from pipeline.models.memory import decode_weight_bytes
from pipeline.parallel import free_port, join
from pipeline.runtime.requests import Request
from pipeline.runtime.sampling import SamplingParams

COLLECTIVES = (
    "_c10d_functional::all_reduce",
    "_c10d_functional::all_gather_into_tensor",
    "_c10d_functional::wait_tensor",
)
# Half the decode rows' buffer: a world-2 rank with the whole model beside its slices holds 8.6 GB of
# mistral3 in bfloat16, and two of them must fit this 23 GiB host with their buffers.
READ_LIMIT_GIB = 0.5
RESULTS = REPO_ROOT / "BENCHMARKS.tp.json"  # BENCHMARKS.md shows it (python -m pipeline.bench --render)


def _decode_s(engine, requests, steps: int) -> float:
    run = engine.generate(requests, steps + 1, SamplingParams(), seed=0)
    return statistics.median(run.decode_step_s)


def _collective_share(engine, requests, steps: int) -> float:
    """The share (%) of profiled decode steps' wall time spent in the functional collectives."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        engine.generate(requests, steps + 1, SamplingParams(), seed=0)
        wall_us = 1e6 * (time.perf_counter() - start)
    spent = sum(e.cpu_time_total for e in prof.key_averages() if e.key in COLLECTIVES)
    return 100 * spent / wall_us


def _collective_us(op: str, shape: tuple[int, ...], dtype, device: torch.device, repeats: int = 200) -> float:
    """One collective alone, median over repeats: `all_reduce` of a decode step's activation (what
    every sharded region ends with) or `all_gather` of a rank's share of the logits (what a
    vocab-parallel lm_head would add per step)."""
    x = torch.ones(shape, dtype=dtype, device=device)
    gathered = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(x) if op == "all_reduce" else dist.all_gather(gathered, x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(1e6 * (time.perf_counter() - start))
    return statistics.median(times)


def _read_gbs(limit: ReadLimit, world: int) -> float:
    """This rank's read bandwidth, every rank of the world reading its own buffer at once (a barrier
    starts them together): on one memory bus, the ranks' rates add up to what the world reads."""
    if world > 1:
        dist.barrier()
    return limit.measure()


def _rank(rank: int, world: int, port: int, args: dict, threads: int, extra: list[str], results) -> None:
    """One rank of a world (world 1: the process alone): prepare, warm up, sample, profile."""
    device = torch.device(args["device"], rank) if args["device"] == "cuda" else torch.device("cpu")
    torch.set_num_threads(threads)
    try:
        if world > 1:
            join(rank, world, f"tcp://127.0.0.1:{port}", 600, device.type == "cuda", rank)
        # allocated before the model (a buffer in freshly freed memory reads slower: limits.ReadLimit)
        limit = ReadLimit(READ_LIMIT_GIB, device)
        dtype = getattr(torch, args["dtype"])
        overrides = [f"model={args['model']}", "capture=partial", "backend=torch-simple", *extra]
        overrides += [f"runtime.world_size={world}"] if world > 1 else []  # the job each rank runs
        with prepared(overrides, dtype, device, "capture") as state:
            engine = engine_of(state)
            text = zoo.text_config_of(state.hf_config)
            generator = torch.Generator().manual_seed(0)
            prompts = random_ids(
                (args["batch"], args["prompt_len"]), text.vocab_size, special_ids(state.hf_config), generator
            )
            requests = [Request(i, prompts[i].tolist()) for i in range(prompts.shape[0])]
            _decode_s(engine, requests, 2)  # warm-up
            read_before = _read_gbs(limit, world)
            samples = [_decode_s(engine, requests, args["steps"]) for _ in range(args["repeats"])]
            read_after = _read_gbs(limit, world)
            result = {
                "rank": rank,
                "step_s": samples,
                "read_gbs": (read_before + read_after) / 2,
                "weight_bytes": decode_weight_bytes(state.model, state.model_info.language_model_paths[0]),
                "regions": state.transform_history.matches("shard") if state.transform_history else 0,
            }
            if world > 1:
                result["collective_pct"] = _collective_share(engine, requests, args["steps"])
                result["all_reduce_us"] = _collective_us(
                    "all_reduce", (args["batch"], 1, text.hidden_size), dtype, device
                )
                vocab_share = (args["batch"], 1, text.vocab_size // world)
                result["all_gather_logits_us"] = _collective_us(
                    "all_gather", vocab_share, torch.float32, device
                )
            with eager_graphs(state.model) as eager:  # HF's accessor walks the eager modules
                head = eager.get_output_embeddings()
            result["lm_head_bytes"] = sum(p.numel() * p.element_size() for p in head.parameters())
        # Linux: KiB. Less the read limit's buffer, resident from before the load to the end: what
        # the rank needs, not what the bench added
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        result["peak_rss_bytes"] = peak - limit.buffer.numel() * limit.buffer.element_size()
        results.put(result)
    except Exception as exc:
        results.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_block(label: str, world: int, args: dict, extra: list[str] = ()) -> dict:
    """A block in fresh processes: its ranks' results, each sample's step the slowest rank's."""
    threads = args["threads"] if args["device"] == "cuda" else max(1, args["threads"] // world)
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [
        context.Process(target=_rank, args=(r, world, port, args, threads, list(extra), results))
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    ranks = sorted((results.get(timeout=3600) for _ in procs), key=lambda r: r["rank"])
    for proc in procs:
        proc.join(timeout=120)
    block = {"label": label, "world": world, "threads": threads}
    if errors := [r["error"] for r in ranks if "error" in r]:
        return {**block, "error": errors[0]}
    steps = [max(values) for values in zip(*(r["step_s"] for r in ranks), strict=True)]
    step_ms = rounds.spread([1000 * s for s in steps])
    read_gbs = sum(r["read_gbs"] for r in ranks)  # the ranks read at once: their rates add up
    weights_gbs = sum(r["weight_bytes"] for r in ranks) / (step_ms["median"] / 1000) / 1e9
    return {
        **block, "step_ms": step_ms, "ranks": ranks, "read_gbs": read_gbs, "read_pct": 100 * weights_gbs / read_gbs,
    }  # fmt: skip


def bench(args: dict) -> dict:
    """world 1; each larger world, lm_head vocab-parallel and replicated, and holding only its
    slices; world 1 again."""
    blocks = [run_block("world 1", 1, args)]
    for world in (w for w in args["worlds"] if w > 1):
        blocks.append(run_block(f"world {world}, lm_head vocab-parallel", world, args))
        replicated = ["transforms.shard.lm_head=replicated"]
        blocks.append(run_block(f"world {world}, lm_head replicated", world, args, replicated))
        slices = ["runtime.tp_weights=shard", "profile.reference=none"]  # as the CLI takes it
        blocks.append(run_block(f"world {world}, only its slices allocated", world, args, slices))
    blocks.append(run_block("world 1 again", 1, args))

    return {**args, "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "blocks": blocks}


def _per_rank(ranks: list[dict], key: str, scale: float, fmt: str) -> str:
    return ", ".join(format(r[key] / scale, fmt) for r in ranks if key in r) or "-"


def markdown(result: dict) -> str:
    lines = [
        f"## Tensor parallelism, `model={result['model']}` ({result['dtype']}, {result['device']}, batch "
        f"{result['batch']}, prompt {result['prompt_len']} tokens, demollm torch-simple)",
        "",
        f"Recorded {result['date']}{' on ' + result['machine']['isa'] if 'machine' in result else ''} with `make bench-tp` (`python -m pipeline.bench.tensor_parallel`, saved in "
        f"{RESULTS.name}); blocks in this order, each in fresh processes, {result['repeats']} samples of "
        f"{result['steps']} decode steps after a warm-up; per-rank values separated by commas; a world's step "
        "is its slowest rank's; x world 1: its median over the mean of the world-1 blocks' medians. "
        f"Read limit: each rank reads a {READ_LIMIT_GIB:g} GiB float32 buffer of its own before and after "
        "the samples, all ranks at once, with the rank's threads (the mean of the two; the ranks' rates "
        "summed); % of read limit: the weights all ranks read per step over the median step, against it. "
        "Peak memory: a rank's peak resident set, less its read buffer."
        + (
            " GPU worlds: `--device cuda --worlds 1,2,4,8` on a machine with that many GPUs."
            if result["device"] == "cpu"
            else ""
        ),
        "",
        "| block | threads/rank | decode ms/step (p10-p90) | x world 1 | weights read/step GB | "
        "of which lm_head GB | read limit GB/s, ranks together | % of read limit | "
        "collectives' share of a step % | one all-reduce us | one logits all-gather us | peak memory GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    world_1 = [b["step_ms"]["median"] for b in result["blocks"] if b["world"] == 1 and "step_ms" in b]
    for block in result["blocks"]:
        if "error" in block:
            lines.append(f"| {block['label']} | {block['threads']} | failed: {block['error']} |" + " |" * 9)
            continue
        step, ranks = block["step_ms"], block["ranks"]
        noisy = " NOISY" if rounds.is_noisy(step) else ""
        # older records have no read limit
        read = f"{block['read_gbs']:.1f} | {block['read_pct']:.0f} %" if "read_gbs" in block else "- | -"
        ratio = f"{step['median'] / statistics.mean(world_1):.2f}" if world_1 else "-"
        lines.append(
            f"| {block['label']} | {block['threads']} | {step['median']:.1f} ({step['p10']:.1f}-"
            f"{step['p90']:.1f}){noisy} | {ratio} | {_per_rank(ranks, 'weight_bytes', 1e9, '.3g')} | "
            f"{_per_rank(ranks, 'lm_head_bytes', 1e9, '.3g')} | {read} | {_per_rank(ranks, 'collective_pct', 1, '.1f')} | "
            f"{_per_rank(ranks, 'all_reduce_us', 1, '.0f')} | {_per_rank(ranks, 'all_gather_logits_us', 1, '.0f')} | "
            f"{_per_rank(ranks, 'peak_rss_bytes', 1e9, '.3g')} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mistral3")
    parser.add_argument(
        "--dtype", default="bfloat16", help="bfloat16: two float32 ranks of mistral3 do not fit 24 GiB"
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--worlds", default="1,2")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="the machine's, divided on CPU"
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    ns = parser.parse_args()
    args = {
        "model": ns.model, "dtype": ns.dtype, "device": ns.device, "worlds": [int(w) for w in ns.worlds.split(",")],
        "batch": ns.batch, "prompt_len": ns.prompt_len, "steps": ns.steps, "repeats": ns.repeats,
        "threads": ns.threads,
    }  # fmt: skip
    result = bench(args)
    ns.output.parent.mkdir(parents=True, exist_ok=True)
    ns.output.write_text(json.dumps(result, indent=1))
    print(markdown(result))
    print(f"written: {ns.output}")


if __name__ == "__main__":
    main()
