#!/usr/bin/env bash
# Follow tests/gpu/pipeline.sh for up to $1 seconds (default 540), then collect what it has made into $OUT:
# results.tar.gz (logs, JSON, PNG; refreshed at every new stage, so a call cut short by the device's
# time limit still returns what was done) and, once trained, the chosen head split into <16 MB parts.
P=${P:-/tmp/pipe}
OUT=${OUT:-/tmp/out}
limit=${1:-540}
t0=$(date +%s)
seen=0
# A bare machine (the device was released, and the daemon with it): say so at once instead of waiting out
# the limit on nothing (the eleventh session lost 570 s that way).
[ -f "$P/stages.log" ] || { echo "no $P/stages.log: the daemon is gone (machine released?)"; exit 3; }
while [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do
  n=$(wc -l < "$P/stages.log" 2>/dev/null || echo 0)
  if [ "$n" -gt "$seen" ]; then
    sed -n "$((seen + 1)),${n}p" "$P/stages.log"; seen=$n
    mkdir -p "$OUT" && tar czf "$OUT/results.tar.gz" -C "$P" . 2>/dev/null  # a call cut short still brings these back
  fi
  grep -q DONE "$P/stages.log" 2>/dev/null && break
  sleep 10
done
for f in "$P"/train*.log; do [ -f "$f" ] && { echo "--- $f"; tr '\r' '\n' < "$f" | grep -v "^$" | tail -4; }; done
for f in "$P"/gpu_spec_tests.log "$P"/gpu_tests.log "$P"/new_tests.log "$P"/skinny_sweep.log "$P"/ab5.log "$P"/rounds_main.log "$P"/rounds_both.log "$P"/e2e_main.log "$P"/e2e_both.log "$P"/e2e_skinny.log "$P"/skinny_tests.log "$P"/gemv_sweep.log "$P"/rounds_gemv.log "$P"/e2e_gemv.log "$P"/rounds_combo.log "$P"/ab3.log "$P"/round_gaps.log "$P"/loop.log "$P"/head_tau.log "$P"/head_tau_B.log "$P"/e2e_b1.log "$P"/e2e_b1_draft.log "$P"/e2e_fp32.log "$P"/rounds.log "$P"/loop.log "$P"/sweep.log "$P"/linear.log "$P"/e2e_b416.log "$P"/demo.log "$P"/attention.log "$P"/e2e_A.log "$P"/e2e_B.log "$P"/e2e_compiled.log "$P"/e2e_shipped.log "$P"/e2e_W.log "$P"/e2e_X.log "$P"/e2e_Y.log; do
  [ -f "$f" ] && { echo "--- $f"; tail -25 "$f"; }
done
mkdir -p "$OUT"
tar czf "$OUT/results.tar.gz" -C "$P" . 2>/dev/null
for h in ${HEADS:-}; do  # HEADS="/tmp/headA /tmp/headB": trained heads to bring back, each split into <16 MB parts
  [ -f "$h/model.safetensors" ] && (cd "$h" && tar cf - config.json model.safetensors training.json 2>/dev/null | split -b 15m - "$OUT/$(basename "$h").tar.part.")
done
if [ -f /tmp/head/model.safetensors ]; then
  (cd /tmp/head && tar cf - . | split -b 15m - "$OUT/head.tar.part.")
fi
ls -la "$OUT"
