"""Entry point for `accelerate launch scripts/train.py --config CONFIG [key=value ...]`.

The same as `fp8train train CONFIG [key=value ...]`; accelerate provides the processes (gloo on CPU, NCCL on
GPUs) and fp8train's loop picks them up through its Accelerator.
"""

import argparse
import sys

from fp8train.cli import main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="recipe YAML, e.g. recipes/cpu_delayed.yaml")
    parser.add_argument("--quiet", action="store_true")
    args, overrides = parser.parse_known_args()
    sys.exit(main(["train", args.config, *overrides] + (["--quiet"] if args.quiet else [])))
