"""Printed summaries of serving runs."""
from __future__ import annotations

from controller.cli.serve_traces import ServeResult


def format_serve_summary(result: ServeResult) -> str:
    lines = [f"{'workload':10s} {'tokens':>9s} {'cycles/1k':>10s} {'cache cycles':>13s} {'model cycles':>13s}"]
    for w, t in sorted(result.run.by_workload.items()):
        lines.append(f"{w:10s} {t.tokens:9d} {t.cycles_per_1k:10.1f} {t.cache_cycles:13d} {t.model_cycles:13d}")
    total = result.run.total()
    lines.append(f"{'overall':10s} {total.tokens:9d} {total.cycles_per_1k:10.1f} {total.cache_cycles:13d} {total.model_cycles:13d}")
    lines.append(f"{result.seconds:.1f} s; promotions {result.promotions or 'none'}; drift events {len(result.drifts)}"
                 + ("; interrupted" if result.interrupted else ""))
    lines.append(result.tally.line() + ("" if result.tally.lost == 0 else " (queued but not written at exit)"))
    for h in result.services:
        if h.failures:
            lines.append(f"  {h.name}: {h.failures} failed attempts, last: {h.last_error}")
    return "\n".join(lines)
