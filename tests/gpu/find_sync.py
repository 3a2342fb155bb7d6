import traceback, torch, sys
sys.path.insert(0, "tests/runtime"); sys.path.insert(0, "tests")
import treecompile
from treecompile.draft_tree import DraftTree
K,S,N,B=4,6,63,6
tree = DraftTree(K,S,N)
d="cuda"
logp0=torch.randn(B,K,device=d).log_softmax(-1); tok0=torch.randint(0,100,(B,K),device=d)
steps=[(torch.randn(B,K,K,device=d).log_softmax(-1), torch.randint(0,100,(B,K,K),device=d)) for _ in range(S-1)]
roots=torch.randint(0,100,(B,),device=d)
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("error")
try:
    lanes=tree.begin(logp0,tok0)
    for cl,ct in steps: lanes=tree.expand(lanes,cl,ct)
    out=tree.select(roots)
    print("no sync")
except Exception:
    traceback.print_exc()
torch.cuda.set_sync_debug_mode(0)
# graph capture of a whole round
tree = DraftTree(K,S,N)
lanes=tree.begin(logp0,tok0)
for cl,ct in steps: lanes=tree.expand(lanes,cl,ct)
ref=tree.select(roots)
g=torch.cuda.CUDAGraph()
s=torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
try:
    with torch.cuda.graph(g):
        lanes=tree.begin(logp0,tok0)
        for cl,ct in steps: lanes=tree.expand(lanes,cl,ct)
        out=tree.select(roots)
    g.replay(); torch.cuda.synchronize()
    print("captured; equal:", torch.equal(out.parents, ref.parents), torch.equal(out.tokens, ref.tokens))
except Exception:
    traceback.print_exc()
