"""`make bench` (part): a 60 s PostgreSQL outage under the bundled stream at its natural rate.

Serves the bundled traces on the replay engine (all services live, as `hvd serve --engine replay`)
against PostgreSQL through a TCP proxy, cuts the database off for `--outage` seconds, brings it
back, and prints where every event went (produced / written / dropped / dead-lettered / lost),
the share dropped during the outage (goal < 5%) and the time the writer took to catch up after the
database returned. A throwaway schema on $HVD_TEST_POSTGRES_URL (default: the test server) is
dropped afterwards. The gate is a fixed random MLP: the figures are about the pipeline, not it.
"""
from __future__ import annotations

import argparse
import os
import signal
import threading
import time
import uuid

import torch
from sqlalchemy import create_engine, make_url, text

from controller.cli import serve_traces  # noqa: E402
from controller.cli.serve_traces import ReplayServeOptions, round_robin_sources, serve_replay  # noqa: E402
from predictor.data.traces import bundled_traces_path, load_traces  # noqa: E402
from predictor.drafting.features import NUM_FEATURES, schema_hash  # noqa: E402
from predictor.gate.mlp import MLP, GatePredictor  # noqa: E402
from predictor.gate.registry import store_champion  # noqa: E402
from storage.engine import make_engine, session_scope  # noqa: E402
from storage.migrate import upgrade  # noqa: E402
# bench/tcp_proxy.py, beside this script (the tests use it too, through pytest's pythonpath).
from tcp_proxy import ProxyProcess  # noqa: E402

PG_URL = os.environ.get("HVD_TEST_POSTGRES_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test")
GOAL_DROPPED = 0.05


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outage", type=float, default=60.0, help="seconds the database is cut off (default 60)")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds served before the cut (default 10)")
    ap.add_argument("--after", type=float, default=5.0, help="seconds served after catching up (default 5)")
    args = ap.parse_args()

    schema = f"hvd_bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(PG_URL).update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(hide_password=False)
    proxy = ProxyProcess(url)
    engine = make_engine(proxy.url(url))
    try:
        upgrade(engine)
        torch.manual_seed(0)
        gate = GatePredictor.from_torch(MLP(NUM_FEATURES), schema_hash())
        with session_scope(engine) as s:
            store_champion(s, gate, reason="bench", actor="bench")
        records, _ = load_traces([bundled_traces_path()])
        records = round_robin_sources(records)

        stacks = []
        build = serve_traces.ServiceStack.build
        serve_traces.ServiceStack.build = lambda *a, **k: stacks.append(build(*a, **k)) or stacks[-1]
        figures: dict[str, float] = {}

        def operator() -> None:
            while not stacks:
                time.sleep(0.1)
            writer = stacks[0].writer
            time.sleep(args.warmup)
            at_cut = writer.tally()
            proxy.cut()
            print(f"database cut off for {args.outage:.0f} s")
            time.sleep(args.outage)
            proxy.restore()
            at_restore = writer.tally()
            restored = time.monotonic()
            while writer._buffer or writer.events.depth() >= writer.batch_size:
                time.sleep(0.05)
            figures["recovery_s"] = time.monotonic() - restored
            caught_up = writer.tally()
            figures["outage_produced"] = at_restore.produced - at_cut.produced
            figures["outage_dropped"] = caught_up.dropped - at_cut.dropped
            figures["peak_buffered"] = writer.peak_buffered
            time.sleep(args.after)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=operator, daemon=True).start()
        result = serve_replay(engine, records, ReplayServeOptions(progress_seconds=10.0), log=print)
        t = result.tally
        print(t.line() + f" (balanced: {t.balanced})")
        if "recovery_s" not in figures:
            print("the stream ended before the outage was over: nothing measured")
            return 1
        share = figures["outage_dropped"] / max(1, figures["outage_produced"])
        print(f"outage {args.outage:.0f} s: {figures['outage_produced']:.0f} events produced meanwhile, "
              f"{figures['outage_dropped']:.0f} dropped ({100 * share:.2f}%; goal < {100 * GOAL_DROPPED:.0f}%), "
              f"peak buffered {figures['peak_buffered']:.0f}; caught up {figures['recovery_s']:.2f} s after the "
              f"database returned")
        return 0 if t.balanced and t.lost == 0 and share < GOAL_DROPPED else 1
    finally:
        proxy.close()
        engine.dispose()
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


if __name__ == "__main__":
    raise SystemExit(main())
