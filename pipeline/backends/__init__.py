"""Capture backends: how each captured subgraph runs (never the eager parts).

torch-simple runs the graph as exported and transformed; torch-compile compiles it with Inductor
(dynamic shapes); torch-cudagraph replays CUDA graphs of its decode steps per batch bucket
(CUDAGraphRunner); torch-opt compiles, then captures the compiled graph. With capture=none there
is no subgraph: torch-simple runs the eager model and torch-compile compiles the whole eager model.
With backend.piecewise=true every other step runs the graph's segments per token bucket
(PiecewiseRunner, piecewise.py), in front of what the backend made of the whole graph: its
segments compiled where the backend compiles, replayed as CUDA graphs where it replays.

What each backend does is declared once, in pipeline/backend_specs.py; install.py applies it.
"""
