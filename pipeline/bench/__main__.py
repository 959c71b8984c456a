"""`python -m pipeline.bench [--model NAME] [--repeats N] [--no-reference] [--decode-batches 1,4] [--output FILE]`

Rows: model load (our meta-device random init against Hugging Face's own init), export of the
language model, decode (Hugging Face eager generate against demollm, against the read bandwidth
and the GEMV pass measured in every round) for the default `model=mistral3` configuration in
float32 and bfloat16 and for a mixture-of-experts model (`--moe-model`, routed experts against
all), the per-backend rows of a small dense and a small MoE configuration, the host work per step,
prefill against the GEMM rate, and whole `make run`s. Ratios per round, medians with p10-p90; the
machine, its load and the library versions are printed with the results.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pipeline import REPO_ROOT
from pipeline.backend_specs import SPECS
from pipeline.bench import decode, engine_work, pipeline_run, prefill, rounds, setup, tensor_parallel
from pipeline.bench.load import SPILL_FRACTION, TOUCH_HEADROOM, bench_load
from pipeline.bench.machine import machine
from pipeline.bench.prepare import prepared
from pipeline.export import graph_capture
from pipeline.runtime.machine_load import MachineLoad


def bench_export(name: str, repeats: int) -> dict:
    """torch.export of the language model (text models: the whole model) from the call the export
    stage uses, repeated on the same eager module (nothing is swapped in)."""
    with prepared([f"model={name}"], torch.float32, torch.device("cpu")) as state:
        info = state.model_info
        path = info.language_model_paths[0] if info.is_vlm else ""
        times = _export_s(state, path, repeats)
    return {"submodule": path or "root", "export_s": rounds.spread(times)}


def _export_s(state, path: str, repeats: int) -> list[float]:
    call = state.example_inputs.image or state.example_inputs.text
    recorded = (
        graph_capture.record_calls(state.model, [path], call)[path]
        if path
        else graph_capture.RecordedCall(dict(call))
    )
    module = state.model.get_submodule(path) if path else state.model
    batch, seq = call["input_ids"].shape
    return [graph_capture.export_module(module, path, recorded, batch, seq).export_s for _ in range(repeats)]


CPU_BACKENDS = [name for name, s in SPECS.items() if not s.cuda_only]
GPU_BACKENDS = list(SPECS)
ENGINE_WORK_BACKENDS = ["torch-simple", "torch-cudagraph"]
CPU_TARGET = "torch-compile at most 0.5x Hugging Face eager per token on the small configuration"
GPU_TARGET = "torch-cudagraph at least 4x faster than Hugging Face eager at batch 1 on mistral3"


def _header(info: dict, date: str) -> str:
    return (
        f"Machine: {info['cpu']}{' (' + info['isa'] + ')' if 'isa' in info else ''}, {info['cores']} threads, "
        f"GPU: {info['gpu']}; torch {info['torch']}, "
        f"transformers {info['transformers']}, Python {info['python']}. Date: {date}."
    )


def machine_load() -> dict[str, float]:
    """/proc/loadavg's 1-minute load average (runnable processes, this one included)."""
    try:
        return {"loadavg_1m": float(Path("/proc/loadavg").read_text().split()[0])}
    except (OSError, ValueError, IndexError):
        return {}


def _load_line(load: dict) -> str:
    return (
        f"Machine load during the bench: other processes kept {load['other_cores']:.2f} cores busy on "
        f"average (system-wide busy CPU time less the bench's own, from /proc via psutil); 1-minute "
        f"load average {load.get('start', {}).get('loadavg_1m', float('nan')):.2f} at the start, "
        f"{load.get('end', {}).get('loadavg_1m', float('nan')):.2f} at the end."
    )


def gpu_markdown(gpu: dict) -> list[str]:
    lines = [
        "# On a GPU",
        "",
        f"Recorded with `python -m pipeline.bench --device cuda` (saved in {GPU_RESULTS.name}). "
        + _header(gpu["machine"], gpu["date"]),
    ]
    for result in gpu.get("backends", []):
        lines += ["", *decode.backends_markdown(result, GPU_TARGET)]
    if "piecewise" in gpu:
        lines += ["", *prefill.piecewise_markdown(gpu["piecewise"])]
    return lines


def _overhead_markdown(model: str, results: dict) -> list[str]:
    lines = [
        f"## Pipeline overhead, `model={model}` (float32, CPU)",
        "",
        "| step | ours | reference | target | ratio |",
        "|---|---|---|---|---|",
    ]
    if "load" in results:
        load = results["load"]
        hf = (
            f"{_spread_or_value(load['hf_init_s'], 1, ' s')} (Hugging Face init)"
            if "hf_init_s" in load
            else "not measured"
        )
        speedup = load.get("speedup")
        per_round = " (per round)" if isinstance(speedup, dict) else ""
        ratio = (
            f"{_spread_or_value(speedup, 1, 'x')} faster{per_round}{_noisy(speedup)}"
            if speedup is not None
            else "-"
        )
        lines.append(
            f"| load, random init ({load['params']:,} params) | {rounds.shown(load['ours_s'], 1, ' s')} | {hf} | "
            f"< {load['target_s']:.0f} s | {ratio} |"
        )
        if "ours_touched_s" in load:  # both loads again on memory touched first (older records lack it)
            touched = load.get("speedup_touched")
            hf_touched = (
                _spread_or_value(load["hf_init_touched_s"], 1, " s") if "hf_init_touched_s" in load else "-"
            )
            spilled = load.get("touched_rounds_spilled", 0)
            # a round where a touched load faulted in more than its allowance has no ratio (load.py)
            dropped = (
                f", {spilled} of {load['ours_touched_s']['n']} rounds without one (a load spilled off "
                "its touched block)"
                if spilled
                else ""
            )
            lines.append(
                f"| load on memory touched first (the touch: {rounds.shown(load['touch_gbs'], 2, ' GB/s')}) | "
                f"{rounds.shown(load['ours_touched_s'], 1, ' s')} | {hf_touched} | - | "
                f"{_spread_or_value(touched, 1, 'x') + ' faster (per round)' + _noisy(touched) if touched else '-'}"
                f"{dropped} |"
            )
    if "export" in results:
        export = results["export"]
        lines.append(
            f"| export of `{export['submodule']}` | {rounds.shown(export['export_s'], 1, ' s')} | - | - | - |"
        )
    if results.get("load", {}).get("processes") == "fresh":
        lines += [
            "",
            f"Each load sample is the first load of a fresh process, as a run loads once; "
            f"{results['load']['ours_s']['n']} rounds, ours and Hugging Face's init taking turns, the ratio "
            "taken within each round."
            + (
                " Each round also loads both in two more fresh processes that first allocate and zero "
                f"{TOUCH_HEADROOM:g} times the model's bytes in one block and free it into a heap that keeps "
                "it: the touch every load pays for its memory, which can move by itself on a virtual machine, "
                "timed apart from the init work, "
                f"whose ratio is the second row's; a touched load that faulted in more than {SPILL_FRACTION:.0%} "
                "of the model's bytes landed off the block, and its round has no such ratio "
                "(pipeline/bench/load.py)."
                if "ours_touched_s" in results["load"]
                else ""
            )
            # a row taken over from a partial run (`--rows load`) says which
            + (f" Measured {results['load']['measured']}." if "measured" in results["load"] else ""),
        ]
    return lines


def markdown(model: str, results: dict, gpu: dict | None) -> str:
    """BENCHMARKS.md from a run's results; a block `--rows` left out is left out here too."""
    partial = is_part(results.get("rows", ROWS))  # TP and GPU rows left out below
    lines = [
        "# Benchmarks",
        "",
        "Regenerated by `make bench` (`python -m pipeline.bench`). Every figure is "
        "the median over rounds or repeats with its p10-p90 in brackets; every ratio (to Hugging Face, "
        "to a limit) is taken within a round, where the machine's drift is shared (pipeline/bench/"
        "rounds.py). A row marked NOISY spread too wide to be a result.",
        "",
        _header(results["machine"], results["date"]),
        "",
        _load_line(results["machine_load"]),
    ]
    if partial:
        lines += ["", f"A part of the bench: `--rows {','.join(results['rows'])}`."]
    if "load" in results or "export" in results:
        lines += ["", *_overhead_markdown(model, results)]
    for result in results.get("decode", []):
        lines += ["", *decode.markdown(result)]
    if "moe_left_out" in results:
        left_out = results["moe_left_out"]
        lines += ["", f"## Decode, `model={left_out['model']}` (bfloat16, CPU)", "", f"{left_out['reason']}."]
    for result in results.get("backends", []):
        lines += ["", *decode.backends_markdown(result, CPU_TARGET)]
    if "engine_work" in results:
        lines += ["", *engine_work.markdown(results["engine_work"])]
    if "prefill" in results:
        lines += ["", *prefill.markdown(results["prefill"])]
    if "piecewise" in results:
        lines += ["", *prefill.piecewise_markdown(results["piecewise"])]
    if "run" in results:
        lines += ["", *pipeline_run.markdown(results["run"])]
    if results.get("plot"):
        lines += ["", f"![benchmarks]({results['plot']})"]
    if tensor_parallel.RESULTS.exists() and not partial:  # `make bench-tp`, a run of its own
        lines += ["", tensor_parallel.markdown(json.loads(tensor_parallel.RESULTS.read_text())).strip()]
    if setup.RESULTS.exists() and not partial:  # `make bench-setup`, a run of its own
        lines += ["", setup.markdown(json.loads(setup.RESULTS.read_text())).strip()]
    if gpu and not partial:
        lines += ["", *gpu_markdown(gpu)]
    return "\n".join(lines) + "\n"


def _noisy(value) -> str:
    """` NOISY` after a per-round ratio that spread too wide to be a result (rounds.NOISY_ROUND_SPREAD)."""
    return " NOISY" if isinstance(value, dict) and rounds.is_noisy(value) else ""


def _spread_or_value(value, digits: int, unit: str) -> str:
    """A spread as `median (p10-p90)`; a plain number (results of runs before the load row took
    turns) as it is."""
    return rounds.shown(value, digits, unit) if isinstance(value, dict) else f"{value:.{digits}f}{unit}"


GPU_RESULTS = REPO_ROOT / "BENCHMARKS.gpu.json"
DEFAULT_OUTPUT = REPO_ROOT / "BENCHMARKS.md"
DEFAULT_PLOT = REPO_ROOT / "outputs" / "readme" / "benchmarks.png"


def plot(results: dict, path: Path) -> bool:
    """Decode per runner (x HF eager, per model) and the percent-of-limit rows, side by side; False
    when the results hold neither (nothing drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    rows = [
        {"model": b["model"], "runner": r["runner"], "x HF eager": r["vs_reference"]["median"]}
        for b in results.get("backends", [])
        for r in b["rows"]
        if "vs_reference" in r
    ]
    limits = [
        {
            "row": f"{decode.label(results, d)} b{r['batch']} {runner['runner']}",
            "% of limit": runner["pct_of_gemv"]["median"],
        }
        for d in results.get("decode", [])
        for r in d["rows"]
        for runner in r["runners"]
    ] + [
        {"row": f"prefill {r['tokens']}", "% of limit": r["pct_of_gemm"]["median"]}
        for r in results.get("prefill", {}).get("rows", [])
    ]
    panels = [
        (rows, "decode step time, x Hugging Face eager per round, median (lower is faster)"),
        (limits, "% of the round's limit, median\n(decode: GEMV pass; prefill: GEMM)"),
    ]
    panels = [(pd.DataFrame(data), title) for data, title in panels if data]  # a part of the bench: fewer
    if not panels:
        return False
    sns.set_theme(style="whitegrid")
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 5), squeeze=False)
    for ax, (data, title) in zip(axes[0], panels, strict=True):
        if "x HF eager" in data:
            sns.barplot(data, y="runner", x="x HF eager", hue="model", ax=ax, orient="h")
            ax.axvline(1.0, color="#333", linewidth=0.8)
        else:
            sns.barplot(data, y="row", x="% of limit", ax=ax, orient="h", color="#4c72b0")
        ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


ROWS = ("load", "export", "decode", "moe", "backends", "engine_work", "prefill", "piecewise", "run")


def is_part(rows) -> bool:
    """Whether `rows` leave out some of the bench's blocks."""
    return set(rows) != set(ROWS)


def parse_rows(text: str, output: Path) -> list[str]:
    """The blocks `--rows` names, checked before anything is measured; a part of the bench may not
    overwrite the full table in BENCHMARKS.md."""
    rows = [r for r in text.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown or not rows:
        raise SystemExit(f"--rows: unknown block(s) {unknown or [text]}; choose from {','.join(ROWS)}")
    if is_part(rows) and output.resolve() == DEFAULT_OUTPUT.resolve():
        raise SystemExit(
            "--rows measures a part of the bench: pass --output FILE.md (BENCHMARKS.md holds the full table)"
        )
    return [r for r in ROWS if r in rows]


def plot_link(drawn: Path, output: Path) -> str:
    """The figure as the markdown at `output` links it: relative to its folder where it lies below."""
    drawn, folder = drawn.resolve(), output.resolve().parent
    return str(drawn.relative_to(folder)) if drawn.is_relative_to(folder) else str(drawn)


def plot_path(given: Path | None, output: Path) -> Path:
    """--plot, else BENCHMARKS.md's figure for BENCHMARKS.md and FILE.png beside any other FILE.md: a
    run kept aside for comparison leaves BENCHMARKS.md's figure alone."""
    return given or (
        DEFAULT_PLOT if output.resolve() == DEFAULT_OUTPUT.resolve() else output.with_suffix(".png")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mistral3")
    parser.add_argument("--repeats", type=int, default=5, help="rounds (repeats) after a warm-up")
    parser.add_argument("--no-reference", action="store_true", help="skip Hugging Face's own (slow) init")
    parser.add_argument(
        "--load-rounds",
        type=int,
        default=5,
        help="rounds of our load and Hugging Face's init, each in a fresh process (about 65 s a round)",
    )
    parser.add_argument("--decode-batches", default="1,4")
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument(
        "--decode-processes",
        type=int,
        default=3,
        help="fresh processes the decode rows' rounds are split over (--repeats in all, rounded up)",
    )
    parser.add_argument("--decode-dtypes", default="float32,bfloat16")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt of the per-backend rows")
    # The decode rows time decode steps; their samples' prefills only fill the cache. On a CPU
    # without oneDNN bf16 a 128-token prefill at batch 4 runs ATen's bf16 loops (about 1 TFLOP for
    # mistral3's two layers): one bfloat16 process of the decode rows had not finished after 16 min.
    parser.add_argument("--decode-prompt-len", type=int, default=32, help="prompt of the decode rows")
    # The per-backend rows' steps take 4-8 ms: 8 steps a sample and 5 rounds moved their ratios
    # to HF by 10 % between runs (0.941 -> 1.04), 32 steps and 15 rounds by 4.5 % over three runs.
    parser.add_argument("--backend-steps", type=int, default=32, help="decode steps a per-backend sample")
    parser.add_argument("--backend-repeats", type=int, default=15, help="rounds of the per-backend rows")
    parser.add_argument(
        "--small-model", default="small_mistral", help="overhead-bound model for the per-backend rows"
    )
    parser.add_argument(
        "--small-moe-model", default="small_mixtral", help="mixture-of-experts model for the per-backend rows"
    )
    parser.add_argument(
        "--moe-model",
        default="llama4_scout",
        help="mixture-of-experts decode rows in bfloat16, routed experts against all ('' for none)",
    )
    # Hugging Face's Llama-4 prefill runs all 16 experts on every token: seconds for 128 tokens
    parser.add_argument("--moe-prompt-len", type=int, default=16)
    # Batch 4 of llama4_scout (15.3 GB of bfloat16 weights) fits 24 GiB only because Hugging Face's
    # prefill does not copy its lm_head per sequence (decode._hf_sample, logits_to_keep).
    parser.add_argument("--moe-batches", default="1,4")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: only the per-backend rows, in bfloat16, saved to BENCHMARKS.gpu.json and shown in "
        "BENCHMARKS.md by every later CPU run",
    )
    parser.add_argument(
        "--engine-model",
        default="tiny_mistral3",
        help="the seed's layout at tiny size, for the host-work counts",
    )
    parser.add_argument("--prefill-tokens", default="128,1024")
    parser.add_argument(
        "--piecewise-tokens",
        default="128,1000",
        help="prompt lengths of the piecewise prefill rows: one at a bucket, one padded to the next",
    )
    parser.add_argument("--run-repeats", type=int, default=3, help="whole `make run`s, one after another")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument(
        "--render",
        action="store_true",
        help="measure nothing: write the markdown and the plot again from the output's .json",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        help=f"default: {DEFAULT_PLOT.relative_to(REPO_ROOT)} for BENCHMARKS.md, FILE.png for --output FILE.md",
    )
    parser.add_argument(
        "--rows",
        default=",".join(ROWS),
        help=f"the blocks to measure, comma-separated, of {','.join(ROWS)} (a part of them needs --output)",
    )
    args = parser.parse_args()
    if args.render:
        results = json.loads(args.output.with_suffix(".json").read_text())
        drawn = plot_path(args.plot, args.output)
        # linked from where this markdown lies: the .json may be a run kept elsewhere
        if plot(results, drawn):
            results["plot"] = plot_link(drawn, args.output)
        gpu = json.loads(GPU_RESULTS.read_text()) if GPU_RESULTS.exists() else None
        args.output.write_text(markdown(results["model"], results, gpu))
        return
    models = [args.small_model, args.model]
    if args.device == "cuda":
        # The GPU blocks: the per-backend decode rows and the piecewise prefill rows. A part of them
        # (--rows) keeps the other block of the record as it was.
        wanted = [r for r in args.rows.split(",") if r in ("backends", "piecewise")]
        if not wanted:
            raise SystemExit(f"--device cuda --rows {args.rows}: the GPU blocks are backends and piecewise")
        kept = json.loads(GPU_RESULTS.read_text()) if GPU_RESULTS.exists() and len(wanted) < 2 else {}
        gpu = {**kept, "machine": machine(), "date": time.strftime("%Y-%m-%d")}
        if "backends" in wanted:
            gpu["backends"] = []
            for name in reversed(models):  # the default model first: its row carries the GPU target
                gpu["backends"].append(
                    decode.bench_backends(
                        name,
                        1,
                        args.prompt_len,
                        args.backend_steps,
                        args.backend_repeats,
                        torch.device("cuda"),
                        torch.bfloat16,
                        GPU_BACKENDS,
                        stepped=["torch-cudagraph"],
                        without_kernels=["torch-cudagraph"],
                    )
                )
                GPU_RESULTS.write_text(json.dumps(gpu, indent=2))  # each model as soon as it is done
        if "piecewise" in wanted:
            gpu["piecewise"] = prefill.bench_piecewise_prefill(
                args.model, [int(t) for t in args.piecewise_tokens.split(",")], args.repeats,
                torch.device("cuda"), torch.bfloat16,
            )  # fmt: skip
            GPU_RESULTS.write_text(json.dumps(gpu, indent=2))
        print("\n".join(gpu_markdown(gpu)))
        return
    rows = parse_rows(args.rows, args.output)
    if args.decode_processes < 1:
        raise SystemExit(f"--decode-processes {args.decode_processes}: pass 1 or more (fresh processes)")
    batches = [int(b) for b in args.decode_batches.split(",")]
    # First, while this process holds no model: the whole run (its memory check must see the
    # machine's free memory) and the read bandwidth.
    whole_run = (
        pipeline_run.bench_pipeline_run([f"model={args.model}", "capture=partial"], args.run_repeats)
        if "run" in rows
        else None
    )
    load_start = machine_load()
    results = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "model": args.model, "rows": rows}
    with MachineLoad() as busy:  # other processes' CPU time while the rows run
        if "load" in rows:
            results["load"] = bench_load(args.model, args.load_rounds, not args.no_reference)
        if "export" in rows:
            results["export"] = bench_export(args.model, args.repeats)
        decodes = [
            (args.model, batches, args.decode_prompt_len, getattr(torch, d))
            for d in args.decode_dtypes.split(",")
        ]
        moe = [int(b) for b in args.moe_batches.split(",")]
        moe_left_out = (
            decode.moe_rows_unaffordable(torch.bfloat16) if "moe" in rows and args.moe_model else ""
        )
        if moe_left_out:
            results["moe_left_out"] = {"model": args.moe_model, "reason": moe_left_out}
        decodes = (decodes if "decode" in rows else []) + (
            [(args.moe_model, moe, args.moe_prompt_len, torch.bfloat16)]
            if "moe" in rows and args.moe_model and not moe_left_out
            else []
        )
        if decodes:
            per_process = -(-args.repeats // args.decode_processes)
            results["decode"] = [
                decode.bench_decode(
                    name, sizes, prompt_len, args.decode_steps, per_process, dtype, args.decode_processes
                )
                for name, sizes, prompt_len, dtype in decodes
            ]
        if "backends" in rows:
            # The small configurations only: on this 24 GiB machine the default configuration's HF
            # static cache + torch.compile row (2.9 B float32, Inductor) ran the process out of memory.
            results["backends"] = [
                decode.bench_backends(
                    name,
                    1,
                    args.prompt_len,
                    args.backend_steps,
                    args.backend_repeats,
                    torch.device("cpu"),
                    torch.float32,
                    CPU_BACKENDS,
                    f_linear=["torch-simple"],
                )
                for name in (args.small_model, args.small_moe_model)
            ]
        if "engine_work" in rows:
            results["engine_work"] = engine_work.bench_engine_work(
                args.engine_model, batches, ENGINE_WORK_BACKENDS
            )
        if "prefill" in rows:
            results["prefill"] = prefill.bench_prefill(
                args.model, [int(t) for t in args.prefill_tokens.split(",")], args.repeats
            )
        if "piecewise" in rows:
            results["piecewise"] = prefill.bench_piecewise_prefill(
                args.model, [int(t) for t in args.piecewise_tokens.split(",")], args.repeats,
                torch.device("cpu"), torch.float32,
            )  # fmt: skip
        if whole_run is not None:
            results["run"] = whole_run
    results["machine_load"] = {"other_cores": busy.other_cores, "start": load_start, "end": machine_load()}
    drawn = plot_path(args.plot, args.output)
    if plot(results, drawn):
        results["plot"] = plot_link(drawn, args.output)
    gpu = json.loads(GPU_RESULTS.read_text()) if GPU_RESULTS.exists() else None
    args.output.write_text(markdown(args.model, results, gpu))
    args.output.with_suffix(".json").write_text(json.dumps(results, indent=2))
    print(args.output.read_text())


if __name__ == "__main__":
    main()
