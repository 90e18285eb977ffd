#!/usr/bin/env bash
# Issue 18's study on one GPU in one go (feature-clustered experts, K = 4 and 8, at equal compute):
#   1. calibration: all 13 training runs together for $CAL steps, to measure steps/s under sharing;
#   2. N = steps that fit $BUDGET s; then, all at once on the one GPU, every run N steps:
#        k4/expert0..3   features4 partition, batch 128          (4 x 128 = 512 images per step)
#        k8/expert0..7   features8 partition, batch 64           (8 x  64 = 512 images per step)
#        monolith        all data, batch 512 = the same images and FLOPs per step as each ensemble
#      (the same hardware, data-parallel, for the same wall-clock: see docs/RESULTS.md), every model
#      trained with --label-dropout 0.1 (null label, for unconditional sampling); the two routers on the CPU;
#   3. distill the K = 4 ensemble (full routing) into one UNet on the GPU, while the ensembles' and
#      the monolith's images are generated (evaluation/sample_inprocess.py: 5,000 per configuration,
#      conditional and unconditional, the eval's digits and seeds); then the student's images;
#   4. (if time is left) `ddm-fleet bench worker` through NATS, torch CUDA and JAX GPU, 1 and more in flight.
# Results land in $OUT: k4.tgz (experts + router), models.tgz (monolith, distilled, k8 routers, every JSON),
# images-k4c.tgz (conditional), images-k4u.tgz (unconditional), images-k8.tgz, logs.tgz, bench.txt, env.txt. Scored on a CPU host afterwards:
#   ddm-fleet eval --rescore <dir>   (docs/RESULTS.md)
# Needs checkpoints/features{4,8}/partition.json, checkpoints/partition-monolith.json, MNIST in $DDM_DATA_DIR.
# env: DEV (cuda), BUDGET (s, default 220), CAL (120), NMIN/NMAX, RSTEPS (3000), DSTEPS (distill, 2000),
#      PER_CLASS (500), SSTEPS (sampling steps, 40), END (s after start by which to stop starting benches, 530).
# CPU dry run of the plumbing (about 3 minutes on 2 cores):
#   SKIPWHL=1 PY=.venv/bin/python DEV=cpu CAL=4 NMIN=6 NMAX=6 BSCALE=16 RSTEPS=5 RARGS="--val-limit 100" \
#     DSTEPS=4 PER_CLASS=2 SSTEPS=2 BENCH=0 OUT=/tmp/studyout bash infra/gpu/train_study.sh
set -u
DEV=${DEV:-cuda}; BUDGET=${BUDGET:-220}; CAL=${CAL:-120}; NMIN=${NMIN:-500}; NMAX=${NMAX:-20000}
RSTEPS=${RSTEPS:-3000}; DSTEPS=${DSTEPS:-2000}; PER_CLASS=${PER_CLASS:-500}; SSTEPS=${SSTEPS:-40}; END=${END:-530}
BSCALE=${BSCALE:-1}  # divide every batch size by this (dry runs)
OUT=${OUT:-/tmp/studyout}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( END - ($(date +%s) - T0) )); }
if [ -d .gpu/whl ] && [ -z "${SKIPWHL:-}" ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1; fi
PY=${PY:-python3}
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH DDM_DATA_DIR=${DDM_DATA_DIR:-$PWD/.gpu/data} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null; nproc; $PY -c "import torch,jax,flax,optax,pydantic,nats,msgpack;print('torch',torch.__version__,torch.cuda.is_available(),'jax',jax.__version__,jax.devices(),'flax',flax.__version__)") 2>&1 | tee "$OUT/env.txt"
W=out/study; rm -rf $W; mkdir -p $W/logs $W/k4 $W/k8 $W/img-k4 $W/img-k8
cp checkpoints/features4/partition.json $W/k4/; cp checkpoints/features8/partition.json $W/k8/
COMMON="--lr 1e-3 --warmup 200 --ema-decay 0.999 --label-dropout 0.1 --device $DEV --log-every 20 --no-progress --save-dtype float16 --widths 32,64,128"
[ "$DEV" = cpu ] || COMMON="$COMMON --bf16"
# name:partition:expert:batch
RUNS="mono:checkpoints/partition-monolith.json:0:512"
for k in 0 1 2 3; do RUNS="$RUNS k4/expert$k:checkpoints/features4/partition.json:$k:128"; done
for k in 0 1 2 3 4 5 6 7; do RUNS="$RUNS k8/expert$k:checkpoints/features8/partition.json:$k:64"; done
train_all() {  # $1 = steps, $2 = dir; sets PIDS
  PIDS=""; mkdir -p $2/k4 $2/k8
  for r in $RUNS; do IFS=: read name part k bs <<<"$r"
    $PY -m infra.cli train-expert --expert $k --partition $part $COMMON --batch-size $(( bs / BSCALE )) --steps $1 \
      --save-every $(( $1 / 4 > 0 ? $1 / 4 : 1 )) --out $2/$name --run-dir $2/run-$name > $W/logs/$(basename $2)-${name//\//-}.log 2>&1 &
    PIDS="$PIDS $!"
  done
}
el "routers on the CPU (K = 4, 8), $RSTEPS steps each"
for k in 4 8; do
  $PY -m infra.cli train-router --partition checkpoints/features$k/partition.json --steps $RSTEPS --threads 2 ${RARGS:-} \
    --out $W/k$k/router > $W/logs/router-k$k.log 2>&1 &
  eval RPID$k=$!
done
el "calibration: 13 concurrent runs x $CAL steps"
train_all $CAL $W/cal; wait $PIDS
RATE=$($PY - "$W/cal" <<'PY'
import json, sys, glob
r = []
for f in glob.glob(sys.argv[1] + "/**/*.json", recursive=True):
    d = json.load(open(f))
    if "training" not in d: continue
    h = d["training"]["loss_history"]; bs = d["training"]["config"]["batch_size"]
    if h and bs: r.append(h[-1]["img_s"] / float(bs))
print(min(r) if r else 0)
PY
)
N=$($PY -c "r=float('${RATE:-0}'); n=int(r*$BUDGET//100*100); print(max($NMIN, min($NMAX, n)))")
el "calibrated: slowest run $RATE steps/s with 13 concurrent -> N = $N steps for every run"
echo "plan: rate=$RATE N=$N budget=$BUDGET" >> "$OUT/env.txt"
train_all $N $W; wait $PIDS
el "training done: $(ls $W/k4/expert*.safetensors $W/k8/expert*.safetensors $W/mono.safetensors 2>/dev/null | wc -l) of 13 checkpoints"
wait $RPID4 $RPID8; el "routers done"
(cd $W/k4 && tar czf "$OUT/k4.tgz" expert*.safetensors expert*.json router.* partition.json)
el "distill (K = 4, full) on $DEV, $DSTEPS steps, while the images are generated"
$PY -m infra.cli distill --checkpoints $W/k4 --strategy full --steps $DSTEPS --batch-size $(( 128 / BSCALE )) --lr 1e-3 --warmup 200 \
  --ema-decay 0.999 --label-dropout 0.1 --device $DEV --save-every 500 --log-every 20 --no-progress --out $W/distilled \
  --run-dir $W/run-distill > $W/logs/distill.log 2>&1 &
DPID=$!
S="$PY -m evaluation.sample_inprocess --per-class $PER_CLASS --steps $SSTEPS --device $DEV"
$S --checkpoints $W/k4 --monolith $W/mono.safetensors --configs monolith,top1,top2,full,oracle --out $W/img-k4 > $W/logs/sample-k4.log 2>&1
$S --checkpoints $W/k4 --monolith $W/mono.safetensors --configs monolith,top1,top2,full --unconditional --out $W/img-k4 >> $W/logs/sample-k4.log 2>&1
el "k4 + monolith images: $(ls $W/img-k4 | wc -l) files"
$S --checkpoints $W/k8 --configs top1,top2,full,oracle --out $W/img-k8 > $W/logs/sample-k8.log 2>&1
$S --checkpoints $W/k8 --configs top1,full --unconditional --out $W/img-k8 >> $W/logs/sample-k8.log 2>&1
el "k8 images: $(ls $W/img-k8 | wc -l) files"
(cd $W && tar czf "$OUT/images-k8.tgz" img-k8)
wait $DPID; el "distill done rc=$?"
$S --configs distilled --distilled $W/distilled.safetensors --out $W/img-k4 >> $W/logs/sample-k4.log 2>&1
$S --configs distilled --distilled $W/distilled.safetensors --unconditional --out $W/img-k4 >> $W/logs/sample-k4.log 2>&1
el "distilled images done"
(cd $W && tar czf "$OUT/images-k4c.tgz" $(cd $W && ls -d img-k4/* | grep -v uncond) && tar czf "$OUT/images-k4u.tgz" img-k4/uncond-*)
(cd $W && tar czf "$OUT/models.tgz" mono.* distilled.* k8/router.* k8/*.json k4/*.json run-*/*.json 2>/dev/null)
(cd $W && tar czf "$OUT/logs.tgz" logs cal/*.json cal/k4/*.json cal/k8/*.json 2>/dev/null)
el "study packed"; ls -la "$OUT"
if [ "${BENCH:-1}" = 1 ]; then  # one bucket per call, so requests cannot coalesce into a bigger forward
  for b in torch jax; do d=$DEV; [ $b = jax ] && [ "$DEV" != cpu ] && d=gpu:0
    for bk in 64 256; do
      [ "$(left)" -gt 25 ] || break 2
      timeout $(( $(left) - 5 )) $PY -m infra.cli bench worker --backend $b --device $d --checkpoint checkpoints/expert0.safetensors \
        --buckets $bk --in-flight 1,2,4 --wire-dtype float32,float16 --min-time ${BMIN:-0.7} ${BENCHARGS:-} >> "$OUT/bench.txt" 2>&1
      el "bench $b bucket $bk rc=$?"
    done
  done
fi
el "all done"
