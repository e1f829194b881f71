"""Entry point for `accelerate launch scripts/train.py --config CONFIG [key=value ...] [--quiet]`.

The same command as `fp8train train` (which takes CONFIG positionally or as --config): accelerate provides the
processes (gloo on CPU, NCCL on GPUs) and fp8train's loop picks them up through its Accelerator.
"""

import sys

from fp8train.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
