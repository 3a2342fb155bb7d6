#!/usr/bin/env bash
# A short probe for the nineteenth session's training plan (no SmolLM2 weights needed): a random Llama of
# SmolLM2's shape (bf16) with the tests' character tokenizer, saved as an HF directory; train-drafter on it
#   (1) online features: 256 prompts, greedy + 4 sampled (one generate call of 1024 rows), 64 new tokens,
#       60 training steps x 32; the shards' "seconds" give generate's time per step at 256 and 1024 rows;
#   (2) stored features on the same prompts, greedy only, 60 steps: the training step time of both modes.
# Random weights: the tokens are garbage, the timings are the real shapes'.
set -u
export PYTHONUNBUFFERED=1
REPO=$PWD
# the install.sh line without the wheel (a bare pip -e . reaches for the network and fails quietly)
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /dev/null 2>&1
cd /tmp  # the repository root shadows the installed package (top-level ops/)
python3 - "$REPO" <<'EOF'
import sys, torch
sys.path.insert(0, sys.argv[1] + "/tests/runtime")
from test_train_drafter import char_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=True)
torch.manual_seed(0)
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained("/tmp/smolshape")
char_tokenizer().save_pretrained("/tmp/smolshape")
EOF
C="--target /tmp/smolshape --prompts 256 --max-new-tokens 64 --batch-size 32 --steps 60 --checkpoint-every 60 \
  --draft-vocab 8192 --ttt-steps 4 --no-progress --threads 4"
for mode in online stored; do
  extra=$([ $mode = online ] && echo "--samples-per-prompt 5 --gen-batch-size 1024" || echo "--gen-batch-size 256")
  timeout 100 python3 -m treecompile.cli train-drafter --out /tmp/probe_$mode $C --features $mode $extra \
    > "$OUT/probe_$mode.log" 2>&1
  echo "$mode rc=$?"
  python3 - /tmp/probe_$mode <<'EOF'
import json, sys, glob, torch
d = sys.argv[1]
for f in sorted(glob.glob(d + "/data/gen*.pt")):
    s = torch.load(f, weights_only=True)
    print(f.split("/")[-1], len(s["records"]), "rows", round(s["seconds"], 2), "s")
t = json.load(open(d + "/training.json"))
print("train", t["steps"], "steps", t["train_seconds"], "s", round(t["train_seconds"] / max(t["steps"], 1), 4), "s/step")
EOF
done
