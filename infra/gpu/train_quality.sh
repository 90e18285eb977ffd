#!/usr/bin/env bash
# Train the quality-study models on one GPU in one go (how checkpoints/ was made on 2026-11-26):
#   1. calibration: the five runs below together for $CAL steps, to measure steps/s under sharing;
#   2. N = steps that fit $BUDGET s for the monolith's 2N, then, all at once on the one GPU:
#      expert0/expert1 (class partition, N steps each), monolith (all data, 2N steps = equal compute),
#      kmeans0/kmeans1 (k-means partition, N steps each), and the k-means router on the CPU;
#   3. backend checks (infra/gpu/backend_check.py) and `ddm-fleet bench worker` for torch-CUDA and JAX-GPU.
# Results land in $OUT as class.tgz, kmeans.tgz, logs.tgz, smoke.json, env.txt, plan.txt.
# Needs: checkpoints/partition{,-monolith,-kmeans}.json, MNIST in $DDM_DATA_DIR (default ./data), and the
# project importable (PYTHONPATH=. is set here; missing wheels may be put in .whl/ and are installed first).
# env: DEV (cuda), BF16 (--bf16; empty for fp32), BUDGET (s of training, default 330), CAL (400), BS (128),
#      NMIN/NMAX (bounds on N), RSTEPS (router steps, 3000), PY (python3).
# A CPU dry run of the plumbing: SKIPWHL=1 PY=.venv/bin/python DEV=cpu BF16= BS=4 CAL=10 NMIN=10 NMAX=20 \
#      RSTEPS=10 RARGS="--val-limit 200" bash infra/gpu/train_quality.sh
set -u
DEV=${DEV:-cuda}; BF16=${BF16---bf16}; BUDGET=${BUDGET:-330}; CAL=${CAL:-400}; NMAX=${NMAX:-40000}; NMIN=${NMIN:-1000}; BS=${BS:-128}
OUT=${OUT:-/tmp/gpuout}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
if [ -d .whl ] && [ -z "${SKIPWHL:-}" ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1; fi
PY=${PY:-python3}
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH DDM_DATA_DIR=${DDM_DATA_DIR:-$PWD/data} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $PY -c "import torch,jax,flax,optax,pydantic,nats;print('torch',torch.__version__,torch.cuda.is_available(),'jax',jax.__version__,jax.devices(),'flax',flax.__version__,'optax',optax.__version__)") 2>&1 | tee "$OUT/env.txt"
W=out/gpu; rm -rf $W; mkdir -p $W/logs
COMMON="--widths 32,64,128 --batch-size $BS --lr 1e-3 --warmup 200 --ema-decay 0.9995 $BF16 --device $DEV --log-every 100 --no-progress --save-dtype float16"
# name partition expert-id steps-multiplier
RUNS="expert0:checkpoints/partition.json:0:1 expert1:checkpoints/partition.json:1:1 monolith:checkpoints/partition-monolith.json:0:2 kmeans0:checkpoints/partition-kmeans.json:0:1 kmeans1:checkpoints/partition-kmeans.json:1:1"
train_all() {  # $1 = base steps N, $2 = tag; sets PIDS
  PIDS=""
  for r in $RUNS; do IFS=: read name part k mult <<<"$r"
    timeout $(( BUDGET + 120 )) $PY -m infra.cli train-expert --expert $k --partition $part $COMMON --steps $(( $1 * mult )) \
      --save-every $(( $1 * mult / 4 > 0 ? $1 * mult / 4 : 1 )) --out $W/$2/$name --run-dir $W/$2/run-$name > $W/logs/$2-$name.log 2>&1 &
    PIDS="$PIDS $!"
  done
}
el "calibration: 5 concurrent runs x $CAL steps"
train_all $CAL cal; wait $PIDS
RATE=$($PY - "$W/cal" $BS <<'PY'
import json, sys, glob
r = []
for f in glob.glob(sys.argv[1] + "/*.json"):
    h = json.load(open(f))["training"]["loss_history"]
    r.append(h[-1]["img_s"] / float(sys.argv[2]))
print(min(r) if r else 0)
PY
)
N=$($PY -c "import sys; r=float('$RATE'); n=int(r*$BUDGET/2//500*500); print(max($NMIN, min($NMAX, n)))")
el "calibrated: slowest run $RATE steps/s with 5 concurrent -> N = $N (monolith 2N)"
echo "rate=$RATE N=$N" > "$OUT/plan.txt"
el "k-means router on CPU"
$PY -m infra.cli train-router --partition checkpoints/partition-kmeans.json --steps ${RSTEPS:-3000} --threads 6 ${RARGS:-} --out $W/final/router-kmeans > $W/logs/router-kmeans.log 2>&1 &
RPID=$!
el "training"
train_all $N final; wait $PIDS
el "training done"
wait $RPID; el "router done"
$PY infra/gpu/backend_check.py "$OUT/smoke.json" > $W/logs/smoke.log 2>&1; el "smoke done"
for b in torch jax; do d=$DEV; [ $b = jax ] && d=gpu; [ "$DEV" = cpu ] && d=cpu
  timeout 90 $PY -m infra.cli bench worker --backend $b --device $d --checkpoint checkpoints/expert0.safetensors --buckets 1,8,64,256 --min-time 1 > $W/logs/bench-$b.log 2>&1; el "bench $b rc=$?"
done
(cd $W/final && tar czf "$OUT/class.tgz" expert0.* expert1.* monolith.* && tar czf "$OUT/kmeans.tgz" kmeans0.* kmeans1.* router-kmeans.*)
(cd $W && tar czf "$OUT/logs.tgz" logs cal/*.json)
el "all done"; ls -la "$OUT"
