"""`hvd profile` without vLLM: the user profiles file (writing, reading back, merging after the bundled
profiles, its errors), the fit of timed steps into a cost profile, and the command with a fake
measurement in place of the vLLM child process. (The real measurement is run by hand: it takes
minutes of the CPU; docs/reference/cli.md gives a run.)"""
from __future__ import annotations

import math
import tomllib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.cli.main import main as hvd_main
from controller.cli.profile import ProfileOptions, busy_warning, parse_sizes, prepare, run_profile
from controller.engines.vllm_profiler import (
    Measurement,
    MeasurePlan,
    ProfiledStep,
    ProfilerError,
    fit_steps,
    measured_profile,
)
from controller.settings import SettingsError, read
from predictor.decision.live_cost import StepSample
from predictor.decision.profiles import (
    PROFILES_FILE,
    USER_PROFILES_ENV,
    CostProfile,
    ProfileError,
    cost_profiles,
    drafter_profiles,
    dumps_toml,
    save_cost_profile,
    user_profiles_file,
)

BUNDLED_COST = set(tomllib.loads(PROFILES_FILE.read_text())["cost"])
TRUE_LINE = (9.0, 2.5, 0.6)  # a, b per running request, c per query token, ms


@pytest.fixture(autouse=True)
def _away_from_the_checkout(tmp_path, monkeypatch):
    """Each test in its own working directory (var/profiles.toml is relative to it), with
    HVD_PROFILES_FILE unset, so a deployment's own file in the checkout plays no part."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(USER_PROFILES_ENV, raising=False)


def _profile(name: str = "mine", **changes) -> CostProfile:
    spec = dict(base_ms=12.5, per_token_ms=0.5, draft_token_ms=1.5, batch8_base_ms=30.25, batch8_per_token_ms=4.0,
                batch8_draft_token_ms=2.2, description="measured here")
    return CostProfile(name, **{**spec, **changes})


# ------------------------------------------------------------------ the TOML writer
_value = st.recursive(st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats(allow_nan=False) | st.text(),
                      lambda inner: st.lists(inner, max_size=4), max_leaves=8)
_tables = st.dictionaries(st.text(max_size=12), st.dictionaries(st.text(max_size=12), _value, max_size=4)
                          | _value, max_size=4)


@given(st.dictionaries(st.text(max_size=12), _tables, max_size=3))
def test_the_writer_round_trips_any_tables(data):
    assert tomllib.loads(dumps_toml(data, "a header\nof two lines")) == data


@given(name=st.text(min_size=1, max_size=20), description=st.text(),
       base=st.floats(min_value=1e-9, max_value=1e6), slope=st.floats(min_value=0, max_value=1e3))
def test_a_cost_profile_reads_back_identically(tmp_path_factory, name, description, base, slope):
    path = tmp_path_factory.mktemp("w") / "profiles.toml"
    if name in BUNDLED_COST:
        return
    profile = _profile(name, base_ms=base, per_token_ms=slope, description=description)
    save_cost_profile(profile, path)
    assert cost_profiles(environ={USER_PROFILES_ENV: str(path)})[name] == profile


def test_awkward_strings_are_escaped():
    text = 'quote " backslash \\ newline \n tab \t nul \x00 del \x7f unicode é ☃ 𝄞 """'
    toml = dumps_toml({"cost": {'na"me\\': {"description": text}}})
    assert "\n" not in toml.split("description = ", 1)[1].rstrip("\n")  # one line: a basic string
    assert tomllib.loads(toml)["cost"]['na"me\\']["description"] == text


def test_special_floats_and_a_value_toml_cannot_hold():
    back = tomllib.loads(dumps_toml({"t": {"x": float("inf"), "y": -0.0, "z": float("nan"), "w": 1e-300}}))["t"]
    assert back["x"] == math.inf and math.copysign(1, back["y"]) < 0 and math.isnan(back["z"]) and back["w"] == 1e-300
    with pytest.raises(ProfileError, match=r"t\.when: cannot write a date value"):
        import datetime
        dumps_toml({"t": {"when": datetime.date(2026, 1, 1)}})
    with pytest.raises(ProfileError, match="lone surrogate"):
        dumps_toml({"t": {"s": "\ud800"}})


# ------------------------------------------------------------------ storing and merging
def test_replacing_keeps_the_other_entries(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('[cost.other]\ndescription = "by hand"\nbase_ms = 5.0\nper_token_ms = 1.0\ndraft_token_ms = 0.5\n'
                    'sources = ["a", "b"]\n\n[drafter.mine]\ndraft_len = 2\nacceptance = 0.5\n'
                    '[drafter.mine.by_workload]\nsql = 0.7\n')
    save_cost_profile(_profile(base_ms=10.0), path)
    save_cost_profile(_profile(base_ms=11.0), path)  # replaced, not added twice
    env = {USER_PROFILES_ENV: str(path)}
    costs = cost_profiles(environ=env)
    assert costs["mine"].base_ms == 11.0
    assert costs["other"] == CostProfile("other", 5.0, 1.0, 0.5, description="by hand", sources=("a", "b"))
    assert drafter_profiles(environ=env)["mine"].acceptance_for("sql") == 0.7
    assert set(costs) == BUNDLED_COST | {"mine", "other"}
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file is gone


def test_a_bundled_name_is_refused_when_writing_and_when_reading(tmp_path):
    path = tmp_path / "p.toml"
    with pytest.raises(ProfileError, match="'cpu-smollm2' is a bundled one"):
        save_cost_profile(_profile("cpu-smollm2"), path)
    assert not path.exists()
    path.write_text('[cost.gpu-8b]\nbase_ms = 1.0\nper_token_ms = 1.0\ndraft_token_ms = 1.0\n')
    with pytest.raises(ProfileError, match=r"p\.toml: cost profile name\(s\) \['gpu-8b'\] are bundled ones"):
        cost_profiles(environ={USER_PROFILES_ENV: str(path)})


def test_the_default_file_is_read_only_if_it_exists(tmp_path):
    assert user_profiles_file({}) is None and set(cost_profiles()) == BUNDLED_COST
    save_cost_profile(_profile(), Path("var/profiles.toml"))  # relative to the working directory
    assert user_profiles_file({}) == Path("var/profiles.toml")
    assert cost_profiles()["mine"] == _profile()
    assert read("HVD_COST_PROFILE", {"HVD_COST_PROFILE": "mine"}) == "mine"  # the setting accepts it


def test_an_explicit_file_that_is_missing_is_an_error_naming_it(tmp_path):
    env = {USER_PROFILES_ENV: str(tmp_path / "nope.toml")}
    with pytest.raises(ProfileError, match=r"HVD_PROFILES_FILE='.*nope\.toml' names no file"):
        cost_profiles(environ=env)
    with pytest.raises(ProfileError, match="HVD_PROFILES_FILE"):
        drafter_profiles(environ=env)


@pytest.mark.parametrize("text, message", [
    ("[cost.x\n", r"bad\.toml: not valid TOML"),
    ("[costs.x]\nbase_ms = 1.0\n", r"unknown top-level key\(s\) \['costs'\]"),
    ("cost = 3\n", r"`cost` must hold one table per profile"),
    ("[cost.x]\nbase_ms = 1.0\nper_token_ms = 1.0\n", r"cost profile 'x': .*draft_token_ms"),
    ("[cost.x]\nbase_ms = 1.0\nper_token_ms = 1.0\ndraft_token_ms = 1.0\nspeed = 2\n", r"cost profile 'x': .*speed"),
    ("[cost.x]\nbase_ms = -1.0\nper_token_ms = 1.0\ndraft_token_ms = 1.0\n", r"bad\.toml: cost profile x: base_ms"),
])
def test_a_bad_user_file_names_the_file_and_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ProfileError, match=message):
        cost_profiles(environ={USER_PROFILES_ENV: str(path)})


def test_the_setting_reports_a_missing_file(tmp_path, monkeypatch):
    monkeypatch.setenv(USER_PROFILES_ENV, str(tmp_path / "gone.toml"))
    with pytest.raises(SettingsError, match=r"HVD_COST_PROFILE='x'.*HVD_PROFILES_FILE=.*gone\.toml' names no file"):
        read("HVD_COST_PROFILE", {"HVD_COST_PROFILE": "x"})


# ------------------------------------------------------------------ the fit
def _measurement(batches=(1, 8), query=(1, 4, 16), steps=20, line=TRUE_LINE, noise=0.02, pauses=0.0,
                 seed=0) -> Measurement:
    rng = np.random.default_rng(seed)
    a, b, c = line
    out = []
    for batch in batches:
        for n in query:
            for _ in range(steps):
                ms = (a + b * batch + c * batch * n) * rng.lognormal(0.0, noise)
                if rng.random() < pauses:
                    ms *= rng.uniform(3, 10)
                out.append(ProfiledStep(batch, n, StepSample(batch, batch * n, 0, ms / 1000)))
    plan = MeasurePlan("var/models/x", "float32", batches=batches, query=query, steps=steps)
    return Measurement(plan, tuple(out), 0, "Test CPU", 2, "0.32.0", True, "2026-12-05", 30.0, 90.0)


def test_the_fit_recovers_a_known_line_from_step_timings():
    prior = cost_profiles()["cpu-smollm2"]  # another machine's line: the data must win
    m = _measurement(pauses=0.05)
    profile, fit = measured_profile(m, "here", prior)
    assert fit.coefficients[:3] == pytest.approx(TRUE_LINE, rel=0.03)
    assert fit.samples == len(m.steps) == 120 and fit.median_relative_error < 0.03
    a, b, c = TRUE_LINE
    for batch in (1, 2, 8, 16):
        for n in (1, 4, 16):
            assert profile.step_ms(batch, batch * n) == pytest.approx(a + b * batch + c * batch * n, rel=0.03)
    # the model drafter's costs are the prior's, and the description says what was measured
    assert (profile.draft_call_ms, profile.draft_token_ms, profile.batch8_draft_token_ms) == \
        (prior.draft_call_ms, prior.draft_token_ms, prior.batch8_draft_token_ms)
    for words in ("MEASURED by `hvd profile` on 2026-12-05", "Test CPU (2 CPUs, load average 0.0 at the start)", "float32", "batch 1, 8",
                  "n = 1, 4, 16", "20 timed steps", "median absolute percentage error",
                  "draft_call_ms and draft_token_ms are the prior cpu-smollm2's, NOT measured"):
        assert words in profile.description
    assert profile.name == "here" and profile.compute_ms_per_token == 0


def test_noiseless_steps_give_the_line_exactly():
    line_prior = measured_profile(_measurement(noise=0.0), "p", cost_profiles()["cpu-smollm2"])[0]
    model = fit_steps([s.sample for s in _measurement(noise=0.0).steps], line_prior)
    assert model.current.coefficients[:3] == pytest.approx(TRUE_LINE, rel=1e-4)


def test_nothing_timed_is_an_error():
    with pytest.raises(ProfilerError, match="no decode step was timed"):
        fit_steps([], cost_profiles()["cpu-smollm2"])


def test_a_measurement_survives_its_json():
    m = _measurement(steps=2)
    assert Measurement.from_json(m.to_json()) == m


# ------------------------------------------------------------------ the command, with a fake measurement
def _fake(plan: MeasurePlan, preload: bool, say) -> Measurement:
    m = _measurement(batches=plan.batches, query=plan.query, steps=plan.steps)
    return Measurement(plan, m.steps, 0, m.cpu, m.cpus, m.vllm_version, preload, m.date, m.startup_s, m.seconds)


def _model(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text("{}")
    return folder


def test_the_command_stores_a_profile_the_settings_accept(tmp_path):
    said = []
    opts = ProfileOptions(name="here-fp32", model=_model(tmp_path), dtype="float32", query=(1, 4, 16), steps=5)
    assert run_profile(opts, say=said.append, measure=_fake) == 0
    assert "hvd profile: added [cost.here-fp32] in var/profiles.toml" in said
    assert any("HVD_COST_PROFILE=here-fp32" in line and "HVD_PROFILES_FILE" not in line for line in said)
    profile = cost_profiles()["here-fp32"]
    assert profile.step_ms(8, 32) == pytest.approx(9.0 + 2.5 * 8 + 0.6 * 32, rel=0.03)
    assert read("HVD_COST_PROFILE", {"HVD_COST_PROFILE": "here-fp32"}) == "here-fp32"
    run_profile(opts, say=said.append, measure=_fake)
    assert "hvd profile: replaced [cost.here-fp32] in var/profiles.toml" in said


def test_a_busy_machine_and_scattered_steps_are_warned_of(tmp_path):
    assert busy_warning(0.9, 2) is None
    assert "load average 3.2 on 2 CPUs" in busy_warning(3.2, 2)

    def scattered(plan, preload, say):
        m = _measurement(batches=plan.batches, query=plan.query, steps=plan.steps, noise=0.4)
        return Measurement(plan, m.steps, 0, m.cpu, m.cpus, m.vllm_version, preload, m.date, 1.0, 2.0, load=6.5)

    said = []
    run_profile(ProfileOptions(name="noisy", model=_model(tmp_path), dtype="float32", steps=10),
                say=said.append, measure=scattered)
    assert any(line.startswith("hvd profile: warning: the steps scatter") for line in said)
    assert "load average 6.5 at the start" in cost_profiles()["noisy"].description


def test_another_out_file_says_how_to_use_it(tmp_path):
    said = []
    out = tmp_path / "elsewhere.toml"
    run_profile(ProfileOptions(name="x", model=_model(tmp_path), dtype="float32", steps=2, out=out),
                say=said.append, measure=_fake)
    assert any(f"HVD_PROFILES_FILE={out} HVD_COST_PROFILE=x" in line for line in said)
    assert "x" in cost_profiles(environ={USER_PROFILES_ENV: str(out)})


@pytest.mark.parametrize("changes, message", [
    (dict(name="cpu-smollm2"), "'cpu-smollm2' is a bundled one"),
    (dict(name="has space"), "--name 'has space': a profile name is"),
    (dict(name=""), "--name '': a profile name is"),
    (dict(prior="tpu"), r"unknown cost profile\(s\) \['tpu'\]"),
    (dict(batches=(1, 0)), r"--batches must be whole numbers >= 1, got \[1, 0\]"),
    (dict(query=(4, 4)), "--query lists a value twice"),
    (dict(steps=0), "--steps must be a whole number >= 1"),
    (dict(query=(1, 200)), r"n = 200 needs 5664 tokens .*\(max_model_len\)"),
    (dict(batches=(64,), query=(1, 128)), r"more than the engine schedules"),
    (dict(model=Path("no-such-model")), "--model no-such-model: no config.json there"),
])
def test_bad_options_are_refused_before_vllm_starts(tmp_path, changes, message):
    opts = ProfileOptions(**{"name": "ok", "model": _model(tmp_path), "dtype": "float32", **changes})

    def never(*args):
        raise AssertionError("measured despite a bad option")

    with pytest.raises(ValueError, match=message):
        run_profile(opts, say=lambda line: None, measure=never)


def test_a_broken_out_file_is_refused_before_measuring(tmp_path):
    out = tmp_path / "broken.toml"
    out.write_text("[cost.x]\nbase_ms = 'fast'\n")
    with pytest.raises(ProfileError, match="broken.toml"):
        prepare(ProfileOptions(name="ok", model=_model(tmp_path), dtype="float32", out=out))


def test_sizes_are_parsed_or_named():
    assert parse_sizes("--batches", "1,8") == (1, 8)
    with pytest.raises(ValueError, match="--query must be comma-separated whole numbers"):
        parse_sizes("--query", "1,two")


def test_the_cli_is_one_line_and_exit_2_without_touching_a_database(tmp_path, capsys):
    assert hvd_main(["profile", "--name", "gpu-8b"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hvd profile: error: cost profile 'gpu-8b' is a bundled one") and err.count("\n") == 1
    assert not (tmp_path / "var" / "hvd.db").exists()


def test_hvd_profile_fits_a_compute_floor_where_the_steps_show_one():
    """Off the decode path the floor is free: `hvd profile`'s fit looks for one (the live fit, by
    default, keeps the prior's), and the measured profile carries it."""
    rng = np.random.default_rng(3)
    query = np.repeat(np.arange(1, 25), 10)
    ms = np.maximum(28.8 + 0.2 * query, 3.05 * query) * np.exp(rng.normal(0.0, 0.02, len(query)))
    steps = [StepSample(1, int(q), 0, float(t) / 1000.0) for q, t in zip(query, ms)]
    model = fit_steps(steps, cost_profiles()["cpu-smollm2"])
    assert model.current.floor_ms_per_token == pytest.approx(3.05, rel=0.03)
    assert model.profile("here").compute_ms_per_token == model.current.floor_ms_per_token
    line = fit_steps([StepSample(1, int(q), 0, (25.0 + 1.2 * q) / 1000.0) for q in query], cost_profiles()["cpu-smollm2"])
    assert line.current.floor_ms_per_token == 0.0
