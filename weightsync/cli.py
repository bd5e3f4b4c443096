"""``weightsync``: the command line.

    weightsync doctor               what this machine's torch offers weightsync (backends, probes)
    weightsync fr analyze DIR       merge all ranks' recorder dumps; name where a push stopped
    weightsync fr timeline DIR -o timeline.png|.html

``fr analyze`` exits 0 when it finds nothing wrong, 1 for a stall or failure, 2 for input it
cannot read (with a message, never a traceback). Everything here works from a plain install in
any directory and writes only where it is told (``-o``). The demo and the benchmarks live in
the repository (``make demo``, ``make bench``): they are programs about weightsync, not part
of the library.
"""

from __future__ import annotations

import argparse
import sys


def _doctor() -> int:
    import torch

    from weightsync.pg import _torch_compat as compat
    from weightsync.transport import shm

    rows = [
        ("torch", torch.__version__),
        ("gloo", compat.gloo_available()),
        ("nccl (with a CUDA device)", compat.nccl_available()),
        ("ProcessGroupNCCL2 (single-communicator NCCL)", compat.nccl2_available()),
        ("gloo in-place reconfigure", compat.gloo_options_reconfigurable()),
        ("NCCL version", compat.nccl_version() or "-"),
        ("CUDA devices", torch.cuda.device_count() if torch.cuda.is_available() else 0),
        ("same-host shared memory (memfd, /proc)", shm.available()),
        ("shared-memory huge pages (shmem_enabled)", shm.huge_pages()),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


def _fr(args: argparse.Namespace) -> int:
    import msgspec

    from weightsync.pg.analyze import analyze, load_dir, render

    try:
        dumps = load_dir(args.dir)
    except (ValueError, OSError) as err:
        print(f"weightsync fr: {err}", file=sys.stderr)
        return 2
    analysis = analyze(dumps, names=[f"{d.label}-{d.pid}" for d in dumps])
    if args.fr_command == "timeline":
        from weightsync.pg.timeline import draw

        try:
            path = draw(dumps, analysis, args.output)
        except (ValueError, RuntimeError, OSError) as err:
            print(f"weightsync fr timeline: {err}", file=sys.stderr)
            return 2
        print(f"timeline written to {path}")
        return 0 if analysis.ok else 1
    if args.json:
        print(msgspec.json.encode(analysis).decode())
    else:
        print(render(analysis))
    return 0 if analysis.ok else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="weightsync", description="asynchronous weight push for RL")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="what this torch offers (backends, feature probes)")
    fr = sub.add_parser("fr", help="flight-recorder dumps: analyze, timeline")
    fr_sub = fr.add_subparsers(dest="fr_command", required=True)
    an = fr_sub.add_parser("analyze", help="merge all ranks' dumps and report where a push stopped")
    an.add_argument("dir", help="directory holding the *.wsfr dumps of one run")
    an.add_argument("--json", action="store_true", help="print the findings as JSON")
    tl = fr_sub.add_parser("timeline", help="draw one lane per rank")
    tl.add_argument("dir")
    tl.add_argument("-o", "--output", default="timeline.png", help="a .png or .html file")
    args = parser.parse_args(argv)
    if args.command == "fr":
        return _fr(args)
    return _doctor()


if __name__ == "__main__":
    sys.exit(main())
