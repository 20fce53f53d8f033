"""TrainingStats: every worker's phase timings of one ``fit()``, as JSON or one HTML page.

``export_html`` writes a self-contained page with a timeline per worker, which DL4J's
``exportStatsAsHtml`` promised for its shared master but never delivered.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from paraloom.spark.stats.html import render_html
from paraloom.spark.stats.recorder import PHASES, Event, WorkerStats

__all__ = ["TrainingStats"]


@dataclass
class TrainingStats:
    """Per-worker round timings and events of one ``fit()``, plus the driver's own events."""

    master: str
    workers: list[WorkerStats]
    driver: list[Event] = field(default_factory=list)
    summary: Mapping[str, object] = field(default_factory=dict)
    """The fit's summary (what ``SparkModel.fit`` returned)."""

    def phase_totals(self) -> dict[int, dict[str, float]]:
        """Seconds per phase for each worker rank."""
        return {w["rank"]: {p: float(sum(w["rounds"][p])) for p in PHASES} for w in self.workers}

    def to_dict(self) -> dict[str, object]:
        """Everything, JSON-able."""
        return {"master": self.master, "summary": self.summary,
                "phase_totals": {str(k): v for k, v in self.phase_totals().items()},
                "workers": self.workers, "driver": self.driver}

    def to_json(self) -> str:
        """``to_dict()`` as a JSON string."""
        return json.dumps(self.to_dict())

    def export_json(self, path: str | Path) -> Path:
        """Write ``to_dict()`` as JSON; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    def export_html(self, path: str | Path) -> Path:
        """Write a self-contained HTML page (inline SVG, no scripts, no network); returns it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render_html(self), encoding="utf-8")
        return path

    @staticmethod
    def merge_rounds(parts: list[WorkerStats]) -> list[WorkerStats]:
        """One record per rank from several tasks' records (averaging: one task per averaging
        round)."""
        by_rank: dict[int, WorkerStats] = {}
        for part in sorted(parts, key=lambda p: (p["rank"], p["rounds"]["start"][:1])):
            into = by_rank.setdefault(part["rank"], WorkerStats(
                rank=part["rank"], host=part["host"], pid=part["pid"],
                rounds={k: [] for k in part["rounds"]}, events=[], hosts=[]))
            for k, v in part["rounds"].items():
                into["rounds"][k].extend(v)
            into["events"].extend(part["events"])
            hosts = into.setdefault("hosts", [])
            if part["host"] not in hosts:
                hosts.append(part["host"])
        return [by_rank[r] for r in sorted(by_rank)]
