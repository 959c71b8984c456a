"""The rows a profile is made of, flat dataclasses every profiler module shares: a phase's
statistics and its module tree as saved (ProfileNode), a part compared with eager, a part against
its roof. ProfileResults (results.py) holds them for one run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from pipeline.profiler import tree


@dataclass
class ProfileNode:
    """One node of a phase's module tree as saved: tree.Node with its depth and children in order."""

    name: str
    kind: str  # phase | module | kernel | unattributed
    fqn: str = ""  # modules: qualified name; kernels: the module they ran in
    cls: str = ""
    params: list[list] = field(default_factory=list)  # [[name, shape], ...]
    shapes: list[list[int]] = field(default_factory=list)
    trace: str = ""  # kernels: the ops from the module down to the kernel
    category: str = ""
    depth: int = 0
    cpu_time_us: float = 0.0
    device_time_us: float = 0.0
    pct: float = 0.0
    invocations: int = 0
    attribution: str = ""  # modules: how their time was found
    # Per call summed (tree.py): first start to last end of its work, the union of its ops' (GPU:
    # kernels') intervals, the rest (host time between ops; idle device between kernels), and
    # the ops or kernels it launched
    span_us: float = 0.0
    busy_us: float = 0.0
    gap_us: float = 0.0
    launches: int = 0
    children: list[ProfileNode] = field(default_factory=list)

    @classmethod
    def of(cls, node: tree.Node, depth: int = 0) -> ProfileNode:
        return cls(
            name=node.name,
            kind=node.kind,
            fqn=node.fqn,
            cls=node.cls,
            params=[[name, shape] for name, shape in node.params],
            shapes=node.shapes,
            trace=node.trace,
            category=node.category,
            depth=depth,
            cpu_time_us=round(node.cpu_time_us, 3),
            device_time_us=round(node.device_time_us, 3),
            pct=round(node.pct, 3),
            invocations=node.invocations,
            attribution=node.attribution if node.kind == "module" else "",
            span_us=round(node.span_us, 3),
            busy_us=round(node.busy_us, 3),
            gap_us=round(node.gap_us, 3),
            launches=round(node.launches),
            children=[cls.of(c, depth + 1) for c in node.children.values()],
        )

    @classmethod
    def from_dict(cls, saved: dict) -> ProfileNode:
        known = {f.name for f in fields(cls)} - {"children"}
        trace = saved.get("trace", "")
        return cls(
            **{k: v for k, v in saved.items() if k in known and k != "trace"},
            trace=" > ".join(trace) if isinstance(trace, list) else str(trace or ""),
            children=[cls.from_dict(c) for c in saved.get("children", [])],
        )

    def walk(self):
        yield self
        for child in self.children:
            yield from child.walk()


@dataclass
class PhaseStats:
    """One phase: a step window, or `decode`, the mean of the decode windows."""

    step_ms: float
    device_time_us: float
    statistic: str  # "one window" or "mean of N windows"
    coverage_pct: float  # device time inside some module
    layer_coverage_pct: float  # the layer stacks' time inside a layer or deeper
    attribution_pct: dict[str, float]  # tree.ATTRIBUTIONS -> share of device time
    summary_stats: ProfileNode
    model_stats: ProfileNode
    step_ms_median: float | None = None  # `decode` only
    mean_of: list[str] = field(default_factory=list)  # `decode` only: the windows averaged

    @classmethod
    def of(cls, root: tree.Node, step_ms: float, statistic: str) -> PhaseStats:
        attributed, in_layers = tree.coverage(root)
        return cls(
            step_ms=step_ms,
            device_time_us=root.device_time_us,
            statistic=statistic,
            coverage_pct=attributed,
            layer_coverage_pct=in_layers,
            attribution_pct=tree.attribution_pct(root),
            summary_stats=ProfileNode.of(tree.summary_tree(root)),
            model_stats=ProfileNode.of(root),
        )

    @classmethod
    def from_dict(cls, saved: dict) -> PhaseStats:
        return cls(
            step_ms=saved["step_ms"],
            device_time_us=saved["device_time_us"],
            statistic=saved.get("statistic", ""),
            coverage_pct=saved.get("coverage_pct", 0.0),
            layer_coverage_pct=saved.get("layer_coverage_pct", 0.0),
            attribution_pct=saved.get("attribution_pct", {}),
            summary_stats=ProfileNode.from_dict(saved["summary_stats"]),
            model_stats=ProfileNode.from_dict(saved["model_stats"]),
            step_ms_median=saved.get("step_ms_median"),
            mean_of=saved.get("mean_of", []),
        )

    @property
    def gap_pct(self) -> float:
        """The step's gaps as a share (%) of its span: host time between ops on CPU, the device
        idle between kernels on a GPU."""
        root = self.model_stats
        return 100 * root.gap_us / root.span_us if root.span_us else 0.0

    @property
    def gap_bound(self) -> bool:
        """Gaps over half the step's span: the step waits on launches more than it works."""
        return self.gap_pct > 50

    def to_dict(self) -> dict:
        saved = asdict(self)
        if self.step_ms_median is None:  # a single window: no median, nothing averaged
            del saved["step_ms_median"], saved["mean_of"]
        return saved


Phases = dict[str, PhaseStats]  # phase name -> its statistics


@dataclass
class ComparedPart:
    """One part of a phase on both sides: the captured run and the eager reference."""

    part: str
    captured_ms: float
    eager_ms: float
    speedup: float | None  # eager / captured; None where the note says why not
    note: str = ""
    # Each side's busy time and gaps (ProfileNode.busy_us/gap_us) over its module slices
    captured_busy_ms: float = 0.0
    captured_gap_ms: float = 0.0
    eager_busy_ms: float = 0.0
    eager_gap_ms: float = 0.0

    @property
    def busy_saved_ms(self) -> float:
        """The part of the gain that is faster work (fusion, better kernels)."""
        return self.eager_busy_ms - self.captured_busy_ms

    @property
    def gaps_removed_ms(self) -> float:
        """The part of the gain that is less time between the work (dispatch, launches)."""
        return self.eager_gap_ms - self.captured_gap_ms


@dataclass
class LayerRow(ComparedPart):
    """One part of the per-layer table (layers.py): a decoder layer, the vision tower, the
    projector, the lm_head, a kind's layers summed, the rest of the step or the total; its time on
    both sides as a ComparedPart, beside its roof and its numerics."""

    kind: str = ""  # a decoder layer's kind where a stack's layers differ (layers.layer_kinds)
    pct_of_roof: float | None = None  # its slices' roof time against its time
    max_abs: float | None = None  # numerics: its output against eager's (None: not compared)
    max_rel: float | None = None
    first_drift: bool = False  # the first part past the dtype's tolerance


@dataclass
class RoofRow:
    """One part with weights against the limits."""

    part: str
    device_ms: float
    weight_mib: float
    kv_mib: float  # the KV cache its attention reads
    gbs: float | None = None  # bytes the step must read / device time (counted parts only)
    tflops: float | None = None
    bound: str | None = None  # read | gemm
    roof_ms: float | None = None
    pct_of_roof: float | None = None
    roof_error: bool = False  # the part beat its roof: no percent


@dataclass
class Reference:
    """The eager model on the same workload (profile.reference=eager)."""

    what: str
    phases: Phases
