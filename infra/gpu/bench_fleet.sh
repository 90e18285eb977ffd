#!/usr/bin/env bash
# The whole fleet on one GPU host against its in-process ceiling: `ddm-fleet bench fleet` with the
# workers and the ceiling's experts on the GPU (torch CUDA, then JAX GPU), shipped checkpoints,
# 40-step 1-image jobs at 64 and 256 concurrent clients, $WPE worker processes per expert on the one GPU
# (the deployed shape: requests in flight on two processes), the experts in --dtype auto (bfloat16 on a
# GPU of compute capability >= 8.0). A call is only started while at least $MIN s of the $END s budget
# are left. Results land in $OUT: fleet.txt (every table, fleet / in-process ceiling / forward limit, and per
# level the fleet's CPU per image against the forward's, the overhead factor), env.txt, and gpu_util.csv
# (nvidia-smi every 0.5 s while the benches run: timestamp, GPU utilisation %, memory used MiB).
# env: END (s after start by which to stop starting calls, 400), MIN (s a call needs, 90), CONC
#      (--concurrency, 64,256), JOBS (--jobs-per-client, 4), WPE (--workers-per-expert, 2),
#      PLAN (backend:device list), PY.
# CPU dry run: SKIPWHL=1 PY=.venv/bin/python PLAN="torch:cpu" CONC=1,4 JOBS=1 OUT=/tmp/gpuf bash infra/gpu/bench_fleet.sh
set -u
END=${END:-400}; MIN=${MIN:-90}; CONC=${CONC:-64,256}; JOBS=${JOBS:-4}; WPE=${WPE:-2}
PLAN=${PLAN:-"torch:cuda jax:gpu"}
OUT=${OUT:-/tmp/gpuf}; LOG=fleet.txt
. "$(dirname "$0")/bench_common.sh"
SAMPLER=
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -lms 500 \
    > "$OUT/gpu_util.csv" 2>/dev/null & SAMPLER=$!
fi
for item in $PLAN; do
  b=${item%%:*}; d=${item##*:}
  [ "$(left)" -gt "$MIN" ] || { el "skipped $b on $d: $(left) s left"; continue; }
  el "bench fleet $b on $d"
  timeout $(( $(left) - 5 )) $PY -m infra.cli bench fleet --backend $b --device $d --concurrency $CONC \
    --jobs-per-client $JOBS --workers-per-expert $WPE --steps 40 >> "$OUT/fleet.txt" 2>&1
  el "bench fleet $b rc=$?"
done
[ -n "$SAMPLER" ] && kill "$SAMPLER" 2>/dev/null
el "all done"
