"""``TrainingStats`` as one self-contained HTML page: tables and an inline-SVG timeline per worker.

No scripts, stylesheets or fonts are fetched: the page opens offline and can be attached to a
bug report as one file. Long runs are drawn in at most ``_MAX_BARS`` bars per worker (rounds
are summed into buckets); the JSON export keeps every round.
"""

from __future__ import annotations

from collections.abc import Mapping
from html import escape
from typing import Protocol

from paraloom.spark.stats.recorder import PHASES, Event, WorkerStats

__all__ = ["StatsView", "render_html", "COLORS"]

COLORS = {"data": "#4e79a7", "compute": "#59a14f", "encode": "#f28e2b",
          "communicate": "#e15759", "apply": "#b07aa1", "wait": "#bab0ac", "event": "#76b7b2"}
_WIDTH = 960
_LEFT = 40
_LANE = 22
_MAX_BARS = 1000
_STYLE = """body{font:14px system-ui,sans-serif;margin:24px;color:#222}
table{border-collapse:collapse;margin:8px 0 20px}td,th{border:1px solid #ccc;padding:3px 8px;
text-align:right}th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}
.legend span{display:inline-block;margin-right:14px}.legend i{display:inline-block;width:12px;
height:12px;margin-right:4px;vertical-align:-1px}svg{background:#fafafa;border:1px solid #ddd}
section{margin-bottom:18px}h3{margin:6px 0;font-size:15px}"""


class StatsView(Protocol):
    """What the page reads from a ``TrainingStats`` (which imports this module, not back)."""

    @property
    def master(self) -> str: ...

    @property
    def workers(self) -> list[WorkerStats]: ...

    @property
    def driver(self) -> list[Event]: ...

    @property
    def summary(self) -> Mapping[str, object]: ...

    def phase_totals(self) -> dict[int, dict[str, float]]: ...


def _fmt(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _span(stats: StatsView) -> float:
    end = 0.0
    for w in stats.workers:
        r = w["rounds"]
        for i, start in enumerate(r["start"]):
            end = max(end, start + sum(r[p][i] for p in PHASES))
        for e in w.get("events", []):
            end = max(end, e["start"] + e["duration"])
    for e in stats.driver:
        end = max(end, e["start"] + e["duration"])
    return max(end, 1e-3)


def _buckets(rounds: dict[str, list[float]]) -> list[tuple[int, int, float, dict[str, float]]]:
    """(first round, last round, start, summed phases) for at most ``_MAX_BARS`` buckets."""
    n = len(rounds["start"])
    size = max(1, -(-n // _MAX_BARS))
    out = []
    for first in range(0, n, size):
        last = min(n, first + size) - 1
        phases = {p: sum(rounds[p][first:last + 1]) for p in PHASES}
        out.append((first, last, rounds["start"][first], phases))
    return out


def _rect(x: float, y: float, w: float, color: str, tip: str) -> str:
    return (f'<rect x="{x:.2f}" y="{y}" width="{max(w, 0.4):.2f}" height="{_LANE - 6}" '
            f'fill="{color}"><title>{escape(tip)}</title></rect>')


def _axis(span: float, height: int) -> list[str]:
    out = []
    for i in range(6):
        t = span * i / 5
        x = _LEFT + (_WIDTH - _LEFT - 10) * i / 5
        out.append(f'<line x1="{x:.1f}" y1="0" x2="{x:.1f}" y2="{height - 14}" stroke="#ddd"/>'
                   f'<text x="{x:.1f}" y="{height - 2}" font-size="10" text-anchor="middle">'
                   f'{t:.1f}s</text>')
    return out


def _timeline(label: str, worker: int | str, rounds: dict[str, list[float]] | None,
              events: list[Event], span: float) -> str:
    scale = (_WIDTH - _LEFT - 10) / span
    height = 2 * _LANE + 16
    parts = _axis(span, height)
    parts.append(f'<text x="2" y="{_LANE - 8}" font-size="10">events</text>')
    for e in events:
        parts.append(_rect(_LEFT + e["start"] * scale, 3, e["duration"] * scale, COLORS["event"],
                           f"{e['name']}: {_fmt(e['duration'])} at {e['start']:.3f}s"))
    parts.append(f'<text x="2" y="{2 * _LANE - 8}" font-size="10">rounds</text>')
    for first, last, start, phases in _buckets(rounds or {"start": [], **{p: [] for p in PHASES}}):
        x = _LEFT + start * scale
        which = f"round {first}" if first == last else f"rounds {first}-{last}"
        for p in PHASES:
            if phases[p] > 0:
                w = phases[p] * scale
                parts.append(_rect(x, _LANE + 3, w, COLORS[p], f"{which}: {p} {_fmt(phases[p])}"))
                x += w
    return (f'<section class="worker" id="worker-{escape(str(worker))}"><h3>{escape(label)}</h3>'
            f'<svg class="timeline" data-worker="{escape(str(worker))}" width="{_WIDTH}" '
            f'height="{height}" role="img" aria-label="{escape(label)} timeline">'
            + "".join(parts) + "</svg></section>")


def _summary_table(stats: StatsView) -> str:
    rows = "".join(f"<tr><td>{escape(str(k))}</td><td>{escape(_value(v))}</td></tr>"
                   for k, v in stats.summary.items() if not isinstance(v, (list, dict)))
    return f'<table class="summary"><tr><th>item</th><th>value</th></tr>{rows}</table>'


def _value(v: object) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _phase_table(stats: StatsView) -> str:
    head = "".join(f"<th>{p}</th>" for p in PHASES)
    rows = []
    for rank, totals in stats.phase_totals().items():
        total = sum(totals.values()) or 1.0
        cells = "".join(f"<td>{_fmt(totals[p])} ({100 * totals[p] / total:.0f}%)</td>"
                        for p in PHASES)
        rows.append(f"<tr><td>worker {rank}</td>{cells}<td>{_fmt(sum(totals.values()))}</td></tr>")
    return (f'<table class="phases"><tr><th>worker</th>{head}<th>total</th></tr>'
            + "".join(rows) + "</table>")


def _legend() -> str:
    items = "".join(f'<span><i style="background:{COLORS[p]}"></i>{p}</span>'
                    for p in (*PHASES, "event"))
    return f'<p class="legend">{items}</p>'


def render_html(stats: StatsView) -> str:
    """The whole page as a string."""
    span = _span(stats)
    lanes = []
    for w in stats.workers:
        hosts = ", ".join(w.get("hosts") or [w.get("host", "?")])
        label = f"worker {w['rank']} ({hosts}; {len(w['rounds']['start'])} rounds)"
        lanes.append(_timeline(label, w["rank"], w["rounds"], w.get("events", []), span))
    if stats.driver:
        lanes.append(_timeline("driver", "driver", None, stats.driver, span))
    title = f"paraloom Spark training stats: {stats.master}"
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}'
            f'</title><style>{_STYLE}</style></head><body><h1>{escape(title)}</h1>'
            f"{_summary_table(stats)}<h2>Time per phase</h2>{_phase_table(stats)}"
            f"<h2>Timeline</h2>{_legend()}" + "".join(lanes) + "</body></html>\n")
