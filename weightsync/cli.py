"""``weightsync``: the command line.

    weightsync doctor               what this machine's torch offers weightsync (backends, probes)
    weightsync fr list              the dump folders under the default directory, newest first
    weightsync fr analyze DIR       merge all ranks' recorder dumps; name where a push stopped
    weightsync fr timeline DIR -o timeline.png|.html
    weightsync bench [...]          weightsync against blocking broadcasts, here or across hosts (torchrun)
    weightsync demo [...]           the CartPole actor-learner demo, writing under ./runs/

``fr analyze`` exits 0 when it finds nothing wrong, 1 for a stall or failure, 2 for input it
cannot read (with a message, never a traceback); ``fr timeline`` exits 0 once the picture is
written (what it shows is the analyzer's business). Output piped into ``head`` ends quietly.
Everything here works from a plain install in any directory and writes only where it is told
(``-o``, ``--out``; ``bench`` and ``demo`` write under the current directory by default).
``bench`` and ``demo`` take their own options (``weightsync bench --help``); the repository's
benchmarks/ hold the detailed, single-host studies (``make bench`` and the rest).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _doctor() -> int:
    import torch

    from weightsync import _torch_compat as compat
    from weightsync.planes.shm import plane as shm

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


def _fr_list() -> int:
    from weightsync.recorder.recorder import dump_folders, dump_root, printable

    folders = dump_folders()
    if not folders:
        print(f"no dump folders under {dump_root()}")
        return 0
    print(f"dump folders under {dump_root()} (newest first; one per channel and address, or per process):")
    for folder, count, mtime in folders:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime))
        print(f"  {stamp}  {count:>3} dumps  {printable(str(folder))}")  # a folder's name is anyone's
    return 0


def _fr(args: argparse.Namespace) -> int:
    import msgspec

    from weightsync.recorder.analyze import analyze, load_dir, render
    from weightsync.recorder.recorder import printable

    if args.fr_command == "list":
        return _fr_list()

    try:
        dumps = load_dir(args.dir)
    except (ValueError, OSError) as err:
        print(f"weightsync fr: {printable(str(err))}", file=sys.stderr)
        return 2
    analysis = analyze(dumps, names=[f"{d.label}-{d.pid}" for d in dumps])
    if args.fr_command == "timeline":
        from weightsync.recorder.timeline import draw

        try:
            path = draw(dumps, analysis, args.output)
        except (ValueError, RuntimeError, OSError) as err:
            print(f"weightsync fr timeline: {err}", file=sys.stderr)
            return 2
        print(f"timeline written to {path}" + ("" if analysis.ok else " (stall or failure found: fr analyze)"))
        return 0
    if args.json:
        print(msgspec.json.encode(analysis).decode())
    else:
        print(render(analysis, details=args.details))
    return 0 if analysis.ok else 1


PROGRAMS = {
    "bench": ("weightsync.bench.run", "weightsync against blocking broadcasts on this host or across hosts "
                                      "(launches torchrun; weightsync bench --help)"),
    "demo": ("weightsync.demo.cartpole", "1 trainer + 3 generators learn CartPole (about a minute); "
                                         "output in ./runs/ (weightsync demo --help)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in PROGRAMS:  # programs with options of their own, handed everything after the name
        import importlib  # noqa: PLC0415

        return int(importlib.import_module(PROGRAMS[argv[0]][0]).main(argv[1:]))
    parser = argparse.ArgumentParser(prog="weightsync", description="asynchronous weight push for RL")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_module, text) in PROGRAMS.items():
        sub.add_parser(name, help=text, add_help=False)
    sub.add_parser("doctor", help="what this torch offers (backends, feature probes)")
    fr = sub.add_parser("fr", help="flight-recorder dumps: list, analyze, timeline")
    fr_sub = fr.add_subparsers(dest="fr_command", required=True)
    fr_sub.add_parser("list", help="the dump folders under the default directory, newest first")
    an = fr_sub.add_parser("analyze", help="merge all ranks' dumps and report where a push stopped")
    an.add_argument("dir", help="directory holding the *.wsfr dumps of one run")
    an.add_argument("--json", action="store_true", help="print the findings as JSON")
    an.add_argument("--details", action="store_true", help="every version, member by member")
    tl = fr_sub.add_parser("timeline", help="draw one lane per rank")
    tl.add_argument("dir")
    tl.add_argument("-o", "--output", default="timeline.png", help="a .png or .html file")
    args = parser.parse_args(argv)
    try:
        return _fr(args) if args.command == "fr" else _doctor()
    except BrokenPipeError:  # `weightsync fr analyze DIR | head`: the reader left, nothing is wrong
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's own flush at exit must not fail again
        return 0


if __name__ == "__main__":
    sys.exit(main())
