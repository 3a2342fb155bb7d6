"""treecompile's plain decode (one-node tree) and the demo's tree (4, 4, 16), with and without oneDNN-packed
linears, beside HF eager greedy `generate`, in one process (SmolLM2 float32, 2 threads, demo prompt 3, 64 new
tokens; that prompt runs past 64 tokens without EOS). Tokens/s from the tokens each call emitted, best of 2."""
import time
import torch
from treecompile.demo import PAGE_SIZE, PREFILL_CHUNK, shipped_head_path
from treecompile.drafter import EagleDrafter
from treecompile.models import load_smollm2
from treecompile.prompts import demo_prompts
from treecompile.speculator import TreeSpeculator
from treecompile.train import chat_ids

torch.set_num_threads(2)
model, tok = load_smollm2(dtype=torch.float32, device=torch.device("cpu"))
drafter = EagleDrafter.from_pretrained(shipped_head_path(), model)
x = torch.tensor([chat_ids(tok, demo_prompts()[2])])
for packed in (True, False):
    for k, s, n in ((1, 1, 1), (4, 4, 16)):
        sp = TreeSpeculator(model, drafter, topk=k, steps=s, num_nodes=n, max_batch_size=1, max_seq_len=256,
                            page_size=PAGE_SIZE, prefill_chunk=PREFILL_CHUNK, packed_linears=packed)
        sp.generate(x, max_new_tokens=4)
        best = 0.0
        for _ in range(2):
            t = time.perf_counter()
            new = sp.generate(x, max_new_tokens=64).sequences.shape[1] - x.shape[1]
            best = max(best, new / (time.perf_counter() - t))
        print("packed", packed, (k, s, n), f"{new} tokens", round(best, 2), "tok/s", flush=True)
with torch.no_grad():
    for _ in range(2):
        t = time.perf_counter()
        new = model.generate(x, max_new_tokens=64, do_sample=False, min_new_tokens=64).shape[1] - x.shape[1]
        print("hf eager", f"{new} tokens", round(new / (time.perf_counter() - t), 2), "tok/s", flush=True)
