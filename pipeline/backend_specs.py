"""Each capture backend declared once, as a `BackendSpec`: what it does (compiles, replays CUDA
graphs, needs CUDA), its words in run names, what the profiler sees inside it. The rest of the
pipeline asks a backend's spec (`spec(name)`), never its name; `backends/install.py` puts one on
the graphs. A new backend is its `install` code and one entry here (and its conf/backend/ YAML).
It sits below config.py, which validates `backend.name` against it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackendSpec:
    name: str  # the backend.name a user sets
    word: str  # its word in a run's name
    short: str  # the shorter word, where a run's name must be cut
    compiles: bool  # Inductor compiles each target (graphs, or the eager model with capture=none)
    replays: bool  # decode steps replayed as CUDA graphs per batch bucket; needs a cached graph
    cuda_only: bool
    sees: str  # what the profiler attributes inside its graphs (docs/profiler.md)

    @property
    def runs_as_built(self) -> bool:
        """Neither compiles nor replays: the graph (or eager model) runs as it is, nothing to warm up."""
        return not (self.compiles or self.replays)


SPECS = {
    s.name: s
    for s in (
        BackendSpec("torch-simple", "simple", "fx", compiles=False, replays=False, cuda_only=False,
                    sees="module ranges in the graphs"),
        BackendSpec("torch-compile", "compile", "tc", compiles=True, replays=False, cuda_only=False,
                    sees="Inductor's kernels mapped to graph nodes (provenance) in a profiled compiled variant"),
        BackendSpec("torch-cudagraph", "cudagraph", "cg", compiles=False, replays=True, cuda_only=True,
                    sees="module ranges; CUDA-graph replays matched to each bucket's recorded kernel sequence"),
        BackendSpec("torch-opt", "opt", "opt", compiles=True, replays=True, cuda_only=True,
                    sees="Inductor provenance; CUDA-graph replays matched to each bucket's recorded kernel sequence"),
    )
}  # fmt: skip
# The backend that runs what it is given as it is: the eager reference, capture=none's default
AS_BUILT = "torch-simple"
# What backend=auto picks for a captured graph: compiled on CPU (and for steps CUDA graphs cannot
# replay), compiled and replayed on CUDA
AUTO_CPU, AUTO_CUDA = "torch-compile", "torch-opt"


def spec(name: str) -> BackendSpec:
    return SPECS[name]
