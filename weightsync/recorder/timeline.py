"""Draw merged flight-recorder dumps as a timeline: one lane per member, operations as bars.

Unfinished operations run to the end of their dump and are drawn hatched in orange, failed
ones in red, so a stall shows as the one lane whose bar never ends. Deaths the publisher saw
(a closed connection, a silence) and evictions are marked on their member's lane. A member
without a dump of its own is drawn from the publisher's view (the versions it acknowledged),
and only from its death on as gone. With an incident (a death, an eviction or a culprit) a second
panel shows the seconds around the first one at a readable scale; the top panel is the whole
run. PNG via matplotlib (the ``plot`` extra); ``.html`` embeds the same picture beside the
analyzer's text.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

from weightsync.recorder.analyze import PUBLISHER, Analysis, render
from weightsync.recorder.recorder import ABORTED, COMPLETED, STARTED, Dump, Entry

COLORS = {"bucket_send": "#4C72B0", "bucket_recv": "#55A868", "put": "#8172B2", "announce": "#CCB974",
          "ack": "#64B5CD", "receive": "#A1D99B", "publish": "#2CA02C", "rebuild": "#937860"}
LANE_OPS = ("put", "announce", "bucket_send", "bucket_recv", "ack", "receive", "publish", "rebuild")
BEFORE, AFTER = 2.0, 8.0  # seconds of the incident panel around the first incident
MIN_BAR = 0.004  # of a panel's span: shorter operations are still drawn, as a visible tick
MAX_LANES = 48  # members drawn: the publisher, those with an incident, then the rest by name


def _bars(dumps: list[Dump]) -> list[tuple[Dump, Entry]]:
    return [(d, e) for d in dumps for e in d.entries if e.op in LANE_OPS or e.state not in (COMPLETED,)]


def _incidents(dumps: list[Dump], analysis: Analysis) -> list[tuple[float, str, str]]:
    """(time, member, label) of every death and eviction, and of the first culprit's version."""
    found = [(d.time, d.member, "died: " + d.cause.split(" (")[0].removeprefix("its ")) for d in analysis.deaths]
    publisher = [e for d in dumps for e in d.entries if e.member == PUBLISHER]
    found += [(e.t_scheduled, p, f"evicted ({e.error or 'no reason'})") for e in publisher if e.op == "evict"
              for p in e.peers]
    for c in analysis.culprits:
        when = [e.t_scheduled for e in publisher if e.op == "announce" and e.version == c.version
                and e.generation == c.generation]
        if when:
            where = f"bucket {c.bucket}" if c.bucket is not None else "after its last bucket"
            found.append((when[0], c.member, f"culprit: v{c.version} {where}"))
    return sorted(found)


def draw(dumps: list[Dump], analysis: Analysis, out: str | Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as err:  # pragma: no cover - matplotlib ships with the plot extra
        raise RuntimeError("the timeline needs matplotlib: pip install 'weightsync[plot]'") from err
    out = Path(out)
    entries = _bars(dumps)
    if not entries:
        raise ValueError("the dumps hold no operations to draw")
    t0 = min(e.t_scheduled for _, e in entries)
    t_end = max(max(e.t_ended, e.t_started, e.t_scheduled) for _, e in entries)
    announced = {p for v in analysis.versions for p in v.members}
    incidents = _incidents(dumps, analysis)
    involved = {m for _, m, _ in incidents}
    everyone = sorted({e.member for _, e in entries} | announced, key=lambda m: (m != PUBLISHER, m not in involved, m))
    members = sorted(everyone[:MAX_LANES], key=lambda m: (m != PUBLISHER, m))
    lane = {m: i for i, m in enumerate(members)}
    entries = [(d, e) for d, e in entries if e.member in lane]
    panels = [(0.0, t_end - t0, "the whole run")]
    if incidents:
        first = incidents[0][0] - t0
        lo, hi = max(first - BEFORE, 0.0), min(first + AFTER, t_end - t0)
        if hi - lo < (t_end - t0) / 2:  # a short run is readable in one panel
            panels.append((lo, hi, f"around the first incident ({incidents[0][1]}: {incidents[0][2]})"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, len(panels) * (1.4 + 0.55 * len(members))), squeeze=False)
    for ax, (lo, hi, title) in zip(axes[:, 0], panels, strict=True):
        _panel(ax, dumps, analysis, entries, members, lane, incidents, t0, lo, hi)
        ax.set_title(title, fontsize=10, loc="left")
    axes[0, 0].set_xlabel("seconds since the first recorded operation")
    left_out = f" ({len(everyone) - len(members)} more members not drawn)" if len(everyone) > len(members) else ""
    fig.suptitle("weightsync flight recorder: " + ("no stall" if analysis.ok else "stall or failure") + left_out)
    legend = [Patch(facecolor=c, label=op) for op, c in COLORS.items()]
    legend += [Patch(facecolor="#FF7F0E", hatch="//", label="never finished"),
               Patch(facecolor="#D62728", label="failed"), Patch(facecolor="#BBBBBB", label="abandoned"),
               Patch(facecolor="#DDDDDD", label="publisher's view (no dump)"),
               Patch(facecolor="#EEEEEE", hatch="xx", edgecolor="#D62728", label="gone")]
    axes[0, 0].legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
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


def _panel(ax: Any, dumps: list[Dump], analysis: Analysis, entries: list[tuple[Dump, Entry]], members: list[str],
           lane: dict[str, int], incidents: list[tuple[float, str, str]], t0: float, lo: float, hi: float) -> None:
    span = max(hi - lo, 1e-3)
    tick = span * MIN_BAR
    batches: dict[tuple[str, tuple[tuple[str, Any], ...]], list[tuple[float, float]]] = {}

    def bar(member: str, start: float, end: float, **style: Any) -> None:
        if end < lo or start > hi:
            return  # bars of one lane and style are drawn in one call: 200k operations draw in seconds
        batches.setdefault((member, tuple(sorted(style.items()))), []).append((start, max(end - start, tick)))

    have_dump = {e.member for _, e in entries}
    publisher = [e for d in dumps for e in d.entries if e.member == PUBLISHER]
    gone = {d.member: d.time - t0 for d in analysis.deaths}
    for member in members:
        if member in have_dump:
            continue
        # the publisher's view: the acknowledgements that counted this member, until it was gone
        for e in publisher:
            if e.op == "ack" and e.state == COMPLETED and member in e.peers \
                    and (member not in gone or e.t_scheduled - t0 < gone[member]):
                bar(member, (e.t_started or e.t_scheduled) - t0, (e.t_ended or e.t_scheduled) - t0,
                    facecolors="#DDDDDD", edgecolor="none")
    for member, when in gone.items():
        if member in lane and member not in have_dump:
            bar(member, when, hi, facecolors="#EEEEEE", hatch="xx", edgecolor="#D62728", linewidth=0.5)
    for dump, e in entries:
        start = (e.t_started or e.t_scheduled) - t0
        end = (e.t_ended or dump.time) - t0
        color, hatch = COLORS.get(e.op, "#999999"), None
        if e.state in (STARTED, "scheduled"):
            color, hatch = "#FF7F0E", "//"
        elif e.state == ABORTED:
            color = "#BBBBBB"
        elif e.state != COMPLETED:
            color = "#D62728"
        bar(e.member, start, end, facecolors=color, hatch=hatch,
            edgecolor="black" if hatch or e.state != COMPLETED else "none", linewidth=0.5)
    for (member, style), spans in batches.items():
        ax.broken_barh(spans, (lane[member] - 0.35, 0.7), **dict(style))
    marks: dict[str, list[tuple[float, list[str]]]] = {}  # per lane: incidents close together share a label
    for when, member, label in incidents:
        x = when - t0
        if member in lane and lo <= x <= hi:
            near = marks.setdefault(member, [])
            if near and x - near[-1][0] < span * 0.05:
                near[-1][1].append(label)
            else:
                near.append((x, [label]))
    for member, near in marks.items():
        for x, labels in near:
            ax.plot([x], [lane[member]], marker="X", color="#D62728", markersize=9, zorder=5)
            ax.annotate("; ".join(dict.fromkeys(labels)), xy=(x, lane[member]), xytext=(6, 10),
                        textcoords="offset points", color="#D62728", fontsize=8, zorder=6,
                        bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none", "alpha": 0.8})
    ax.set_xlim(lo - span * 0.01, hi + span * 0.01)
    ax.set_yticks(range(len(members)), [m if m in have_dump else f"{m} (no dump)" for m in members])
    ax.invert_yaxis()
