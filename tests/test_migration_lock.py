"""Replicas starting together all migrate the same database at once: the migration lock lets one
run the migrations and the others find the schema at head, on SQLite and on PostgreSQL."""
from __future__ import annotations

import subprocess
import sys

from alembic.script import ScriptDirectory

from storage.engine import make_engine
from storage.migrate import alembic_config, current_revision

RACERS = 3


def test_replicas_migrating_together_all_start(db_url):
    code = "import sys; from storage.migrate import upgrade; upgrade(sys.argv[1])"
    procs = [subprocess.Popen([sys.executable, "-c", code, db_url], stderr=subprocess.PIPE, text=True)
             for _ in range(RACERS)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert [rc for rc, _ in results] == [0] * RACERS, [err[-2000:] for _, err in results]
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    engine = make_engine(db_url)
    try:
        assert current_revision(engine) == head
    finally:
        engine.dispose()
