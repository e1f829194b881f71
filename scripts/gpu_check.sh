#!/usr/bin/env bash
# The prepared GPU check: on a machine with one CUDA GPU (sm89+ for FP8 GEMMs) and no network, run the CUDA tests
# and the quick CUDA benchmark, writing every log and the JSON results to OUT_DIR. Installs nothing: the checkout
# is put on PYTHONPATH (torch, numpy, omegaconf, accelerate and pytest must already be there; torchao is optional).
#
#   scripts/gpu_check.sh OUT_DIR
#
# Budget: under 6 minutes in all (TOTAL_BUDGET, s): every step runs under `timeout`, the bench gets what is left. Exit status: 0 all passed; 1 a step failed or
# timed out (see OUT_DIR/summary.txt); 2 usage error or no CUDA GPU visible to torch (nothing can run).
# Environment: PYTHON (default python), TEST_TIMEOUT (s, default 110), EAGER_TIMEOUT (s, default 100: the bench
# with eager quantize), BENCH_TIMEOUT (s, default 200: the bench compiled), TOTAL_BUDGET (s, default 345).
set -u -o pipefail

if [ $# -ne 1 ] || [ -z "$1" ]; then
    echo "usage: scripts/gpu_check.sh OUT_DIR" >&2
    exit 2
fi
OUT_DIR=$1
mkdir -p "$OUT_DIR" || { echo "gpu_check: cannot create $OUT_DIR" >&2; exit 2; }
OUT_DIR=$(cd "$OUT_DIR" && pwd)
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python}
TEST_TIMEOUT=${TEST_TIMEOUT:-110}
EAGER_TIMEOUT=${EAGER_TIMEOUT:-100}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-200}
TOTAL_BUDGET=${TOTAL_BUDGET:-345}
SECONDS=0
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
note() { echo "gpu_check: $*" | tee -a "$SUMMARY"; }

# 1. What machine is this, and can torch see a GPU with FP8 tensor cores?
{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    uname -a
    timeout 15 nvidia-smi 2>&1 || echo "nvidia-smi not available"
} > "$OUT_DIR/env.txt" 2>&1
# One python start for the environment record and the GPU test: exit 0 FP8-capable GPU, 3 older GPU, else none.
timeout 60 "$PYTHON" - >> "$OUT_DIR/env.txt" 2>&1 <<'PY'
import sys
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if not torch.cuda.is_available():
    sys.exit(1)
try:
    import torchao
    print("torchao", torchao.__version__)
except Exception as e:
    print("torchao not available:", type(e).__name__, e)
p = torch.cuda.get_device_properties(0)
print("gpu", p.name, f"sm{p.major}{p.minor}", round(p.total_memory / 2**30, 1), "GiB")
sys.exit(0 if (p.major, p.minor) >= (8, 9) else 3)
PY
gpu=$?
if [ $gpu -ne 0 ] && [ $gpu -ne 3 ]; then
    note "no CUDA GPU visible to torch (torch.cuda.is_available() is False, or torch failed to import);"
    note "nothing to check here: run this script on the GPU machine. Details: $OUT_DIR/env.txt"
    exit 2
fi
if [ $gpu -eq 3 ]; then
    note "warning: this GPU is older than sm89: the FP8 tests will skip and the bench runs the emulated backend"
fi

status=0
run_step() {  # name, timeout seconds, command...
    local name=$1 limit=$2 rc start
    shift 2
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then
        note "$name: ok ($(( $(date +%s) - start )) s)"
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        note "$name: TIMED OUT after $limit s (log: $OUT_DIR/$name.log)"
        status=1
    else
        note "$name: FAILED with exit status $rc (log: $OUT_DIR/$name.log)"
        status=1
    fi
}

# 2. CUDA tests: scaled_mm vs emulated GEMMs, delayed scaling state on the GPU, a short train per recipe.
run_step pytest_cuda "$TEST_TIMEOUT" "$PYTHON" -m pytest -m cuda tests/test_cuda.py -q -rs -p no:cacheprovider \
    --junitxml="$OUT_DIR/pytest_cuda.xml"
tail -n 3 "$OUT_DIR/pytest_cuda.log" | sed 's/^/    /' | tee -a "$SUMMARY"

# 3. The quick CUDA benchmark, twice. The JSON is rewritten after every section, so a timeout still leaves
#    results. First eager FP8 quantize (no compile time, results guaranteed within budget), then fp8train's
#    default compiled path (torch.compile per quantize configuration: slower to start, faster to run) with what
#    is left of the budget; linear first in both: it carries the headline targets.
bench() {  # name, timeout, extra args...
    local name=$1 limit=$2
    shift 2
    if [ "$limit" -lt 30 ]; then
        note "$name: SKIPPED, only $limit s of the $TOTAL_BUDGET s budget left"
        status=1
        return
    fi
    run_step "$name" "$limit" "$PYTHON" -m fp8train.cli bench --device cuda --quick --out "$OUT_DIR/$name.json" "$@"
    sed -n '/^targets/,$p' "$OUT_DIR/$name.log" | sed 's/^/    /' | tee -a "$SUMMARY"
}
remaining() { echo $(( TOTAL_BUDGET - SECONDS - 15 )); }  # 15 s for timeout's kill grace and the summary
left=$(remaining); [ "$left" -lt "$EAGER_TIMEOUT" ] && EAGER_TIMEOUT=$left
bench bench_cuda_eager "$EAGER_TIMEOUT" --compile off --sections linear,train,memory
left=$(remaining); [ "$left" -lt "$BENCH_TIMEOUT" ] && BENCH_TIMEOUT=$left
bench bench_cuda "$BENCH_TIMEOUT" --compile on --sections linear,quant,train

note "done, exit status $status; logs and JSON in $OUT_DIR"
exit $status
