"""Printed summaries of serving runs."""
from __future__ import annotations

from controller.cli.serve_traces import ServeResult


def format_serve_summary(result: ServeResult) -> str:
    """Per workload and overall: cycles/1k and the cost profile's simulated ms/1k (what the allocator
    minimises), with the counts they are made of; and how far the plans' promises were kept."""
    lines = [f"{'workload':10s} {'tokens':>9s} {'cycles/1k':>10s} {'ms/1k':>9s} {'cache cycles':>13s} "
             f"{'model cycles':>13s} {'rejected':>9s}"]
    rows = [*sorted(result.run.by_workload.items()), ("overall", result.run.total())]
    for w, t in rows:
        lines.append(f"{w:10s} {t.tokens:9d} {t.cycles_per_1k:10.1f} {t.ms_per_1k:9.1f} {t.cache_cycles:13d} "
                     f"{t.model_cycles:13d} {t.wasted:9d}")
    promised, kept = result.promises
    if promised > 0:
        lines.append(f"the plan's promises kept: {kept} of {promised:.1f} accepted tokens expected of the verified "
                     f"drafts ({kept / promised:.3f})")
    lines.append(f"{result.run.steps} engine steps; {result.seconds:.1f} s; promotions {result.promotions or 'none'}; "
                 f"drift events {len(result.drifts)}" + ("; interrupted" if result.interrupted else ""))
    lines.append(result.tally.line() + ("" if result.tally.lost == 0 else " (queued but not written at exit)"))
    for h in result.services:
        if h.failures:
            lines.append(f"  {h.name}: {h.failures} failed attempts, last: {h.last_error}")
    return "\n".join(lines)
