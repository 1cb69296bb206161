"""The benchmarks' own arithmetic (bench/measure.py, the EAGLE3 overhead breakdown, the method table's
targets) and the LD_PRELOAD the vLLM processes start with. No engine runs here."""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

# bench/ is on sys.path through pytest's pythonpath (pyproject.toml).
import eagle3_train_step  # noqa: E402
import eagle_agreement  # noqa: E402
import eagle_overhead  # noqa: E402
import measure  # noqa: E402
import process_cpu  # noqa: E402
import step_log  # noqa: E402
import vllm_methods  # noqa: E402

from controller.cli import serve_vllm  # noqa: E402
from controller.engines import vllm_engine as ve  # noqa: E402
from predictor.decision.profiles import cost_profiles  # noqa: E402


@given(st.lists(st.integers(), min_size=1, max_size=8, unique=True), st.integers(1, 10))
def test_rotations_are_permutations_and_move_the_first(items, reps):
    orders = measure.rotations(items, reps)
    assert len(orders) == reps
    for r, order in enumerate(orders):
        assert sorted(order) == sorted(items)
        assert order[0] == items[r % len(items)]


def test_agreement_logistic_recovers_its_coefficients_and_cross_fits():
    rng = np.random.default_rng(0)
    x = np.column_stack([rng.normal(size=4000), rng.integers(0, 2, 4000), np.ones(4000)])
    w = np.array([1.5, -2.0, 0.5])
    y = (rng.random(4000) < 1 / (1 + np.exp(-x @ w))).astype(np.float64)
    np.testing.assert_allclose(eagle_agreement.logistic(x, y), w, atol=0.2)
    fold = np.arange(4000) % 2
    p = eagle_agreement.cross_fitted(x, y, fold)
    p_fold0 = 1 / (1 + np.exp(-x[fold == 0] @ eagle_agreement.logistic(x[fold == 1], y[fold == 1])))
    np.testing.assert_allclose(p[fold == 0], p_fold0)  # each half scored by the model of the other


def test_agreement_cross_fit_learns_only_from_its_training_rows():
    rng = np.random.default_rng(1)
    x = np.column_stack([rng.normal(size=4000), np.ones(4000)])
    y = (rng.random(4000) < 1 / (1 + np.exp(-2.0 * x[:, 0]))).astype(np.float64)
    train = np.arange(4000) % 4 != 0
    y_spoilt = np.where(train, y, 1.0 - y)  # labels outside `train` must not be read
    fold = np.arange(4000) % 2
    np.testing.assert_allclose(eagle_agreement.cross_fitted(x, y_spoilt, fold, train),
                               eagle_agreement.cross_fitted(x, y, fold, train))


@given(st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=3, max_size=3),
                          st.lists(st.integers(-1, 3), min_size=3, max_size=3), st.integers(0, 5)),
                min_size=1, max_size=20))
def test_agreement_length_is_the_shared_lead_within_the_cache_draft(rows):
    head = np.array([h for h, _, _ in rows], dtype=np.int32)
    lead = np.array([c for _, c, _ in rows], dtype=np.int32)
    draft_len = np.array([n for _, _, n in rows])
    got = eagle_agreement.agreement_length(head, lead, draft_len)
    for i, (h, c, n) in enumerate(rows):
        k = 0
        while k < min(n, 3) and c[k] >= 0 and h[k] == c[k]:
            k += 1
        assert got[i] == k


def test_rotations_refuse_no_repetitions():
    with pytest.raises(ValueError, match="reps must be >= 1"):
        measure.rotations([1, 2], 0)


def test_spread_and_format():
    s = measure.spread([3.0, 1.0, 2.0, 10.0])
    assert (s.median, s.lo, s.hi) == (2.5, 1.0, 10.0)
    assert s.fmt(1) == "2.5 [1.0-10.0]"
    with pytest.raises(ValueError, match="no values"):
        measure.spread([])


def test_spec_run_figures_per_1000_tokens():
    run = measure.SpecRun(tokens=500, seconds=10.0, drafts=100, draft_tokens=400, accepted=150)
    assert run.tokens_per_s == 50.0
    assert run.rejected == 250
    assert run.decode_steps == 350
    assert run.figures() == {"steps": 700.0, "drafts": 200.0, "draft_tokens": 800.0, "accepted": 300.0,
                             "rejected": 500.0}
    assert run.raw() == "500 tok/10.00 s, drafts 100, draft tok 400, accepted 150"


def test_served_steps_come_from_vllms_step_count_not_its_accepted_counter():
    """vLLM counts a last draft's accepted tokens past max_tokens; its inter-token latency histogram
    counts the steps. 2 requests, 40 tokens: 12 decode steps + 2 prefills, 26 drafted tokens kept."""
    def page(count: float, total: float) -> str:
        return "\n".join(['vllm:inter_token_latency_seconds_bucket{engine="0",le="0.1"} 1.0',
                          f'vllm:inter_token_latency_seconds_count{{engine="0",model_name="m"}} {count}',
                          f'vllm:inter_token_latency_seconds_sum{{engine="0",model_name="m"}} {total}'])
    steps, apart = measure.served_steps(page(3, 0.5), page(15, 1.1), requests=2)
    assert steps == 14 and apart == pytest.approx(50.0)
    assert measure.served_steps(page(3, 0.5), page(3, 0.5), requests=2) == (None, None)
    run = measure.SpecRun(tokens=40, seconds=2.0, drafts=12, draft_tokens=60, accepted=35, served_steps=steps,
                          step_wall_ms=apart)
    assert run.decode_steps == 14 and run.emitted_accepted == 26 and run.rejected == 34
    assert run.figures()["steps"] == 350.0 and run.figures()["accepted"] == 650.0
    assert "steps 14 (50.0 ms apart)" in run.raw()
    # without the step count, the subtraction, as for the in-process engine
    bare = measure.SpecRun(tokens=40, seconds=2.0, drafts=12, draft_tokens=60, accepted=35)
    assert bare.decode_steps == 5 and bare.rejected == 25


def test_pooled_decode_rate_weighs_requests_by_their_decoding_time():
    # one fast request and two slow ones: the median request decodes at 10 tok/s, all of them at 40
    decoded = [(100, 1.0), (10, 1.0), (10, 1.0)]
    assert measure.pooled_decode_rate(decoded) == 40.0
    assert measure.pooled_decode_rate([]) is None
    run = measure.SpecRun(tokens=123, seconds=3.0, decode_tps=10.0, decode_pooled_tps=40.0)
    assert run.raw().endswith("decode 10.00 tok/s per request (40.00 pooled)")


def _served(pooled: float, requests: list[tuple[str, int, float]] | None) -> measure.SpecRun:
    return measure.SpecRun(tokens=100, seconds=1.0, decode_tps=pooled, decode_pooled_tps=pooled, requests=requests)


def test_paired_ratios_divide_each_repetitions_passes_and_say_which_cannot_pair():
    mine = [_served(110.0, None), _served(90.0, None), _served(130.0, None)]
    theirs = [_served(100.0, None), _served(100.0, None), _served(100.0, None)]
    s = measure.paired_ratios(mine, theirs, lambda r: r.decode_pooled_tps)
    assert (s.median, s.lo, s.hi) == pytest.approx((1.1, 0.9, 1.3))
    with pytest.raises(ValueError, match="as many passes on each side"):
        measure.paired_ratios(mine, theirs[:2], lambda r: r.decode_pooled_tps)
    with pytest.raises(ValueError, match="repetition 2: no rate"):
        measure.paired_ratios(mine, theirs, lambda r: None if r is theirs[1] else r.decode_pooled_tps)


def test_pooled_over_passes_weighs_every_request_of_every_pass():
    # pass 1: 100 tokens in 1 s; pass 2: 100 tokens in 3 s. The median pass's pooled rate would be one
    # of 100 or 33.3; over both passes 200 tokens took 4 s.
    runs = [_served(100.0, [("sql", 60, 0.5), ("agentic", 40, 0.5)]), _served(33.3, [("sql", 100, 3.0)])]
    assert measure.pooled_over_passes(runs) == 50.0
    assert measure.pooled_over_passes(runs + [_served(10.0, None)]) is None
    assert measure.pooled_over_passes([]) is None


def test_report_pairs_hvd_and_suffix_pass_by_pass(capsys):
    results = {("suffix", True): [_served(100.0, [("sql", 100, 1.0)]), _served(50.0, [("sql", 100, 2.0)])],
               ("hvd", True): [_served(110.0, [("sql", 110, 1.0)]), _served(60.0, [("sql", 120, 2.0)])]}
    vllm_methods.report("server", results, ["suffix", "hvd"], (True,), 1, "concurrency")
    out = capsys.readouterr().out
    assert "hvd / suffix, decode pooled, pass by pass: 1.150 [1.100-1.200]" in out
    assert "hvd / suffix, decode pooled over every request of every pass: 1.150 (76.7 / 66.7 tok/s)" in out


def test_spec_run_refuses_impossible_counts():
    with pytest.raises(ValueError, match="tokens > 0"):
        measure.SpecRun(tokens=0, seconds=1.0)
    with pytest.raises(ValueError, match="accepted draft tokens"):
        measure.SpecRun(tokens=10, seconds=1.0, drafts=1, draft_tokens=2, accepted=3)


def test_prometheus_counters_sum_labels_and_take_total_suffix():
    page = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="smollm2"} 12.0',
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="smollm2"} 3.0',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="smollm2"} 1.7e9',
        'vllm:spec_decode_num_draft_tokens_total{engine="0"} 40',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 9.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0"} 1.1e1',
    ])
    assert measure.prometheus_counters(page) == {measure.DRAFTS: 15.0, measure.DRAFT_TOKENS: 40.0,
                                                 measure.ACCEPTED: 11.0}


_PART = st.sampled_from(["target", "hvd", "drafter", "rest", "total"])


@given(st.dictionaries(_PART, st.floats(0, 1e6, allow_nan=False), min_size=1),
       st.text(st.characters(blacklist_characters='"\\}\n', blacklist_categories=("Cs",)), max_size=8))
def test_prometheus_by_label_sums_each_label_value(sums, other):
    page = "\n".join(
        ["# TYPE hvd_step_seconds histogram"]
        + [f'hvd_step_seconds_sum{{part="{part}",replica="{other}"}} {v!r}' for part, v in sums.items()]
        + [f'hvd_step_seconds_sum{{replica="b",part="{part}"}} 1.5' for part in sums]  # a second series, labels reordered
        + [f'hvd_step_seconds_count{{part="{part}"}} 99' for part in sums]  # another sample name: not summed
        + ['hvd_step_seconds_sum{replica="c"} 7'])  # no part: skipped
    got = measure.prometheus_by_label(page, "hvd_step_seconds_sum", "part")
    assert got.keys() == sums.keys()
    for part, v in sums.items():
        assert got[part] == pytest.approx(v + 1.5)
    assert measure.prometheus_by_label(page, "hvd_step_seconds_sum", "part", {"replica": "b"}) == dict.fromkeys(sums, 1.5)


def test_step_part_ms_is_each_parts_mean_over_the_steps_between_two_pages():
    def page(steps: int, seconds: dict[str, float]) -> str:
        return "\n".join([f'hvd_step_seconds_sum{{part="{p}",phase="decode"}} {v}' for p, v in seconds.items()]
                         + [f'hvd_step_seconds_count{{part="{p}",phase="decode"}} {steps}' for p in seconds]
                         + [f'hvd_step_seconds_sum{{part="{p}",phase="prefill"}} {100 * steps}' for p in seconds]
                         + [f'hvd_step_seconds_count{{part="{p}",phase="prefill"}} {steps}' for p in seconds])

    before = page(10, {"target": 0.2, "hvd": 0.01, "total": 0.25})
    after = page(30, {"target": 0.6, "hvd": 0.02, "total": 0.75})
    assert measure.step_part_ms(before, after) == pytest.approx({"target": 20.0, "hvd": 0.5, "total": 25.0})
    assert measure.step_part_ms(before, after, phase="prefill") == pytest.approx({"target": 1e5, "hvd": 1e5, "total": 1e5})
    assert measure.step_part_ms(before, before) is None  # no step between them
    assert measure.step_part_ms("", "vllm:spec_decode_num_drafts_total 3") is None  # not an HVD server


def test_promises_pair_each_drafters_promised_and_accepted_tokens_between_two_pages():
    def page(promised: dict[str, float], accepted: dict[str, float]) -> str:
        return "\n".join([f'hvd_promised_tokens_total{{workload="sql",tenant="a",drafter="{d}"}} {v}'
                          for d, v in promised.items()]
                         + [f'hvd_accepted_tokens_total{{workload="{w}",tenant="a",drafter="{d}"}} {v / 2}'
                            for d, v in accepted.items() for w in ("sql", "chat")])

    before = page({"cache": 10.0, "model": 1.0}, {"cache": 8.0, "model": 1.0})
    after = page({"cache": 110.5, "model": 1.0}, {"cache": 98.0, "model": 3.0})
    assert measure.promises(before, after) == {"cache": pytest.approx((100.5, 90.0))}  # model: nothing promised
    assert measure.promises(before, before) is None
    assert measure.promises("", "vllm:spec_decode_num_drafts_total 3") is None  # not an HVD server


def test_the_oracle_counts_and_the_share_of_its_headroom():
    def page(matched: int, diverged: int) -> str:
        return (f'hvd_oracle_requests_total{{outcome="matched"}} {matched}\n'
                f'hvd_oracle_requests_total{{outcome="diverged"}} {diverged}\n'
                f'hvd_oracle_requests_created{{outcome="matched"}} 1.7e9\n')

    assert measure.oracle_outcomes(page(12, 0), page(24, 1)) == {"matched": 12, "diverged": 1}
    assert measure.oracle_outcomes("", "vllm:spec_decode_num_drafts_total 3") is None  # not measuring the bound
    assert measure.headroom_share(110.0, 100.0, 120.0) == pytest.approx(0.5)
    assert measure.headroom_share(95.0, 100.0, 120.0) == pytest.approx(-0.25)  # below the base
    assert measure.headroom_share(130.0, 100.0, 100.0) is None  # the bound no better: no headroom to share


def test_counts_are_priced_with_the_fitted_line_and_the_methods_own_parts(capsys):
    page = "".join(f'hvd_live_cost_ms{{term="{t}"}} {v}\n' for t, v in
                   (("base", 24.0), ("batch", 5.0), ("query_token", 2.0), ("drafter_call", 1.8),
                    ("drafter_token", 1.1), ("floor_per_query_token", 0.0)))
    line = measure.live_cost_line(page)
    assert line["base"] == 24.0 and line["query_token"] == 2.0
    assert measure.live_cost_line("vllm:spec_decode_num_drafts_total 3") is None  # no fit: no line
    two = [("sql", 60, 1.0), ("chat", 40, 1.0)]  # 2 requests: 2 prefills, 98 decoded tokens
    suffix = replace(measure.SpecRun(100, 2.0, 30, 120, 70), served_steps=32, requests=two)
    hvd = replace(measure.SpecRun(100, 2.0, 25, 150, 75), served_steps=27, requests=two,
                  step_ms={"target": 40.0, "hvd": 1.0, "drafter": 2.0, "rest": 0.5}, live_cost=line)
    # suffix: 30 decode steps at 29 - 1 (HVD's own time out of the fixed cost) ms + (30 + 120) query tokens at 2 ms
    assert measure.priced_per_1k(suffix, line, 1.0) == pytest.approx((30 * 28.0 + 150 * 2.0) / 98)
    # hvd: 25 steps at 28 + its own 1 + 2 ms, + (25 + 150) query tokens at 2 ms
    assert measure.priced_per_1k(hvd, line, 1.0) == pytest.approx((25 * 31.0 + 175 * 2.0) / 98)
    assert measure.priced_per_1k(replace(suffix, served_steps=None), line, 1.0) is None  # not served
    vllm_methods.report("server", {("suffix", True): [suffix], ("hvd", True): [hvd]}, ["suffix", "hvd"], (True,), 1,
                        "concurrency")
    out = capsys.readouterr().out
    assert f"hvd {1125 / 98:.3f} ({1140 / 1125:.3f}x suffix)" in out and f"suffix {1140 / 98:.3f}" in out


@given(st.text(st.characters(blacklist_characters="\n\x00", blacklist_categories=("Cs",)), max_size=20),
       st.integers(0, 2**31), st.integers(0, 2**40), st.integers(0, 2**40))
def test_proc_stat_parser_reads_past_any_name(comm, pgid, utime, stime):
    fields = ["S", "1", str(pgid)] + ["0"] * 8 + [str(utime), str(stime)] + ["0"] * 39
    stat = process_cpu.parse_stat(f"4242 ({comm}) " + " ".join(fields) + "\n")
    assert stat == process_cpu.TaskStat(comm=comm, pgid=pgid, cpu_ticks=utime + stime)


def test_proc_stat_parser_names_what_is_wrong():
    with pytest.raises(ValueError, match="no '\\(comm\\)'"):
        process_cpu.parse_stat("4242 S 1 2 3")
    with pytest.raises(ValueError, match="3 fields after the name"):
        process_cpu.parse_stat("4242 (python) S 1 2")


def test_cpu_roles_put_hvd_threads_apart_from_the_process_they_run_in():
    assert process_cpu.role("VLLM::Worker", "hvd-event-write") == "hvd threads"
    assert process_cpu.role("VLLM::Worker", "VLLM::Worker") == "worker"
    assert process_cpu.role("VLLM::EngineCor", "VLLM::EngineCor") == "engine core"
    assert process_cpu.role("vllm", "uvloop-worker") == "api server"


def test_group_cpu_reads_this_process_group_from_proc():
    import os
    import threading

    stop = threading.Event()

    def spin() -> None:
        from controller.services.lifecycle import name_native_thread

        name_native_thread("hvd-test-spin")
        while not stop.is_set():
            sum(range(1000))

    before = process_cpu.group_cpu(os.getpgrp())
    t = threading.Thread(target=spin)
    t.start()
    deadline = time.monotonic() + 10
    while process_cpu.cpu_delta(before, process_cpu.group_cpu(os.getpgrp()))["hvd threads"] < 0.05:
        assert time.monotonic() < deadline, "the named thread's CPU never showed up as hvd threads"
        time.sleep(0.01)
    stop.set()
    t.join()
    assert process_cpu.group_cpu(-1) == dict.fromkeys(process_cpu.ROLES, 0.0)  # no such group: nothing


def test_counter_deltas_and_run_from():
    before = {measure.DRAFTS: 5.0, measure.DRAFT_TOKENS: 20.0}
    after = {measure.DRAFTS: 9.0, measure.DRAFT_TOKENS: 36.0, measure.ACCEPTED: 7.0}
    deltas = measure.counter_deltas(before, after)
    assert deltas == {measure.DRAFTS: 4, measure.DRAFT_TOKENS: 16, measure.ACCEPTED: 7}
    assert measure.run_from(100, 2.0, deltas) == measure.SpecRun(100, 2.0, 4, 16, 7)


def test_verdict_says_by_how_much():
    assert measure.verdict(1.2, 1.15) == "met"
    assert measure.verdict(1.05, 1.15) == "NOT met (by 0.1)"
    assert measure.verdict(0.2, 0.3, higher_is_better=False) == "met"
    assert measure.verdict(0.4, 0.3, higher_is_better=False) == "NOT met (by 0.1)"


@given(st.lists(st.integers(0, 30), min_size=1, max_size=20), st.integers(0, 2**32 - 1))
def test_survival_curves_are_monotone_and_end_with_the_draft(lengths, seed):
    curves = measure.survival_curves(np.random.default_rng(seed), np.array(lengths), 24)
    assert curves.shape == (len(lengths), 24)
    assert np.all(np.diff(curves, axis=1) <= 0)
    assert np.all((curves >= 0) & (curves <= 1))
    for row, n in zip(curves, lengths):
        assert np.all(row[min(n, 24):] == 0) and np.all(row[: min(n, 24)] > 0)


def test_method_targets_name_the_best_other_and_the_gap(capsys):
    run = lambda tps, drafted=0, acc=0: measure.SpecRun(int(tps * 10), 10.0, drafted, drafted, acc)  # noqa: E731
    results = {("none", True): [run(20)], ("suffix", True): [run(40, 300, 100)], ("hvd", True): [run(44, 200, 100)]}
    medians = vllm_methods.report("engine", results, ["none", "suffix", "hvd"], (True,), 8, "batch")
    out = capsys.readouterr().out
    assert "hvd / best other (suffix): 1.100  (target >= 1.15: NOT met (by 0.05))" in out
    # rejected per 1000: suffix 200 of 400 tokens -> 500; hvd 100 of 440 -> 227.3
    assert "rejected draft tokens per 1000: hvd 227.3 vs suffix 500.0  (target fewer than suffix: met)" in out
    assert medians["on"]["hvd"]["tokens_per_s"] == 44.0


def test_eagle_breakdown_parts_add_up_to_the_call():
    record = {"call": 10.0, "propose": 8.0, "fc combine": 0.5, "forward": 3.0, "lm head": 1.0, "compute_logits": 1.75,
              "sample": 2.0, "attn meta": 1.0, "input prep": 0.5}
    parts = eagle_overhead.breakdown(record)
    assert parts == {"runner prep": 2.0, "fc combine": 0.5, "forward": 3.0, "lm head": 1.0, "d2t scatter": 0.75,
                     "argmax": 0.25, "attn meta": 1.0, "input prep": 0.5, "rest": 1.0}
    assert sum(parts.values()) == pytest.approx(record["call"])
    local = {"call": 4.0, "propose": 3.5, "forward": 2.0, "lm head": 0.5, "get_top_tokens": 0.7, "sample": 0.7}
    parts = eagle_overhead.breakdown(local)
    assert parts["d2t scatter"] == 0.0 and parts["argmax"] == pytest.approx(0.2)
    assert sum(parts.values()) == pytest.approx(local["call"])


def _libs(tmp_path: Path, *names: str) -> Path:
    d = tmp_path / "lib"
    d.mkdir(exist_ok=True)
    for n in names:
        (d / n).write_bytes(b"")
    return d


def test_preload_names_every_missing_library(tmp_path):
    with pytest.raises(ve.PreloadError, match="libtcmalloc_minimal.so.4 from the Debian package "
                                              "libtcmalloc-minimal4.*and libiomp5.so from the PyPI package intel-openmp"):
        ve.preload_libraries([_libs(tmp_path)])
    with pytest.raises(ve.PreloadError, match="libiomp5.so") as err:
        ve.preload_libraries([_libs(tmp_path, "libtcmalloc_minimal.so.4")])
    assert "tcmalloc" not in str(err.value).split(" not found")[0]


def test_ld_preload_puts_ours_first_and_keeps_theirs_once(tmp_path):
    d = _libs(tmp_path, "libtcmalloc_minimal.so.4", "libiomp5.so")
    tc, iomp = str(d / "libtcmalloc_minimal.so.4"), str(d / "libiomp5.so")
    assert ve.ld_preload(None, [d]) == f"{tc}:{iomp}"
    assert ve.ld_preload(f"/x/libfoo.so {iomp}", [d]) == f"{tc}:{iomp}:/x/libfoo.so"


def test_subprocess_env_only_touches_ld_preload_when_asked():
    base = {"PATH": "/bin", "LD_PRELOAD": "/x/libfoo.so"}
    assert ve.subprocess_env(False, base) == base
    on = ve.subprocess_env(True, base)  # the libraries `make setup` installs
    libs = on["LD_PRELOAD"].split(":")
    assert "libtcmalloc" in libs[0] and libs[1].endswith("libiomp5.so") and libs[2] == "/x/libfoo.so"
    assert all(Path(p).is_file() for p in libs[:2])
    assert base["LD_PRELOAD"] == "/x/libfoo.so"


def test_method_table_has_hvd_binary():
    assert "hvd-binary" in ve.METHODS
    assert ve.method_env("hvd-binary") == {"HVD_HYBRID": "1", "HVD_RULE": "binary", "HVD_MODEL_DRAFT_LEN": "3",
                                           "HVD_ON_POLICY": None, "HVD_LIVE_COST_FLOOR": None}
    assert ve.method_env("hvd-off-policy")["HVD_ON_POLICY"] == "0"  # the hybrid with on_policy off
    assert ve.method_env("hvd-floor")["HVD_LIVE_COST_FLOOR"] == "1"  # the hybrid whose live fit may add a floor
    assert ve.method_env("hvd")["HVD_RULE"] is None  # the runtime's default rule
    assert ve.speculative_config("hvd-binary") == ve.speculative_config("hvd")
    # the cut bench/eagle_overhead.py measured, for every EAGLE3-based method alike
    for m in ("eagle3", "arctic", "hvd", "hvd-binary"):
        assert ve.speculative_config(m)["use_local_argmax_reduction"] is True


def test_committed_head_maps_draft_ids_to_increasing_target_ids():
    """What makes the local argmax pick the same token as vLLM's full-vocabulary argmax, ties included."""
    import torch
    from safetensors.torch import load_file

    d2t = load_file(str(ve.EAGLE_HEAD / "model.safetensors"))["d2t"]
    targets = torch.arange(d2t.numel()) + d2t
    assert bool((targets[1:] > targets[:-1]).all())


def test_serve_command_preloads_unless_switched_off(monkeypatch, tmp_path):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))  # not the emptied folder of a real port-8000 server
    argv, env = serve_vllm.command(serve_vllm.ServeOptions("sqlite:///x.db"))
    assert "libtcmalloc" in env["LD_PRELOAD"] and "libiomp5.so" in env["LD_PRELOAD"]
    assert argv[argv.index("--speculative-config") + 1].startswith('{"method": "eagle3"')
    _, env = serve_vllm.command(serve_vllm.ServeOptions("sqlite:///x.db", preload=False))
    assert "LD_PRELOAD" not in env


def test_baseline_server_is_the_same_server_without_the_plugin(monkeypatch):
    monkeypatch.setenv("HVD_HYBRID", "1")
    argv, env = vllm_methods.server_command("none", 8123, False, "sqlite:///x.db")
    hvd_argv, hvd_env = vllm_methods.server_command("hvd", 8123, False, "sqlite:///x.db")
    assert "--speculative-config" not in argv and "HVD_HYBRID" not in env
    assert hvd_env["HVD_HYBRID"] == "1"
    spec = hvd_argv.index("--speculative-config")
    assert hvd_argv[:spec] + hvd_argv[spec + 2:] == argv
    # the flags every server of the benchmark ran with before `hvd serve` kept vLLM's defaults, passed
    # after `--` now (bf16, no prefix caching, eager, 8 sequences, 4096 tokens): its figures stay comparable
    assert argv[3:] == ["--host", "127.0.0.1", "--port", "8123", "--served-model-name", "smollm2",
                        "--model", str(ve.MODEL_BF16), "--dtype", "bfloat16", "--shutdown-timeout", "10",
                        "--max-model-len", "4096",
                        "--max-num-seqs", "8", "--max-num-batched-tokens", "4096", "--enforce-eager",
                        "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.5"]
    suffix, _ = vllm_methods.server_command("suffix", 8123, False, "sqlite:///x.db")
    assert suffix[suffix.index("--speculative-config") + 1] == '{"method": "suffix", "num_speculative_tokens": 24}'
    with pytest.raises(ValueError, match="baselines"):
        vllm_methods.server_command("hvd-binary", 8123, False, "sqlite:///x.db")
    none_argv, none_env = vllm_methods.server_command("hvd-none", 8123, False, "sqlite:///x.db")
    assert none_env["HVD_FALLBACK"] == "none" and hvd_env["HVD_FALLBACK"] == "model"
    assert none_argv[none_argv.index("--speculative-config") + 1] == suffix[suffix.index("--speculative-config") + 1]
    floor_argv, floor_env = vllm_methods.server_command("hvd-floor", 8123, False, "sqlite:///x.db")
    assert floor_env["HVD_LIVE_COST_FLOOR"] == "1" and "HVD_LIVE_COST_FLOOR" not in hvd_env and floor_argv == hvd_argv


@pytest.mark.parametrize(("flags", "native"), [("fpu avx2 fma", False), ("avx2 avx512f avx512_bf16", True),
                                               ("avx2 amx_bf16 amx_tile", True), ("avx512f avx512bw", False)])
def test_training_step_bench_uses_bf16_only_where_the_cpu_has_it(tmp_path, flags, native):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert eagle3_train_step.native_bf16(cpuinfo) is native
    assert eagle3_train_step.native_bf16(tmp_path / "missing") is False


def test_the_server_warm_up_is_training_prompts_never_the_measured_ones():
    """--warmup fills the suffix cache with other requests' answers, never the measured prompts'."""
    from eagle3_training.corpus import bench_prompts

    warm = vllm_methods.warmup_prompts(2)
    measured = bench_prompts(vllm_methods.BENCH_WORKLOADS, 4)
    assert [w for w, _ in warm] == list(vllm_methods.BENCH_WORKLOADS) * 2  # balanced, interleaved
    assert not {tuple(ids) for _, ids in warm} & {tuple(ids) for _, ids in measured}
    assert vllm_methods.warmup_prompts(0) == []


def test_a_served_runs_requests_survive_its_json():
    run = measure.SpecRun(tokens=40, seconds=2.0, drafts=12, draft_tokens=60, accepted=35,
                          requests=[("sql", 19, 0.5), ("agentic", 19, 0.25)])
    back = measure.SpecRun(**json.loads(json.dumps(run.to_dict())))
    assert [tuple(r) for r in back.requests] == run.requests and back.figures() == run.figures()


def test_the_step_log_is_read_binned_and_priced_with_the_fit_of_its_steps(tmp_path, monkeypatch, capsys):
    from controller.core.step_costs import StepTiming
    from controller.services.step_log import StepLog

    log = StepLog(tmp_path / "steps.jsonl")
    rng = np.random.default_rng(0)
    for i in range(200):  # t = 40 + 1 ms a query token, + 8 ms when the drafter runs (k 1..3)
        q, k = int(rng.integers(1, 25)), int(rng.integers(0, 4)) * (i % 3 == 0)
        total = (40.0 + q + (8.0 if k else 0.0)) / 1000
        log.add((StepTiming.of(1.7e9 + i, 1, q, k, target=total - 0.001, hvd=0.001, drafter=0.0, rest=0.0), True))
    log.add((StepTiming.of(1.7e9, 1, 600, 0, target=0.3, hvd=0.001, drafter=0.0, rest=0.0), False))  # a prefill
    assert log.flush()
    steps = step_log.read_steps(tmp_path / "steps.jsonl")
    assert len(steps) == 200 and all(s["query_tokens"] < 600 for s in steps)
    fit = step_log.fit_steps(steps, cost_profiles()["cpu-smollm2"])
    assert fit.predict_ms(1, 10, 0) == pytest.approx(50.0, abs=0.5)  # the steps' own line, not the prior's
    # the drafter's 8 ms, on average over the steps that ran it: most of the way from the prior's price
    # (the fit's ridge pull toward the prior holds back a direction ~70 drafter steps identify weakly)
    prior = cost_profiles()["cpu-smollm2"]
    ks = [s["model_k"] for s in steps if s["model_k"]]
    fitted = np.mean([fit.predict_ms(1, 10, k) - fit.predict_ms(1, 10, 0) for k in ks])
    assumed = np.mean([prior.step_ms(1, 10, k) - prior.step_ms(1, 10, 0) for k in ks])
    assert abs(fitted - 8.0) < 1.5 and abs(fitted - 8.0) < abs(assumed - 8.0) / 2
    monkeypatch.setattr("sys.argv", ["step_log.py", str(tmp_path / "steps.jsonl")])
    step_log.main()
    out = capsys.readouterr().out
    assert "200 decode steps; the live fit of them all: t = " in out and "without the model drafter: " in out
    assert "with it (its k > 0): " in out
    (tmp_path / "bad.jsonl").write_text('{"phase": "decode", "batch": 1}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:1: not a step line of HVD_STEP_LOG"):
        step_log.read_steps(tmp_path / "bad.jsonl")
