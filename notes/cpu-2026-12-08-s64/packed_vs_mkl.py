import time, torch, sys
from treecompile.drafter import EagleDrafter
from treecompile.models import load_smollm2
from treecompile.speculator import TreeSpeculator
from treecompile.train import chat_ids
from treecompile.demo import shipped_head_path, PAGE_SIZE, PREFILL_CHUNK
from treecompile.prompts import demo_prompts
torch.set_num_threads(2)
model, tok = load_smollm2(dtype=torch.float32, device=torch.device("cpu"))
drafter = EagleDrafter.from_pretrained(shipped_head_path(), model)
x = torch.tensor([chat_ids(tok, demo_prompts()[2])])
for packed in (True, False):
  for k,s,n in ((1,1,1),(4,4,16)):
    sp = TreeSpeculator(model, drafter, topk=k, steps=s, num_nodes=n, max_batch_size=1, max_seq_len=256, page_size=PAGE_SIZE, prefill_chunk=PREFILL_CHUNK, packed_linears=packed)
    sp.generate(x, max_new_tokens=4)
    best=0
    for _ in range(2):
        t=time.perf_counter(); r=sp.generate(x, max_new_tokens=64); dt=time.perf_counter()-t; best=max(best,64/dt)
    print("packed", packed, (k,s,n), round(best,2), "tok/s", flush=True)
with torch.no_grad():
    for _ in range(2):
        t=time.perf_counter(); model.generate(x, max_new_tokens=64, do_sample=False, min_new_tokens=64); dt=time.perf_counter()-t
        print("hf eager", round(64/dt,2), flush=True)
