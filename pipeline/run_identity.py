"""What a run is called and what it is compared by: its MLflow name, the few params a person
compares, and the one-line description.

Names: the values that tell a run apart, joined by `·` (`mistral3·partial·compile`); a sweep's
child by the values it sweeps only (`qwen3·none`, the models' common prefix `tiny_` left out).
The MLflow UI's runs table gives a name 122 px (a child, indented, 98 px) of 12 px system sans
before it cuts it: measured in Chromium at 1600 px (tests/test_browser.py checks it). A name that
would not fit takes the short forms of capture and backend (`part`, `tc`: docs/mlflow.md).
"""

from __future__ import annotations

import itertools
import os

from pipeline.backend_specs import SPECS
from pipeline.config import PipelineConfig
from pipeline.devices import dtype_name

SEPARATOR = "·"
TOP_LEVEL_PX = 122  # the run-name cell's text width, top-level run
NESTED_PX = 98  # a child under its expanded parent
LEVELS = 5  # shortening levels of a name (_word)

# Glyph advance widths in px of the UI's 12 px font, as Chromium measures them here (canvas
# measureText); other characters count as the widest.
_GLYPH_PX = {
    **dict.fromkeys("ijl", 2.666),
    **dict.fromkeys("ft.:,·", 3.334),
    "|": 3.117,
    **dict.fromkeys("r-", 3.996),
    **dict.fromkeys("cksvxyz", 6.0),
    **dict.fromkeys("abdeghnopqu0123456789_", 6.674),
    **dict.fromkeys("=×", 7.008),
    "w": 8.666,
    "m": 9.996,
}

# Full and short forms of what capture and backend put into a name.
CAPTURE_WORD = {"partial": ("partial", "part"), "full": ("full", "full"), "none": ("eager", "eager")}
_WORDS = {"capture": CAPTURE_WORD, "capture.mode": CAPTURE_WORD}
BACKEND_KEYS = ("backend", "backend.name")  # their words are the backend's spec's


GROUPS = ("model", "capture", "backend", "attention", "runtime", "transforms")  # a value says its key
# Switches a single run's name says when they are on (a sweep's child says each swept one, on or off)
SWITCHES = ("backend.piecewise", "profile.waterfall")


def text_px(text: str) -> float:
    return sum(_GLYPH_PX.get(c, 10.0) for c in text)


def _word(key: str, value: str, level: int) -> str:
    """A piece of a name at shortening level 0 (full words), 1 (capture short), 2 (backend short),
    3 (a plain key by its initials: batch_size=4 -> bs=4), 4 (a switch that is off left out, as a
    single run's name leaves it out: `w`, nothing)."""
    if forms := _WORDS.get(key):
        return forms.get(value, (value, value))[1 if level >= 1 else 0]
    if key in BACKEND_KEYS and value in SPECS:
        return SPECS[value].short if level >= 2 else SPECS[value].word
    if key.split(".")[0] in GROUPS and key not in SWITCHES:
        return value
    leaf = key.rsplit(".", 1)[-1]
    short = "".join(p[0] for p in leaf.split("_") if p) if level >= 3 else leaf
    if value.lower() in ("true", "false"):  # a switch by its name: `waterfall` / `no-waterfall`
        if value.lower() == "true":
            return short
        return "" if level >= 4 else f"no-{short}"
    return f"{short}={value}"


def _joined(pieces: list[tuple[str, str]], level: int) -> str:
    return SEPARATOR.join(word for k, v in pieces if (word := _word(k, v, level)))


def fitted(pieces: list[tuple[str, str]], budget_px: int) -> str:
    """(key, value) pieces as a name: the least shortened one that fits the budget (a model name
    too long for the column on its own still gets cut)."""
    for level in range(LEVELS - 1):  # a single run's switches are on: level 4 changes nothing
        name = _joined(pieces, level)
        if text_px(name) <= budget_px:
            break
    return name


def run_name(cfg: PipelineConfig, backend: str) -> str:
    """A single run: model, capture mode, (unless eager) the resolved backend, and the switches on
    (`piecewise`, `waterfall`)."""
    pieces = [("model", cfg.model.name), ("capture", cfg.capture.mode)]
    if cfg.capture.mode != "none":
        pieces.append(("backend", backend))
    pieces += [(key, "true") for key in SWITCHES if _setting(cfg, key)]
    return fitted(pieces, TOP_LEVEL_PX)


def _setting(cfg: PipelineConfig, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _common_prefix(values: list[str]) -> str:
    """The part every value starts with, up to a `_` (tiny_qwen3, tiny_gemma2 -> tiny_)."""
    prefix = os.path.commonprefix(values)
    return prefix[: prefix.rfind("_") + 1] if len(values) > 1 else ""


def child_name(chosen: list[tuple[str, str]], swept: dict[str, list[str]]) -> str:
    """A sweep's job: its value of each swept key, in the sweep's order. Config groups (model,
    capture, backend, attention) give the value alone, switches their name or `no-<name>`
    (`waterfall`, `no-waterfall`), other keys `leaf=value`; a prefix all swept values of a key
    share is left out. Every job of a sweep takes the same shortening: the least at which all of
    them fit a child's width and stay distinct (the most that keeps them distinct when none fits)."""

    def pieces(values) -> list[tuple[str, str]]:
        out = []
        for key, value in values:
            prefix = _common_prefix(swept.get(key, []))
            out.append((key, value[len(prefix) :] if prefix and value.startswith(prefix) else value))
        return out

    keys = [key for key, _ in chosen]
    jobs = [
        pieces(zip(keys, combo, strict=True))
        for combo in itertools.product(*(swept.get(k, [v]) for k, v in chosen))
    ]

    def distinct(level: int) -> bool:
        names = [_joined(job, level) for job in jobs]
        return all(names) and len(set(names)) == len(names)

    readable = [n for n in range(LEVELS) if distinct(n)] or [0]
    fits = [n for n in readable if all(text_px(_joined(job, n)) <= NESTED_PX for job in jobs)]
    level = (fits or readable)[0 if fits else -1]
    return _joined(pieces(chosen), level)


def parent_name(swept: dict[str, list[str]]) -> str:
    """A sweep's parent: `sweep·model×capture`; past a top-level run's width, a key outside the
    config groups by its initials (`sweep·model×w×p` for model x waterfall x piecewise)."""

    def key_word(key: str, short: bool) -> str:
        leaf = key.rsplit(".", 1)[-1]
        if not short or key.split(".")[0] in GROUPS and key not in SWITCHES:
            return leaf
        return "".join(p[0] for p in leaf.split("_") if p)

    full, short = ("sweep" + SEPARATOR + "×".join(key_word(k, s) for k in swept) for s in (False, True))
    return full if text_px(full) <= TOP_LEVEL_PX else short


def unique(name: str, taken: set[str]) -> str:
    """The name, or with `·2`, `·3` ... when the experiment has it already."""
    if name not in taken:
        return name
    n = 2
    while f"{name}{SEPARATOR}{n}" in taken:
        n += 1
    return f"{name}{SEPARATOR}{n}"


# Where a run is stored and how Hydra lays out its folders: no part of what a run is
NOT_CHOICES = ("tracking", "hydra")


def chosen(overrides: list[str]) -> list[tuple[str, str]]:
    """(full key, value) of each override a user gave, but where runs are stored (`tracking.*`,
    `hydra.*`); a path value by its last name (a checkpoint folder, not this machine's path)."""
    pairs = []
    for override in overrides:
        key, _, value = override.partition("=")
        key = key.lstrip("+~")
        if key.split(".")[0] in NOT_CHOICES:
            continue
        pairs.append((key, _last_name(value)))
    return pairs


def _last_name(value: str) -> str:
    return value.rstrip("/").rsplit("/", 1)[-1] if "/" in value else value


def compared_params(cfg: PipelineConfig, *, backend: str, attention: str, dtype, device, text_layers: int,
                    overrides: list[str], flat: dict[str, str]) -> dict[str, str]:  # fmt: skip
    """The params a person compares runs by (the whole config is the run's config.yaml), and each
    override the user gave as its own param under its full key with the value it resolved to
    (flat: tracking.flatten_params of the config), so the runs table filters and groups by it.
    The transforms that ran are logged once they have (`transforms_param`)."""
    given = chosen(overrides)
    return {
        "model": cfg.model.name,
        "capture": cfg.capture.mode,
        "backend": cfg.backend.name,
        "backend_resolved": backend,
        "attention": cfg.attention.name,
        "attention_resolved": attention,
        "dtype": dtype_name(dtype),
        "device": str(device),
        "batch_size": str(cfg.prompt.batch_size),
        "prompt_len": str(cfg.prompt.prompt_len) if not cfg.prompt.queries else "queries",
        "output_len": str(cfg.prompt.output_len),
        "text_layers": str(text_layers),
        "world_size": str(cfg.runtime.world_size),
        "page_size": str(cfg.runtime.attn_page_size),
        "seed": str(cfg.seed),
        "overrides": " ".join(f"{k}={v}" for k, v in given) or "(none)",
        **{key: _last_name(flat.get(key, value)) for key, value in given},
    }


def transforms_param(history) -> str:
    """The transforms that changed the model, in the order they first did (a transform that
    matched nothing is not one of them), or `none`."""
    ran = [r.transform for r in history.records if r.status == "applied" and r.matches] if history else []
    return ",".join(dict.fromkeys(ran)) or "none"


def description(params: dict[str, str]) -> str:
    """The run's one-line summary (its MLflow description)."""
    return (
        f"{params['model']} ({params['text_layers']} text layers, {params['dtype']}, {params['device']}), "
        f"capture={params['capture']}, backend {params['backend_resolved']}, "
        f"attention {params['attention_resolved']}; batch {params['batch_size']}, "
        f"prompt {params['prompt_len']}, {params['output_len']} new tokens; overrides: {params['overrides']}"
    )
