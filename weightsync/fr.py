"""The flight recorder's public names: the process's ring, dumps, and reading them back.

``weightsync fr analyze`` and ``weightsync fr timeline`` are these functions on the command line::

    from weightsync import fr

    fr.install_signal_handler()                  # dump on SIGUSR1
    dumps = fr.load_dir("/tmp/weightsync-fr/run")
    print(fr.render(fr.analyze(dumps)))          # who stalled where, which member died
    fr.draw(dumps, fr.analyze(dumps), "timeline.html")

Importing this module imports neither torch nor matplotlib (a timeline imports it when drawn).
"""

from __future__ import annotations

from weightsync.recorder.analyze import Analysis, analyze, load_dir, render
from weightsync.recorder.recorder import (
           Dump,
           Entry,
           FlightRecorder,
           install_signal_handler,
           load_dump,
           process_recorder,
)
from weightsync.recorder.timeline import draw

__all__ = ["Analysis", "Dump", "Entry", "FlightRecorder", "analyze", "draw", "install_signal_handler", "load_dir",
           "load_dump", "process_recorder", "render"]
