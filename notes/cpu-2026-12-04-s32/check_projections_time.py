import time, torch
from torch import nn
from treecompile.projections import fuse_projection_weights
class Attn(nn.Module):
    def __init__(s):
        super().__init__(); s.q_proj=nn.Linear(576,576,bias=False); s.k_proj=nn.Linear(576,192,bias=False); s.v_proj=nn.Linear(576,192,bias=False)
class MLP(nn.Module):
    def __init__(s):
        super().__init__(); s.gate_proj=nn.Linear(576,1536,bias=False); s.up_proj=nn.Linear(576,1536,bias=False)
class L(nn.Module):
    def __init__(s):
        super().__init__(); s.self_attn=Attn(); s.mlp=MLP()
m=nn.ModuleList([L() for _ in range(30)])
groups=fuse_projection_weights(m)
def check():
    for g in groups: g.check()
for _ in range(3): check()
t=time.perf_counter(); n=200
for _ in range(n): check()
print(len(groups), "groups: %.1f us a check" % ((time.perf_counter()-t)/n*1e6))
