"""``weightsync``: the command line.

    weightsync demo      one trainer and two generator processes on CPU (rl_examples)
    weightsync doctor    what this machine's torch offers weightsync (backends, probes)
"""

from __future__ import annotations

import argparse
import sys


def _doctor() -> int:
    import torch

    from weightsync.pg import _torch_compat as compat

    rows = [
        ("torch", torch.__version__),
        ("gloo", compat.gloo_available()),
        ("nccl (with a CUDA device)", compat.nccl_available()),
        ("ProcessGroupNCCL2 (single-communicator NCCL)", compat.nccl2_available()),
        ("gloo in-place reconfigure", compat.gloo_options_reconfigurable()),
        ("NCCL version", compat.nccl_version() or "-"),
        ("CUDA devices", torch.cuda.device_count() if torch.cuda.is_available() else 0),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weightsync", description="asynchronous weight push for RL")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="trainer + generator processes on CPU, end to end")
    demo.add_argument("--steps", type=int, default=5)
    demo.add_argument("--generators", type=int, default=2)
    sub.add_parser("doctor", help="what this torch offers (backends, feature probes)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from rl_examples.minimal_push import main as demo_main

        return demo_main(["--steps", str(args.steps), "--generators", str(args.generators)])
    return _doctor()


if __name__ == "__main__":
    sys.exit(main())
