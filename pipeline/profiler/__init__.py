"""The layerwise profiler: kineto windows read into module spans, ops and device events
(events.py), attributed to a module tree per phase (tree.py), exported graphs instrumented with
module ranges from their nn_module_stack (ranges.py), kernel categories (categories.py), and
tables, CSV and JSON (tables.py, output.py)."""
