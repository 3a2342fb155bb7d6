"""One line per loop_profile.py result: shape, batch, ms a round (lookahead), and its graph(s) alone.

    python3 tests/gpu/loop_summary.py loop.json
"""

import json
import sys

for r in json.load(open(sys.argv[1])):
    if "error" in r:
        print(r["shape"], r.get("batch"), r["error"][:200])
        continue
    if "round_gpu_ms" in r:  # one graph a round
        print(r["shape"], "B", r["batch"], "round %.3f (graph %.3f, idle %.3f) ms" % (
            r["ms_per_round_lookahead"], r["round_gpu_ms"], r["idle_ms_per_round_lookahead"]))
    else:
        print(r["shape"], "B", r["batch"], "round %.3f draft %.3f verify %.3f ms" % (
            r["ms_per_round_lookahead"], r["draft_gpu_ms"], r["verify_commit_gpu_ms"]))
