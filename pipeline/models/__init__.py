"""Model building, configs, inputs; importing it applies the upstream fixes (upstream_fixes.py)."""

from pipeline.models import upstream_fixes  # noqa: F401
