"""The `treespec` op library: every op registers as ``torch.ops.treespec.<name>`` on import."""

from . import _common  # noqa: F401
from . import tree_mask  # noqa: F401  (build_ancestor_mask)
from . import verify  # noqa: F401  (verify_tree_greedy)
from . import compact  # noqa: F401  (compact_window_rows)
from . import kv_write  # noqa: F401  (kv_write)
from . import tree_attention  # noqa: F401  (the cascade: prefix decode, window, merge)
from . import conv_tree  # noqa: F401  (causal_conv1d_tree_update / _commit)
from . import gdn_tree  # noqa: F401  (gdn_tree_verify[_staged], gdn_replay_commit)
from . import gdn_chunk_tree  # noqa: F401  (gdn_tree_verify_chunked: trees of <= 16 nodes)
from . import mamba2_tree  # noqa: F401  (mamba2_tree_verify[_staged], mamba2_replay_commit, ssm_commit_staged)
from . import mamba2_chunk_tree  # noqa: F401  (mamba2_tree_verify_chunked: every node at once)
from . import draft_topk  # noqa: F401  (draft_topk: top-k of a draft's log-probs in two kernels)
from . import page_slots  # noqa: F401  (page_slots: key positions -> cache slots in one kernel)
from . import vocab_argmax  # noqa: F401  (vocab_argmax: the greedy token of each row in two kernels)
from . import skinny_linear  # noqa: F401  (skinny_linear: F.linear for <= 64 rows, Triton tiles)
from . import fused_mlp  # noqa: F401  (fused_mlp: a gated MLP for <= 16 rows as one weight stream)
from . import skinny_glu  # noqa: F401  (skinny_glu: gate/up + silu-mul for <= 64 rows as one GEMM)
