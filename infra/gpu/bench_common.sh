# Sourced by infra/gpu/bench_*.sh (bash): the budget clock, the wheels a GPU host lacks, the
# environment and env.txt. Needs OUT (results folder), LOG (file in it that el() appends to) and END
# (s after start by which to stop starting calls). Defines el (log with elapsed seconds), left (s of
# the budget left) and PY. SKIPWHL=1 skips installing .gpu/whl (a CPU dry run).
mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/$LOG"; }
left() { echo $(( END - ($(date +%s) - T0) )); }
if [ -d .gpu/whl ] && [ -z "${SKIPWHL:-}" ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1; fi
PY=${PY:-python3}
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null; nproc; $PY -c "import torch,jax,pydantic,nats,msgpack;print('torch',torch.__version__,torch.cuda.is_available(),'jax',jax.__version__,jax.devices())") 2>&1 | tee "$OUT/env.txt"
