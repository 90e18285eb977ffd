#!/usr/bin/env bash
# GPU workers through NATS against in-process, for issue 14's target (>= 0.85x at buckets 64 and 256),
# on one GPU host in one go: `ddm-fleet bench worker` for JAX GPU, then torch CUDA, one bucket per
# call, fp32 and fp16 on the wire, 1 and 4 requests in flight, two worker processes of the expert
# (the deployment docs/DEPLOYMENT.md recommends). The most wanted figures run first; a call is only
# started while at least $MIN s of the $END s budget are left.
# Results land in $OUT: bench.txt (every table), env.txt.
# Needs checkpoints/expert0.safetensors and the project importable (wheels missing on the host may be
# put in .gpu/whl and are installed first into /tmp/site).
# env: END (s after start by which to stop starting calls, 420), MIN (s a call needs, 60),
#      BMIN (--min-time per path, 1.0), PROCS (--worker-procs, 2), PLAN (backend:bucket list), PY.
# CPU dry run: SKIPWHL=1 PY=.venv/bin/python DEV=cpu PLAN="torch:8" BMIN=0.2 OUT=/tmp/gpub bash infra/gpu/bench_workers.sh
set -u
DEV=${DEV:-cuda}; END=${END:-420}; MIN=${MIN:-60}; BMIN=${BMIN:-1.0}; PROCS=${PROCS:-2}
PLAN=${PLAN:-"jax:64 jax:256 torch:64 torch:256"}
OUT=${OUT:-/tmp/gpub}; LOG=bench.txt
. "$(dirname "$0")/bench_common.sh"
for item in $PLAN; do
  b=${item%%:*}; bk=${item##*:}; d=$DEV; [ "$b" = jax ] && [ "$DEV" != cpu ] && d=gpu:0
  [ "$(left)" -gt "$MIN" ] || { el "skipped $b bucket $bk: $(left) s left"; continue; }
  el "bench $b ($d) bucket $bk"
  timeout $(( $(left) - 5 )) $PY -m infra.cli bench worker --backend $b --device $d --checkpoint checkpoints/expert0.safetensors \
    --buckets $bk --in-flight 1,4 --wire-dtype float32,float16 --worker-procs $PROCS --min-time $BMIN >> "$OUT/bench.txt" 2>&1
  el "bench $b bucket $bk rc=$?"
done
el "all done"
