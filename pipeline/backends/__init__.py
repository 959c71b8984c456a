"""Capture backends: how each captured subgraph runs (never the eager parts).

torch-simple runs the graph as exported and transformed; torch-compile compiles it with Inductor
(dynamic shapes); torch-cudagraph replays CUDA graphs of its decode steps per batch bucket
(CUDAGraphRunner); torch-opt compiles, then captures the compiled graph. With capture=none there
is no subgraph: torch-simple runs the eager model and torch-compile compiles the whole eager model.
"""
