"""FX graph passes run by the treespec backend, one pass per file, each ``(gm, ctx) -> gm``.

``PASSES`` is the explicit order: rewrite each HF attention layer's SDPA call into treespec ops, rewrite
each linear-attention layer's (GDN, Mamba2) conv and recurrence seams into the tree ops (this pass proves
its own rewrite complete), prove no attention was left behind, then delete the dead HF mask code and
recompile. On CUDA each layer's cache write folds into its attention call. A matmul with a contraction of 1
(HF 5.17's rotary frequencies) becomes a broadcast multiply. With a binding that fused its projection
weights, q/k/v and gate/up become one linear each; with one that packs CPU linears, float32 linears run on
oneDNN-packed weights; with one that asks for skinny linears, a gated MLP of <= 16 rows whose shape measured
faster fused runs as one treespec::fused_mlp call, a verify tree's gate/up and silu-mul run as one
treespec::skinny_glu call (``TREECOMPILE_SKINNY_GLU=0`` turns it off), a verify tree's q/k/v projection and
rotary embedding run as one treespec::skinny_qkv_rope call (``TREECOMPILE_SKINNY_ROPE=0`` turns it off), and 16-bit
CUDA linears of <= 256 rows run on Triton tiles; then, where ``TREECOMPILE_FUSE_NORM=1`` asks, the residual add and
RMSNorm before those two calls go into the epilogue of the skinny_linear that produced their input.
Last, an eager CPU graph calls the attention ops' CPU implementations directly (no dispatcher).
"""

from .check_attention_rewritten import check_attention_rewritten
from .clean_up_graph import clean_up_graph
from .direct_cpu_ops import direct_cpu_ops
from .fuse_cache_write import fuse_cache_write
from .fuse_glu import fuse_glu
from .fuse_mlp import fuse_mlp
from .fuse_qkv_rope import fuse_qkv_rope
from .fuse_residual_norm import fuse_residual_norm
from .fuse_projections import fuse_projections
from .outer_products import outer_products
from .pack_cpu_linears import pack_cpu_linears
from .rewrite_attention import rewrite_attention
from .rewrite_linear_attention import rewrite_linear_attention
from .skinny_linears import skinny_linears

PASSES: list = [
    rewrite_attention, rewrite_linear_attention, check_attention_rewritten, fuse_cache_write, outer_products,
    fuse_projections, pack_cpu_linears, fuse_mlp, fuse_glu, fuse_qkv_rope, skinny_linears, fuse_residual_norm,
    clean_up_graph, direct_cpu_ops,
]

__all__ = [
    "PASSES", "rewrite_attention", "rewrite_linear_attention", "check_attention_rewritten", "fuse_cache_write",
    "outer_products", "fuse_projections", "pack_cpu_linears", "fuse_mlp", "fuse_glu", "fuse_qkv_rope",
    "skinny_linears", "fuse_residual_norm", "clean_up_graph", "direct_cpu_ops",
]
