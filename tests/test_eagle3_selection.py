"""The epoch and learning rate are chosen by held-out expected accepted length, not by the loss."""
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eagle3_training.selection import VALIDATION_FILE, best, figures_of, read_epochs


def metrics(accs, loss):
    return {**{f"full_acc_{i}_epoch": a for i, a in enumerate(accs)}, "loss_epoch": loss}


def test_the_epoch_serving_gains_most_from_wins_over_the_lower_loss(tmp_path):
    for epoch, (accs, loss) in enumerate([((0.40, 0.20, 0.10), 8.0), ((0.50, 0.30, 0.15), 7.9),
                                          ((0.49, 0.29, 0.14), 7.5)]):
        (tmp_path / str(epoch)).mkdir()
        (tmp_path / str(epoch) / VALIDATION_FILE).write_text(json.dumps(metrics(accs, loss)))
    (tmp_path / "3").mkdir()  # a checkpoint without validation (interrupted) is not a candidate
    epochs = read_epochs(tmp_path)
    assert [e.epoch for e in epochs] == [0, 1, 2]
    assert best(epochs).epoch == 1
    assert best(epochs).expected_accepted == pytest.approx(0.95)


def test_ties_go_to_the_lower_loss_then_the_earlier_epoch():
    a, b, c = figures_of(0, metrics((0.5, 0.2, 0.1), 7.0)), figures_of(1, metrics((0.5, 0.2, 0.1), 6.0)), \
        figures_of(2, metrics((0.5, 0.2, 0.1), 6.0))
    assert best([a, b, c]) is b


def test_missing_metrics_are_named():
    with pytest.raises(ValueError, match="full_acc_2_epoch"):
        figures_of(4, {"full_acc_0_epoch": 0.1, "full_acc_1_epoch": 0.1, "loss_epoch": 1.0})
    with pytest.raises(ValueError, match="no validated epoch"):
        best([])


@given(st.lists(st.tuples(st.lists(st.floats(0, 1), min_size=3, max_size=3), st.floats(0, 20)), min_size=1,
                max_size=8))
def test_the_best_is_never_beaten_in_expected_accepted_length(rows):
    figures = [figures_of(i, metrics(accs, loss)) for i, (accs, loss) in enumerate(rows)]
    chosen = best(figures)
    assert all(f.expected_accepted <= chosen.expected_accepted + 1e-6 for f in figures)
