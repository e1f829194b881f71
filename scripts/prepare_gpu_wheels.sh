#!/usr/bin/env bash
# Prepare the few pure-Python packages the GPU check needs beyond the device image, on a machine WITH network:
#     scripts/prepare_gpu_wheels.sh            (writes .gpu_site/ at the repository root, ~5 MB)
# then carry `.gpu_site` with the source tree to the GPU machine; scripts/gpu_check.sh puts it on PYTHONPATH.
#
# The device image has torch, triton, accelerate, transformers, safetensors, numpy, pyyaml, tensorboard, ml-dtypes
# and pytest with plugins, but no omegaconf (fp8train's config, hence train and bench). pytest is carried for images
# without it: scripts/gpu_check.sh puts on PYTHONPATH only the carried distributions the image lacks
# (fp8train.bench.carried_site), so an image's own pytest, pluggy and packaging are never shadowed.
# Only wheels that are pure Python (py3-none-any) are fetched, so they import on any Python >= 3.10 and any
# platform; exceptiongroup and tomli are what pytest needs on Python 3.10 only. Nothing of wandb or torchao:
# fp8train imports them only where they are used, and the check runs without them.
# Exit status: 0 done; 1 pip could not fetch or unpack a wheel (nothing is left half-written: the folder is
# built aside and moved into place at the end).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
TARGET="$REPO/.gpu_site"
PACKAGES=(
    "omegaconf==2.4.0"      # fp8train's config (its ANTLR parser is vendored from 2.4 on)
    "pytest==9.2.0"         # the cuda_tests section
    "pluggy==1.7.0" "iniconfig==2.3.1" "packaging==26.4" "pygments==2.19.2"   # pytest's requirements
    "exceptiongroup==1.3.0" "tomli==2.3.0"                                     # pytest on Python 3.10
)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --platform any --python-version 3.10 \
    --implementation py --abi none --dest "$WORK/wheels" "${PACKAGES[@]}"
mkdir -p "$WORK/site"
for wheel in "$WORK"/wheels/*.whl; do
    case "$(basename "$wheel")" in
        *-py3-none-any.whl|*-py2.py3-none-any.whl) ;;
        *) echo "prepare_gpu_wheels: $(basename "$wheel") is not pure Python; refusing it" >&2; exit 1 ;;
    esac
    "$PYTHON" -m zipfile -e "$wheel" "$WORK/site"
done
ls "$WORK/wheels" > "$WORK/site/WHEELS.txt"
rm -rf "$TARGET"
mv "$WORK/site" "$TARGET"
echo "prepare_gpu_wheels: $(wc -l < "$TARGET/WHEELS.txt") wheels unpacked into $TARGET ($(du -sh "$TARGET" | cut -f1))"
