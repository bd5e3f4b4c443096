"""Draw merged flight-recorder dumps as a timeline: one lane per rank, operations as bars.

Unfinished operations run to the end of their dump and are drawn hatched in orange, failed
ones in red, so a stall shows as the one lane whose bar never ends. PNG via matplotlib (the
``plot`` extra); ``.html`` embeds the same picture beside the analyzer's text.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

from weightsync.pg.analyze import Analysis, render
from weightsync.pg.recorder import ABORTED, COMPLETED, STARTED, Dump

COLORS = {"bucket_send": "#4C72B0", "bucket_recv": "#55A868", "put": "#8172B2", "announce": "#CCB974",
          "ack": "#64B5CD", "receive": "#A1D99B", "publish": "#2CA02C", "rebuild": "#937860"}
LANE_OPS = ("put", "announce", "bucket_send", "bucket_recv", "ack", "receive", "publish", "rebuild")


def draw(dumps: list[Dump], analysis: Analysis, out: str | Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as err:  # pragma: no cover - matplotlib ships with the plot extra
        raise RuntimeError("the timeline needs matplotlib: pip install 'weightsync[plot]'") from err
    out = Path(out)
    entries = [(d, e) for d in dumps for e in d.entries if e.op in LANE_OPS or e.state not in (COMPLETED,)]
    if not entries:
        raise ValueError("the dumps hold no operations to draw")
    t0 = min(e.t_scheduled for _, e in entries)
    members = sorted({e.member for _, e in entries}, key=lambda m: (m != "publisher", m))
    members += [m for m in analysis.missing_dumps if m not in members]  # ranks that could not dump
    lane = {m: i for i, m in enumerate(members)}
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.6 * len(members)))
    for member in analysis.missing_dumps:
        if member in lane:
            last = max(max(e.t_ended, e.t_started, e.t_scheduled) for _, e in entries) - t0
            ax.broken_barh([(0, last)], (lane[member] - 0.35, 0.7), facecolors="#EEEEEE", hatch="xx",
                           edgecolor="#D62728", linewidth=0.5)
            ax.text(last / 2, lane[member], "no dump: stopped or died", ha="center", va="center",
                    color="#D62728", fontsize=9)
    for dump, e in entries:
        start = (e.t_started or e.t_scheduled) - t0
        end = (e.t_ended or dump.time) - t0
        color = COLORS.get(e.op, "#999999")
        hatch = None
        if e.state == STARTED or e.state == "scheduled":
            color, hatch = "#FF7F0E", "//"
        elif e.state == ABORTED:
            color = "#BBBBBB"
        elif e.state != COMPLETED:
            color = "#D62728"
        ax.broken_barh([(start, max(end - start, 1e-4))], (lane[e.member] - 0.35, 0.7), facecolors=color,
                       hatch=hatch, edgecolor="black" if hatch or e.state != COMPLETED else "none", linewidth=0.5)
    for c in analysis.culprits:
        if c.member in lane:
            ax.annotate(f"culprit: v{c.version} bucket {c.bucket}", xy=(0, lane[c.member]), xycoords=("axes fraction",
                        "data"), xytext=(4, 8), textcoords="offset points", color="#D62728", fontsize=9)
    ax.set_yticks(range(len(members)), members)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first recorded operation")
    ax.set_title("weightsync flight recorder: " + ("no stall" if analysis.ok else "stall or failure"))
    legend = [Patch(facecolor=c, label=op) for op, c in COLORS.items()]
    legend += [Patch(facecolor="#FF7F0E", hatch="//", label="never finished"),
               Patch(facecolor="#D62728", label="failed"), Patch(facecolor="#BBBBBB", label="abandoned")]
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    if out.suffix.lower() == ".html":
        img = base64.b64encode(buf.getvalue()).decode()
        out.write_text(f"<!doctype html><meta charset=utf-8><title>weightsync timeline</title>"
                       f"<img alt='timeline' src='data:image/png;base64,{img}'>"
                       f"<pre>{html.escape(render(analysis))}</pre>\n")
    else:
        out.write_bytes(buf.getvalue())
    return out
