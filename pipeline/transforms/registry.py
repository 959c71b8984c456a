"""The transform registry: ordered, configurable graph rewrites with a history of what each matched.

Each transform is a class registered by name with a config dataclass (`enabled`, `scope`,
`skip_on_error`, its own options). `scope` is one scope or a list of them: `subgraph` runs once on
every captured GraphModule found anywhere in the model, `model` once on the eager parts of the
model (the modules outside every captured graph). With both, the subgraph pass runs first, then
the model pass, each recorded in the history. A model without a captured graph (capture=none) is
not transformed at all: it is the eager baseline. The list, order and options come from Hydra
(`conf/transforms/`), validated here up front; what every transform shares about the run (the
attention backend, the page size, the device) comes in a `TransformContext`, as AutoDeploy passes
its shared config.
"""

from __future__ import annotations

import contextlib
import operator
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import fx, nn

from pipeline.errors import ConfigError
from pipeline.graphs import find_graphs, module_paths
from pipeline.models.deferred import DeferredWeights
from pipeline.transforms.graph import finish

SCOPES = ("subgraph", "model")  # also the order in which a transform's scopes run


@dataclass
class TransformConfig:
    enabled: bool = True
    scope: Any = "subgraph"  # one of SCOPES, or a list of them
    skip_on_error: bool = False


@dataclass
class TransformContext:
    """What the run decided that transforms share."""

    attention: str  # the resolved attention= backend: torch | triton | flashinfer
    page_size: int  # runtime.attn_page_size
    device: torch.device
    hf_config: Any = None  # the whole model's HF config (what its mask function means: models/masks.py)
    # Tensor parallelism (runtime.world_size): this process's rank and the process group the
    # shard transform's all-reduces run over (torch.distributed's group name)
    rank: int = 0
    world_size: int = 1
    group_name: str = ""
    # runtime.tp_weights=shard: the placeholders load left (models/deferred.py), filled by shard
    weights: DeferredWeights | None = None


class Transform:
    """Subclasses set `name`, `scopes` (which scopes they can run in), `Config`, the transforms they
    must come `after` or `before` in the list, and implement `apply_graph` (scope subgraph) and/or
    `apply_model` (scope model: the eager modules outside the captured graphs); both return the
    match count. What every graph rewrite ends with (dead nodes dropped, the graph linted and
    recompiled) is done here, in `rewrite_graph`, not by each transform."""

    name: ClassVar[str]
    scopes: ClassVar[tuple[str, ...]] = ("subgraph",)
    Config: ClassVar[type] = TransformConfig
    # Order constraints, checked by parse() between enabled transforms: each names transforms whose
    # rewrite this one needs done first (after), or would undo or hide for them (before).
    after: ClassVar[tuple[str, ...]] = ()
    before: ClassVar[tuple[str, ...]] = ()
    # What a graph needs before demollm decodes with it (decoding): profile.waterfall applies every
    # enabled one together, as its first step; makes_cache: the one that gives the graph its KV
    # cache, without which the waterfall has no graph to decode with.
    decoding: ClassVar[bool] = False
    makes_cache: ClassVar[bool] = False

    def __init__(self, config: Any):
        self.config = config

    @property
    def run_scopes(self) -> list[str]:
        """The configured scopes, in the order they run."""
        chosen = [self.config.scope] if isinstance(self.config.scope, str) else list(self.config.scope)
        return [scope for scope in SCOPES if scope in chosen]

    def apply_graph(self, gm: fx.GraphModule, ctx: TransformContext) -> int:
        raise NotImplementedError

    def rewrite_graph(self, gm: fx.GraphModule, ctx: TransformContext) -> int:
        """apply_graph, then the clean-up every rewrite needs: the match count."""
        matches = self.apply_graph(gm, ctx)
        finish(gm)
        return matches

    def apply_model(self, model: nn.Module, ctx: TransformContext) -> int:
        raise NotImplementedError

    def unmatched(self, gm: fx.GraphModule) -> list[str]:
        """After apply_graph: what in the graph looks like this transform's pattern and was not
        rewritten, each with where the pattern stopped (a matcher explains itself); [] for none."""
        return []

    def unmatched_model(self) -> list[str]:
        """After apply_model: the same for the eager modules."""
        return []

    def matched(self) -> list[str]:
        """After apply_graph or apply_model: what each match was, for a transform whose matches
        differ in kind (shard: the column/row tuples it split); [] where the count says it all."""
        return []


TRANSFORMS: dict[str, type[Transform]] = {}


def register(cls: type[Transform]) -> type[Transform]:
    TRANSFORMS[cls.name] = cls
    return cls


def parse(transforms_cfg: dict | None) -> list[Transform]:
    """Validated transforms in config order; every mistake is a ConfigError naming the key."""
    transforms = []
    for name, options in (transforms_cfg or {}).items():
        if name not in TRANSFORMS:
            raise ConfigError(f"transforms.{name} is not a transform; known: {', '.join(sorted(TRANSFORMS))}")
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
        scopes = [config.scope] if isinstance(config.scope, str) else list(config.scope or [])
        shown = ",".join(map(str, scopes))
        if not scopes or any(scope not in SCOPES for scope in scopes):
            raise ConfigError(
                f"transforms.{name}.scope={shown} is not a scope; use one of {', '.join(SCOPES)} or a list "
                "of them, e.g. [subgraph,model]"
            )
        if unfit := [scope for scope in scopes if scope not in cls.scopes]:
            raise ConfigError(
                f"transforms.{name}.scope={shown}: {name} cannot run on {unfit[0]}; it runs on "
                f"{' or '.join(cls.scopes)}"
            )
        transforms.append(cls(OmegaConf.to_object(config)))
    check_order(transforms)
    return transforms


def check_order(transforms: list[Transform]) -> None:
    """Every declared constraint between two enabled transforms holds in the list's order; else a
    ConfigError naming both."""
    position = {t.name: i for i, t in enumerate(transforms) if t.config.enabled}
    for transform in transforms:
        if transform.name not in position:
            continue
        here = position[transform.name]
        for other in transform.after:
            if position.get(other, -1) > here:
                raise ConfigError(_order_error(other, transform.name, f"declared by {transform.name}"))
        for other in transform.before:
            if -1 < position.get(other, -1) < here:
                raise ConfigError(_order_error(transform.name, other, f"declared by {transform.name}"))


def _order_error(first: str, then: str, why: str) -> str:
    return (
        f"transforms: {first} must run before {then} ({why}), and the list has {then} first; "
        f"put transforms.{first} above transforms.{then} (conf/transforms/default.yaml has the order)"
    )


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
    scope: str = ""  # subgraph | model: the pass this record is of
    unmatched: list[str] = field(default_factory=list)  # candidates left, and where each stopped
    matched: list[str] = field(default_factory=list)  # what each match was, where the transform says
    replaced: list[str] = field(default_factory=list)  # scope model: the eager modules it put in place
    # scope subgraph: "<module> -> <module>" where the rewrite moved a module's work into another's
    # nodes (fuse_add_rmsnorm: the layer's residual add into its norm), model paths
    moved: list[str] = field(default_factory=list)


@dataclass
class TransformHistory:
    records: list[TransformRecord] = field(default_factory=list)
    # The module tables before the first model pass: what the eager parts were (for an eager
    # reference, model_passes_undone); the modules themselves, not copies
    eager_tables: _Tables | None = field(default=None, repr=False)

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


class _Tables:
    """The attribute tables of a module tree: which parameters, buffers and children each holds."""

    def __init__(self, root: nn.Module, modules: list[nn.Module] | None = None):
        modules = list(root.modules()) if modules is None else modules
        self.tables = [(m, dict(m._parameters), dict(m._buffers), dict(m._modules)) for m in modules]

    def restore(self) -> None:
        for module, params, buffers, modules in self.tables:
            module._parameters, module._buffers, module._modules = params, buffers, modules


class Snapshot(_Tables):
    """Enough of a module tree to put it back as it is now: its graphs and its attribute tables (to
    undo a failed rewrite, or to run a waterfall step again)."""

    def __init__(self, root: nn.Module):
        super().__init__(root)
        self.graphs = []
        for m in root.modules():
            if isinstance(m, fx.GraphModule):
                graph = fx.Graph(owning_module=m, tracer_cls=m.graph._tracer_cls)
                output = graph.graph_copy(m.graph, {})
                graph.output(output)
                graph._codegen = m.graph._codegen
                self.graphs.append((m, graph))

    def restore(self) -> None:
        super().restore()
        for module, graph in self.graphs:
            module.graph = graph
            module.recompile()


class TransformFailed(Exception):
    def __init__(self, record: TransformRecord):
        super().__init__(f"transform {record.transform} failed on {record.target}: {record.reason}")
        self.record = record


def run_transforms(
    model: nn.Module, transforms: list[Transform], ctx: TransformContext, history: TransformHistory
) -> None:
    """Apply in order; records go into `history` as they happen, so a failure keeps the earlier ones."""
    graphs = find_graphs(model)
    for transform in transforms:
        if not transform.config.enabled:
            history.records.append(TransformRecord(transform.name, "-", "disabled", reason="enabled=false"))
            continue
        if not graphs:  # capture=none: the eager model is the baseline, left as HF wrote it
            history.records.append(
                TransformRecord(
                    transform.name, "-", "no target", reason="no captured subgraph (capture=none)"
                )
            )
            continue
        for scope in transform.run_scopes:
            if scope == "model" and history.eager_tables is None:
                history.eager_tables = _Tables(model, [m for _, m in eager_modules(model)])
            targets: list[tuple[str, nn.Module]] = [("model", model)] if scope == "model" else graphs
            for name, target in targets:
                history.records.append(_apply_one(transform, scope, name, target, ctx))


def _apply_one(
    transform: Transform, scope: str, name: str, target: nn.Module, ctx: TransformContext
) -> TransformRecord:
    record = TransformRecord(transform.name, name, "applied", scope=scope, nodes_before=_node_count(target))
    snapshot = Snapshot(target)
    children = {path: (m, dict(m._modules)) for path, m in eager_modules(target)} if scope == "model" else {}
    nodes_before = _node_modules(target) if scope == "subgraph" else {}
    start = time.perf_counter()
    try:
        if scope == "model":
            record.matches = transform.apply_model(target, ctx)
        else:
            record.matches = transform.rewrite_graph(target, ctx)
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
    if record.status == "applied":
        record.unmatched = transform.unmatched(target) if scope == "subgraph" else transform.unmatched_model()
        record.matched = transform.matched()
        if scope == "model":
            record.replaced = _replaced(target, children)
        else:
            record.moved = _moved(nodes_before, _node_modules(target), "" if name == "root" else name)
        if record.unmatched and not record.matches:
            more = f" (and {len(record.unmatched) - 1} more)" if len(record.unmatched) > 1 else ""
            record.reason = f"nothing matched: {record.unmatched[0]}{more}"
    return record


def _node_modules(gm: nn.Module) -> dict[fx.Node, str]:
    """Each computing node of the graph -> the innermost module it ran under ("" for none)."""
    if not isinstance(gm, fx.GraphModule):
        return {}
    return {
        node: (module_paths(node) or [""])[-1]
        for node in gm.graph.nodes
        if node.op == "call_function" and node.target is not operator.getitem  # a getitem computes nothing
    }


def _moved(before: dict[fx.Node, str], after: dict[fx.Node, str], graph_path: str) -> list[str]:
    """'<source> -> <target>' for each module whose removed nodes' work went into the new nodes of
    other modules: the sources are modules of removed nodes no new node belongs to, each paired
    with the new nodes' modules nearest it (the same layer's, not another's); paths in the model,
    the graph's path in front."""
    removed = {module for node, module in before.items() if node not in after and module}
    added = {module for node, module in after.items() if node not in before and module}
    full = (lambda path: f"{graph_path}.{path}") if graph_path else (lambda path: path)

    def shared(a: str, b: str) -> int:
        return len(os.path.commonprefix([a.split("."), b.split(".")]))

    edges = []
    for source in sorted(removed - added):
        if not added:
            break
        nearest = max(shared(source, target) for target in added)
        edges += [f"{full(source)} -> {full(t)}" for t in sorted(added) if shared(source, t) == nearest]
    return edges


def _replaced(model: nn.Module, before: dict[str, tuple[nn.Module, dict[str, nn.Module]]]) -> list[str]:
    """The paths whose module is another than `before` (path -> the module there and its children)
    had."""
    return [
        f"{path}.{name}" if path else name
        for path, module in model.named_modules()
        if path in before and before[path][0] is module
        for name, child in module._modules.items()
        if before[path][1].get(name) is not child
    ]


def eager_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's modules outside every captured graph (what scope `model` rewrites), the graphs
    themselves left out."""
    graphs = [path for path, m in model.named_modules() if isinstance(m, fx.GraphModule)]
    return [
        (path, module)
        for path, module in model.named_modules()
        if not any(path == g or path.startswith(g + ".") or g == "" for g in graphs)
    ]


def rewritten_modules(model: nn.Module, history: TransformHistory | None) -> dict[str, str]:
    """Path -> the model-scope transforms that put it in place, for each eager module those passes
    put in place of Hugging Face's (OneDNNLinear for nn.Linear, ...): parts whose work is the
    rewrite's, not capture's. Each path is named with the pass that replaced it (the history's
    `replaced`), not every pass that matched somewhere."""
    if history is None or history.eager_tables is None:
        return {}
    before = {id(module): children for module, _, _, children in history.eager_tables.tables}
    by_path: dict[str, list[str]] = {}
    for record in history.records:
        for path in record.replaced:
            by_path.setdefault(path, []).append(record.transform)
    rewritten = {}
    for path, module in eager_modules(model):
        for name, child in module._modules.items():
            if id(module) in before and before[id(module)].get(name) is not child:
                full = f"{path}.{name}" if path else name
                rewritten[full] = ", ".join(dict.fromkeys(by_path.get(full, ["a model-scope pass"])))
    return rewritten


def moved_work(history: TransformHistory | None) -> dict[str, dict[str, str]]:
    """Source module -> {target module: the graph transforms that moved its work there}."""
    moved: dict[str, dict[str, str]] = {}
    for record in history.records if history is not None else []:
        for edge in record.moved:
            source, target = edge.split(" -> ")
            names = moved.setdefault(source, {}).get(target, "")
            if record.transform not in names.split(", "):
                moved[source][target] = f"{names}, {record.transform}" if names else record.transform
    return moved


@contextlib.contextmanager
def model_passes_undone(model: nn.Module, history: TransformHistory | None) -> Iterator[None]:
    """The eager parts as they were before any model-scope rewrite (nn.Linear for OneDNNLinear,
    HF's RMSNorm modules), for the duration; the rewritten ones are back on exit."""
    if history is None or history.eager_tables is None:
        yield
        return
    current = _Tables(model, [m for _, m in eager_modules(model)])
    history.eager_tables.restore()
    try:
        yield
    finally:
        current.restore()
