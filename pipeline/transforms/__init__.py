"""Graph rewrites. Importing the package registers every transform (see registry.TRANSFORMS)."""

from pipeline.transforms import (  # noqa: F401
    bf16_gemv,
    cleanup,
    fuse_add_rmsnorm,
    fuse_gemms,
    fuse_silu_and_mul,
    insert_cached_attention,
    match_attention,
    match_moe,
    match_rmsnorm,
    match_rope,
    onednn_linear,
    shard,
)
