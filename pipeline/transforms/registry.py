"""The transform registry: ordered, configurable graph rewrites with a history of what each matched.

Each transform is a class registered by name with a config dataclass (`enabled`, `scope`,
`skip_on_error`, its own options). `scope: subgraph` runs once on every captured GraphModule found
anywhere in the model; `scope: model` runs once on the whole nn.Module, eager parts included. A model without a captured
graph (capture=none) is not transformed at all: it is the eager baseline.
The list, order and options come from Hydra (`conf/transforms/`), validated here up front.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import fx, nn

from pipeline.errors import ConfigError

SCOPES = ("model", "subgraph")


@dataclass
class TransformConfig:
    enabled: bool = True
    scope: str = "subgraph"
    skip_on_error: bool = False


class Transform:
    """Subclasses set `name`, `scopes` (which scopes they can run in), `Config`, and implement
    `apply_graph` (scope subgraph) and/or `apply_model` (scope model); both return the match count."""

    name: ClassVar[str]
    scopes: ClassVar[tuple[str, ...]] = ("subgraph",)
    Config: ClassVar[type] = TransformConfig

    def __init__(self, config: Any):
        self.config = config

    def apply_graph(self, gm: fx.GraphModule) -> int:
        raise NotImplementedError

    def apply_model(self, model: nn.Module) -> int:
        raise NotImplementedError


TRANSFORMS: dict[str, type[Transform]] = {}


def register(cls: type[Transform]) -> type[Transform]:
    TRANSFORMS[cls.name] = cls
    return cls


def parse(transforms_cfg: DictConfig | dict | None) -> list[Transform]:
    """Validated transforms in config order; every mistake is a ConfigError naming the key."""
    transforms = []
    for name, options in (transforms_cfg or {}).items():
        if name not in TRANSFORMS:
            raise ConfigError(f"transforms.{name} is not a transform; known: {', '.join(TRANSFORMS)}")
        cls = TRANSFORMS[name]
        try:
            config = OmegaConf.merge(OmegaConf.structured(cls.Config), options or {})
        except OmegaConfBaseException as exc:
            detail = str(exc).splitlines()[0]
            key = getattr(exc, "key", None)
            where = f"transforms.{name}.{key}" if key else f"transforms.{name}"
            raise ConfigError(
                f"{where}: {detail}; see the options of {name} in conf/transforms/default.yaml"
            ) from None
        if config.scope not in SCOPES:
            raise ConfigError(
                f"transforms.{name}.scope={config.scope} is not a scope; use one of: {', '.join(SCOPES)}"
            )
        if config.scope not in cls.scopes:
            raise ConfigError(
                f"transforms.{name}.scope={config.scope} does not fit: {name} runs on {' or '.join(cls.scopes)}"
            )
        transforms.append(cls(OmegaConf.to_object(config)))
    return transforms


@dataclass
class TransformRecord:
    transform: str
    target: str  # subgraph name, or "model"
    status: str  # applied | skipped | failed | disabled | no target
    matches: int = 0
    nodes_before: int = 0
    nodes_after: int = 0
    seconds: float = 0.0
    reason: str = ""


@dataclass
class TransformHistory:
    records: list[TransformRecord] = field(default_factory=list)

    def matches(self, transform: str) -> int:
        return sum(r.matches for r in self.records if r.transform == transform)

    def table(self) -> str:
        header = (
            f"{'transform':<24} {'target':<24} {'status':<10} {'matches':>7} {'nodes':>13} {'ms':>8}  reason"
        )
        lines = [header, "-" * len(header)]
        for r in self.records:
            nodes = (
                f"{r.nodes_before}->{r.nodes_after}" if r.status in ("applied", "skipped", "failed") else ""
            )
            lines.append(
                f"{r.transform:<24} {r.target:<24} {r.status:<10} {r.matches:>7} {nodes:>13} "
                f"{r.seconds * 1000:>8.1f}  {r.reason}"
            )
        return "\n".join(lines)


def _node_count(module: nn.Module) -> int:
    return sum(len(m.graph.nodes) for m in module.modules() if isinstance(m, fx.GraphModule))


class _Snapshot:
    """Enough of a module tree to undo a failed rewrite: its graphs and its attribute tables."""

    def __init__(self, root: nn.Module):
        self.tables = [(m, dict(m._parameters), dict(m._buffers), dict(m._modules)) for m in root.modules()]
        self.graphs = []
        for m in root.modules():
            if isinstance(m, fx.GraphModule):
                graph = fx.Graph(owning_module=m, tracer_cls=m.graph._tracer_cls)
                output = graph.graph_copy(m.graph, {})
                graph.output(output)
                graph._codegen = m.graph._codegen
                self.graphs.append((m, graph))

    def restore(self) -> None:
        for module, params, buffers, modules in self.tables:
            module._parameters, module._buffers, module._modules = params, buffers, modules
        for module, graph in self.graphs:
            module.graph = graph
            module.recompile()


def find_graphs(model: nn.Module) -> list[tuple[str, fx.GraphModule]]:
    """Every captured GraphModule in the model, outermost only ("root" when the model is one)."""
    found: list[tuple[str, fx.GraphModule]] = []
    for path, module in model.named_modules():
        if isinstance(module, fx.GraphModule) and not any(
            path.startswith(p + ".") or p == "" for p, _ in found
        ):
            found.append((path, module))
    return [(path or "root", module) for path, module in found]


class TransformFailed(Exception):
    def __init__(self, record: TransformRecord):
        super().__init__(f"transform {record.transform} failed on {record.target}: {record.reason}")
        self.record = record


def run_transforms(model: nn.Module, transforms: list[Transform], history: TransformHistory) -> None:
    """Apply in order; records go into `history` as they happen, so a failure keeps the earlier ones."""
    graphs = find_graphs(model)
    for transform in transforms:
        config = transform.config
        if not config.enabled:
            history.records.append(TransformRecord(transform.name, "-", "disabled", reason="enabled=false"))
            continue
        if not graphs:  # capture=none: the eager model is the baseline, left as HF wrote it
            history.records.append(
                TransformRecord(
                    transform.name, "-", "no target", reason="no captured subgraph (capture=none)"
                )
            )
            continue
        targets: list[tuple[str, nn.Module]] = [("model", model)] if config.scope == "model" else graphs
        for name, target in targets:
            history.records.append(_apply_one(transform, name, target))


def _apply_one(transform: Transform, name: str, target: nn.Module) -> TransformRecord:
    record = TransformRecord(transform.name, name, "applied", nodes_before=_node_count(target))
    snapshot = _Snapshot(target)
    start = time.perf_counter()
    try:
        if transform.config.scope == "model":
            record.matches = transform.apply_model(target)
        else:
            record.matches = transform.apply_graph(target)
    except Exception as exc:
        record.seconds = time.perf_counter() - start
        record.reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if not transform.config.skip_on_error:
            record.status = "failed"
            raise TransformFailed(record) from exc
        snapshot.restore()
        record.status = "skipped"
    record.seconds = time.perf_counter() - start
    record.nodes_after = _node_count(target)
    return record
