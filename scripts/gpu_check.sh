#!/usr/bin/env bash
# The prepared GPU check: scripts/gpu_check.sh OUT_DIR [--dry-run] [--budget SECONDS] [--sections a,b,...]
#
# Runs on a machine with one CUDA GPU (sm89+) and no network; installs nothing: this checkout is put on PYTHONPATH,
# with what the image lacks of .gpu_site/ when it was carried along (scripts/prepare_gpu_wheels.sh, run where there
# is network, unpacks omegaconf and pytest there). torch, numpy and ml_dtypes must be importable by python3 (or $PYTHON); a section
# whose own needs are missing (train, bench: omegaconf, accelerate; cuda_tests: pytest) says so in its JSON and the
# others still run. Sections, in order of information per second, each writing OUT_DIR/<section>.json as soon as
# it ends (see fp8train/bench/gpu_check.py): checks, parity, capability, gemm_tflops, sync, e2e, cuda_tests, train,
# bench.
# At most 8 minutes in all. --dry-run runs everything on the CPU at toy sizes (the test suite does).
# Exit status: 0 all ok; 1 a section failed / timed out / was skipped; 2 usage error or no usable GPU;
# 3 parity failed (CUDA and the CPU emulation disagree: OUT_DIR/parity.jsonl). A short digest is printed last.
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd) || exit 2
PYTHON=${PYTHON:-python3}
if ! command -v "$PYTHON" > /dev/null 2>&1; then
    echo "gpu_check: $PYTHON not found; set PYTHON to a Python 3 interpreter with torch installed" >&2
    exit 2
fi
# The carried pure-Python wheels (GPU_SITE, default .gpu_site): only the distributions the image lacks go on
# PYTHONPATH (linked into a folder of their own), so the image's pytest and its plugins are never shadowed.
CARRIED=${GPU_SITE:-$REPO/.gpu_site}
SITE=""
if [ -d "$CARRIED" ]; then
    LINKS=$(mktemp -d "${TMPDIR:-/tmp}/fp8train_gpu_site.XXXXXX") || exit 2
    LINKS=$(PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m fp8train.bench.carried_site "$CARRIED" "$LINKS") \
        || { echo "gpu_check: could not sort the carried wheels in $CARRIED" >&2; exit 2; }
    SITE=":$LINKS"
fi
export PYTHONPATH="$REPO$SITE${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m fp8train.bench.gpu_check "$@"
