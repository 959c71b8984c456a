"""`make bench`: measured, side-by-side figures written to BENCHMARKS.md (never pass/fail tests)."""
