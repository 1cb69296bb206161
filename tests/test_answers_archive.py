"""The committed answers archive: what `make eagle3` generated on one machine resumes on another."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_training.answers_archive import ArchiveError, pack, restore
from eagle3_training.corpus import Prompt
from eagle3_training.generate import Sample, read_samples, run_settings, shard_path, write_shard

PROMPTS = [Prompt(f"t{i}", "chat" if i % 2 else "sql", (1, 2, i)) for i in range(7)]
MODEL = Path("/models/smollm2-135m-bf16")


def _generated(folder: Path, shards: int, size: int = 3) -> list[Sample]:
    folder.mkdir(parents=True)
    settings = run_settings(PROMPTS, MODEL, "bfloat16", 512, size)
    (folder / "settings.json").write_text(json.dumps(settings))
    out = []
    for index in range(shards):
        chunk = [Sample(p.trace_id, p.workload, p.token_ids, tuple(range(i + index, i + index + 5)))
                 for i, p in enumerate(PROMPTS[index * size : (index + 1) * size])]
        write_shard(shard_path(folder, index), chunk)
        out.extend(chunk)
    return out


def test_round_trip_restores_the_same_samples_with_prompts_rendered_again(tmp_path):
    samples = _generated(tmp_path / "samples", shards=3)  # the last shard holds the 7th prompt only
    tokens = pack({"samples": tmp_path / "samples"}, tmp_path / "a.jsonl.xz")
    assert tokens == {"samples": 5 * 7}
    settings = run_settings(PROMPTS, MODEL, "bfloat16", 512, 3)
    assert restore(tmp_path / "a.jsonl.xz", "samples", tmp_path / "again", PROMPTS, settings) == 3
    assert read_samples(tmp_path / "again") == samples
    # A second restore leaves existing shards alone.
    assert restore(tmp_path / "a.jsonl.xz", "samples", tmp_path / "again", PROMPTS, settings) == 0


def test_other_settings_are_not_restored_and_say_why(tmp_path):
    _generated(tmp_path / "samples", shards=1)
    pack({"samples": tmp_path / "samples"}, tmp_path / "a.jsonl.xz")
    said = []
    other = run_settings(PROMPTS, MODEL, "bfloat16", 256, 3)
    assert restore(tmp_path / "a.jsonl.xz", "samples", tmp_path / "x", PROMPTS, other, log=said.append) == 0
    assert "max_new_tokens differ" in said[0] and not (tmp_path / "x").exists()


def test_a_reordered_prompt_list_is_refused_naming_the_trace(tmp_path):
    _generated(tmp_path / "samples", shards=1)
    pack({"samples": tmp_path / "samples"}, tmp_path / "a.jsonl.xz")
    swapped = [PROMPTS[1], PROMPTS[0], *PROMPTS[2:]]
    settings = json.loads((tmp_path / "samples" / "settings.json").read_text())
    with pytest.raises(ArchiveError, match="holds 't0' where this run's prompt order has 't1'"):
        restore(tmp_path / "a.jsonl.xz", "samples", tmp_path / "x", swapped, settings)


def test_a_corrupt_archive_is_named(tmp_path):
    bad = tmp_path / "a.jsonl.xz"
    bad.write_bytes(b"not xz at all")
    with pytest.raises(ArchiveError, match="not a readable answers archive"):
        restore(bad, "samples", tmp_path / "x", PROMPTS, {})
