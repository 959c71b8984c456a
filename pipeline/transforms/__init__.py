"""Graph rewrites. Importing the package registers every transform (see registry.TRANSFORMS)."""

from pipeline.transforms import cleanup, fuse_gemms, match_attention, match_rmsnorm, match_rope  # noqa: F401
