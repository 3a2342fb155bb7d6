import time, json, torch
from treecompile.drafter import EagleDrafter
from treecompile.models import load_smollm2
from treecompile.prompts import CATEGORIES, heldout_prompts
from treecompile.speculator import TreeSpeculator
from treecompile.train import chat_ids
from treecompile.demo import shipped_head_path, speculator_seq_len
torch.set_num_threads(2)
model, tok = load_smollm2(dtype=torch.float32, device=torch.device("cpu"))
drafter = EagleDrafter.from_pretrained(shipped_head_path(), model)
by_cat = [heldout_prompts(c) for c in CATEGORIES]
texts = [by_cat[i % len(by_cat)][i // len(by_cat)] for i in range(6)]
ids = [torch.tensor([chat_ids(tok, t)]) for t in texts]
eos = model.generation_config.eos_token_id
res = {}
for shape in ((8, 6, 64), (8, 5, 64), (10, 5, 64), (6, 6, 64), (8, 6, 48), (12, 5, 64), (8, 4, 64)):
    K, S, N = shape
    t0 = time.perf_counter()
    spec = TreeSpeculator(model, drafter, topk=K, steps=S, num_nodes=N, max_batch_size=1,
                          max_seq_len=speculator_seq_len(max(x.shape[1] for x in ids), 128, N), page_size=64)
    acc = rnd = 0
    for x in ids:
        out = spec.generate(x, max_new_tokens=128, eos_token_id=eos)
        a = out.accept_lengths[:, 0]; a = a[a > 0]
        acc += int(a.sum()); rnd += int(a.numel())
    res[str(shape)] = dict(tau=acc / rnd, rounds=rnd, tokens=acc, s=time.perf_counter() - t0)
    print(shape, res[str(shape)], flush=True)
    json.dump(res, open("/tmp/tau_sweep.json", "w"), indent=1)
