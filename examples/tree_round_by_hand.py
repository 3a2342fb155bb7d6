"""One draft-tree round by hand, with the treecompile building blocks (CPU, no model needed).

A toy "drafter" proposes K children per lane, DraftTree keeps the best N-1 candidates, a toy "target"
says which token it would emit after each node, verify_tree_greedy walks the tree, and the accepted path
is compacted to the front of the KV window. Run: python examples/tree_round_by_hand.py
"""

import torch

import treecompile
from treecompile import DraftTree, TreeSpec

torch.manual_seed(0)
B, K, S, N, V = 2, 3, 4, 16, 20
tree = DraftTree(topk=K, steps=S, num_nodes=N)

# Draft: step 0 scores the root's children, steps 1..S-1 expand K lanes of K children each.
lanes = tree.begin(torch.randn(B, V).log_softmax(-1).topk(K).values, torch.randint(0, V, (B, K)))
for _ in range(S - 1):
    child_logp = torch.randn(B, K, V).log_softmax(-1).topk(K)
    lanes = tree.expand(lanes, child_logp.values, child_logp.indices)
root_tokens = torch.randint(0, V, (B,))
batch = tree.select(root_tokens)
print("parents of request 0:", batch.parents[0].tolist())
print("depth   of request 0:", batch.depth[0].tolist())

# Verify: positions follow depth; a toy target agrees with the best path for three tokens.
spec = TreeSpec(batch_size=B, num_nodes=N)
spec.set_tree(batch)
vc = torch.tensor([7, 11])  # committed lengths
positions = spec.load_step(vc)
target = torch.randint(0, V, (B, N))
target[:, 0], target[:, 1], target[:, 2] = batch.tokens[:, 1], batch.tokens[:, 2], batch.tokens[:, 3]
path, accept_len, bonus = torch.ops.treespec.verify_tree_greedy(batch.parents, batch.tokens, target)
print("accepted path:", path[0, : accept_len[0]].tolist(), "accept_len:", accept_len.tolist(), "bonus:", bonus.tolist())

# Compact: the accepted rows of every KV buffer move to the window's leading slots; rows and
# positions of the hidden states too. Afterwards everything looks like a chain.
k_cache = torch.randn(64, 2, 8)
slots = vc[:, None] + torch.arange(N) + torch.tensor([[0], [24]])  # toy slot of each window row
torch.ops.treespec.compact_window_rows([k_cache], slots, path, accept_len)
hidden = torch.randn(B, N, 32)
spec.compact_rows(hidden, path, accept_len, vc)
print("positions after compaction:", spec.positions[0, :4].tolist())

# The tree attention functional: row i sees the prefix and its ancestors inside the window.
q = torch.randn(B, N, 4, 64)
k, v = torch.randn(B, 40, 2, 64), torch.randn(B, 40, 2, 64)
out = treecompile.tree_attention(q, k, v, batch.ancestor_mask, prefix_len=torch.tensor([7, 20]))
print("tree attention out:", tuple(out.shape))
