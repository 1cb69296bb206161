"""Workload balance of the EAGLE3 training rows: how often each workload's answers are seen per
epoch, and the training folder that repeats them."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eagle3_training.balance import repeats, row_repeats


def test_the_largest_workload_is_seen_once_and_the_others_up_to_the_cap():
    # the committed answers' budget: coding dominates (answer tokens per workload)
    tokens = {"coding": 621_688, "agentic": 238_503, "sql": 222_637, "code_edit": 247_392, "chat": 170_190}
    workloads = [w for w, n in tokens.items() for _ in range(2)]
    per_row = [tokens[w] // 2 for w in workloads]
    assert repeats(workloads, per_row, cap=3) == {"coding": 1, "agentic": 3, "sql": 3, "code_edit": 3, "chat": 3}
    assert repeats(workloads, per_row, cap=10) == {"coding": 1, "agentic": 3, "sql": 3, "code_edit": 3, "chat": 4}
    assert set(repeats(workloads, per_row, cap=1).values()) == {1}
    assert row_repeats(["sql", "coding", "sql"], [10, 40, 10], cap=5) == [2, 1, 2]


@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.integers(0, 5000)), min_size=1, max_size=40),
       st.integers(1, 8))
def test_repeats_are_bounded_and_never_turn_a_smaller_workload_into_the_largest_by_much(rows, cap):
    workloads, tokens = [w for w, _ in rows], [n for _, n in rows]
    per = repeats(workloads, tokens, cap)
    totals = {w: sum(n for v, n in rows if v == w) for w in per}
    largest = max(totals.values())
    assert all(1 <= r <= cap for r in per.values())
    for w, r in per.items():
        assert r * totals[w] <= 1.5 * largest or totals[w] == 0  # rounding, not overshoot
        if totals[w] == largest:
            assert r == 1
    assert row_repeats(workloads, tokens, cap) == [per[w] for w in workloads]


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="cap"):
        repeats(["a"], [1], cap=0)
    with pytest.raises(ValueError, match="2 workloads but 1"):
        repeats(["a", "b"], [1], cap=2)
    with pytest.raises(ValueError, match="negative answer token count -3 for workload 'b'"):
        repeats(["a", "b"], [1, -3], cap=2)


def test_the_training_folder_repeats_rows_and_keeps_the_held_out_split_exact(tmp_path):
    import torch
    from datasets import load_from_disk

    from eagle3_training.hidden_states import assemble

    train_dir, held_dir = tmp_path / "hs_train", tmp_path / "hs_held_out"
    for folder, n in ((train_dir, 3), (held_dir, 2)):
        folder.mkdir()
        for j in range(n):
            (folder / f"hs_{j}.safetensors").write_bytes(f"{folder.name}-{j}".encode())
    train = [([1, 2, 3], [0, 1, 1]), ([4, 5], [1, 1]), ([6], [1])]
    held = [([7, 8], [1, 1]), ([9], [1])]
    data = tmp_path / "data"
    ratio = assemble(data, (train_dir, train), (held_dir, held), [1, 3, 2])
    links = sorted((data / "hidden_states").iterdir(), key=lambda p: int(p.stem.split("_")[1]))
    assert [p.read_bytes().decode() for p in links] == [
        "hs_train-0", "hs_train-1", "hs_train-1", "hs_train-1", "hs_train-2", "hs_train-2", "hs_held_out-0",
        "hs_held_out-1"]
    ds = load_from_disk(str(data))
    assert [list(map(int, r)) for r in ds["input_ids"]] == [[1, 2, 3], [4, 5], [4, 5], [4, 5], [6], [6], [7, 8], [9]]
    assert int(len(ds) * ratio) == 6  # the trainer's split: exactly the held-out rows validate
    assert torch.load(data / "token_freq.pt", weights_only=True) == {2: 1, 3: 1, 4: 3, 5: 3, 6: 2}
    # a smaller assembly over the same folder leaves no stale links behind
    assemble(data, (train_dir, train), (held_dir, held))
    assert len(list((data / "hidden_states").iterdir())) == 5
    with pytest.raises(ValueError, match="every one of the 3 training rows"):
        assemble(data, (train_dir, train), (held_dir, held), [1, 0, 1])
