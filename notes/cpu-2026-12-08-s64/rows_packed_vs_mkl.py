"""SmolLM2 float32 forward over a 200-key cache at 1, 6, 16, 24 new rows: MKL F.linear against oneDNN-packed
linears (the sixth session's table, BENCHMARKS.md, on whatever CPU this runs). Best of 5, ms."""
import copy, time, torch
from transformers import DynamicCache
from treecompile.models import load_smollm2
from treecompile.packed_linear import pack_module_linears
torch.set_num_threads(2)
model, _ = load_smollm2(dtype=torch.float32, device=torch.device("cpu"))
packed = copy.deepcopy(model); print("packed linears:", pack_module_linears(packed))
ctx = torch.randint(0, 1000, (1, 200))
def run(m, rows):
    with torch.no_grad():
        cache = DynamicCache(); m(ctx, cache=cache, use_cache=True)
        x = torch.randint(0, 1000, (1, rows), generator=torch.Generator().manual_seed(rows)); best = 1e9; out = None
        for _ in range(5):
            c = copy.deepcopy(cache); t = time.perf_counter(); out = m(x, cache=c, use_cache=True).logits
            best = min(best, time.perf_counter() - t)
        return best * 1e3, out
for rows in (1, 6, 16, 24):
    a, la = run(model, rows); b, lb = run(packed, rows)
    print(f"rows {rows:2d}: MKL {a:7.1f} ms  packed {b:7.1f} ms  max|dlogit| {float((la - lb).abs().max()):.1e}", flush=True)
