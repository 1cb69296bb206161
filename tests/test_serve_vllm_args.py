"""`hvd serve --engine vllm`'s command line, as it would exec vLLM (os.execve captured, no vLLM
started): vLLM's defaults beyond what HVD must set (prefix caching not disabled), the arguments
after `--` passed through verbatim after HVD's, the ones HVD sets itself refused by name with the
option to use instead, and the dtype chosen from the CPU's flags."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from controller.cli import serve_vllm
from controller.cli.main import main
from controller.engines import vllm_engine as ve
from storage.engine import make_engine, session_scope
from storage.migrate import upgrade
from support.gates import random_survival_gate

NO_BF16 = "fpu sse2 avx avx2 fma"
BF16 = "fpu sse2 avx2 avx512f avx512_bf16"
DROPPED = ("--no-enable-prefix-caching", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
           "--gpu-memory-utilization")  # what `hvd serve` imposed before: vLLM's defaults now


@pytest.mark.parametrize("flags, dtype", [
    (set(), "float32"),
    ({"fpu", "avx2", "fma"}, "float32"),
    ({"avx512f", "avx512bw", "avx512_vnni"}, "float32"),  # AVX-512 without its bf16 instructions
    ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),
    ({"avx2", "amx_bf16", "amx_tile"}, "bfloat16"),
    ({"amx_bf16", "avx512_bf16"}, "bfloat16"),
])
def test_default_dtype_from_cpu_flags(flags, dtype):
    assert ve.default_dtype(flags) == dtype
    assert ve.default_dtype(frozenset(flags)) == dtype


def cpuinfo(tmp_path: Path, *processors: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text("".join(f"processor\t: {i}\nmodel name\t: test\nflags\t\t: {flags}\n\n"
                            for i, flags in enumerate(processors)))
    return path


def test_cpu_dtype_reads_proc_cpuinfo_and_says_why(tmp_path, caplog):
    assert ve.read_cpu_flags(cpuinfo(tmp_path, BF16, BF16)) == set(BF16.split())
    dtype, why = ve.cpu_dtype(cpuinfo(tmp_path, BF16, BF16))
    assert (dtype, why) == ("bfloat16", f"the CPU has bf16 arithmetic (avx512_bf16 in {tmp_path / 'cpuinfo'})")
    dtype, why = ve.cpu_dtype(cpuinfo(tmp_path, BF16, NO_BF16))  # every processor must have it
    assert dtype == "float32"
    assert why.startswith("the CPU has no bf16 arithmetic (neither avx512_bf16 nor amx_bf16 in ")
    assert ve.cpu_dtype(cpuinfo(tmp_path))[0] == "float32"  # no flags line at all
    with caplog.at_level(logging.WARNING, logger="hvd.vllm"):
        dtype, why = ve.cpu_dtype(tmp_path / "missing")
    assert dtype == "float32"
    assert why.startswith(f"cannot read {tmp_path / 'missing'} (No such file or directory) to tell whether")
    assert [r.getMessage() for r in caplog.records] == [f"hvd serve: {why}"]


@pytest.fixture(scope="module")
def champion(tmp_path_factory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('serve-args') / 'hvd.db'}"
    upgrade(url)
    with session_scope(make_engine(url)) as s:
        from predictor.gate.registry import store_champion

        store_champion(s, random_survival_gate(), reason="test", actor="test")
    return url


@pytest.fixture()
def hvd_serve(champion, tmp_path, monkeypatch, capsys):
    """Run `hvd serve --engine vllm ARGS` on a CPU with the given flags; returns (exit status, the
    argv it would exec, its startup line, stderr), vLLM never started."""
    models = {}
    for name in ("bf16", "fp32"):
        models[name] = tmp_path / f"smollm2-{name}"
        models[name].mkdir()
        (models[name] / "config.json").write_text("{}")
    monkeypatch.setattr(ve, "MODEL_BF16", models["bf16"])
    monkeypatch.setattr(ve, "MODEL_FP32", models["fp32"])
    # set: `hvd serve` keeps it, rather than emptying the folder of a real server on the same port
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "prometheus"))

    def run(*args: str, flags: str = NO_BF16):
        monkeypatch.setattr(ve, "CPUINFO", cpuinfo(tmp_path, flags))
        execs = []
        monkeypatch.setattr(serve_vllm.os, "execve", lambda path, argv, env: execs.append(argv))
        capsys.readouterr()
        code = main(["--db", champion, "serve", "--engine", "vllm", "--no-preload", *args])
        out = capsys.readouterr()
        return code, (execs[0] if execs else None), out.out.strip(), out.err

    run.models = models
    return run


def test_by_default_vllm_keeps_its_own_defaults_and_prefix_caching(hvd_serve):
    code, argv, line, _ = hvd_serve()
    assert code == 0
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[3:] == ["--host", "127.0.0.1", "--port", "8000", "--served-model-name", "smollm2",
                        "--model", str(hvd_serve.models["fp32"]), "--dtype", "float32", "--enforce-eager",
                        "--shutdown-timeout", "10", "--speculative-config", json.dumps(ve.speculative_config("hvd"))]
    assert not set(DROPPED) & set(argv)
    assert "dtype float32: the CPU has no bf16 arithmetic (neither avx512_bf16 nor amx_bf16 in " in line
    assert "vLLM arguments after `--`: none" in line


@pytest.mark.parametrize("args, flags, dtype, why", [
    ((), BF16, "bfloat16", "the CPU has bf16 arithmetic (avx512_bf16 in "),
    ((), "avx2 amx_bf16 amx_tile", "bfloat16", "the CPU has bf16 arithmetic (amx_bf16 in "),
    (("--dtype", "bfloat16"), NO_BF16, "bfloat16", "hvd serve --dtype"),
    (("--dtype", "float32"), BF16, "float32", "hvd serve --dtype"),
])
def test_the_dtype_follows_the_cpu_unless_given(hvd_serve, args, flags, dtype, why):
    code, argv, line, _ = hvd_serve(*args, flags=flags)
    assert code == 0
    assert argv[argv.index("--dtype") + 1] == dtype and argv.count("--dtype") == 1
    assert argv[argv.index("--model") + 1] == str(hvd_serve.models["bf16" if dtype == "bfloat16" else "fp32"])
    assert f"dtype {dtype}: {why}" in line


def test_arguments_after_the_double_dash_go_to_vllm_verbatim_after_hvds(hvd_serve):
    passed = ["--enable-prefix-caching", "--max-num-seqs", "16", "--max_model_len=2048", "--seed", "7",
              "--speculative-config-is-not-this", "x"]
    code, argv, line, _ = hvd_serve("--port", "8123", "--fallback", "none", "--served-model-name", "sm", "--", *passed)
    assert code == 0
    assert argv[-len(passed):] == passed  # last, in order, untouched
    head = argv[:-len(passed)]
    assert head[3:] == ["--host", "127.0.0.1", "--port", "8123", "--served-model-name", "sm",
                        "--model", str(hvd_serve.models["fp32"]), "--dtype", "float32", "--enforce-eager",
                        "--shutdown-timeout", "10", "--speculative-config", json.dumps(ve.speculative_config("hvd-none"))]
    assert f"vLLM arguments after `--`: {' '.join(passed)}" in line


def test_a_shutdown_timeout_after_the_double_dash_replaces_hvds(hvd_serve):
    """HVD gives vLLM 10 s to stop (its default, 0, kills the worker where HVD drains); the operator's wins."""
    code, argv, _, _ = hvd_serve("--", "--shutdown-timeout", "30")
    assert code == 0 and argv.count("--shutdown-timeout") == 1 and argv[-2:] == ["--shutdown-timeout", "30"]
    code, argv, _, _ = hvd_serve("--", "--shutdown_timeout=0")
    assert code == 0 and "--shutdown-timeout" not in argv and argv[-1] == "--shutdown_timeout=0"


def test_a_dtype_or_eagerness_after_the_double_dash_replaces_hvds(hvd_serve):
    code, argv, line, _ = hvd_serve("--dtype", "bfloat16", "--", "--dtype=float32", "--no-enforce-eager", flags=BF16)
    assert code == 0
    assert argv.count("--dtype") == 0 and "--enforce-eager" not in argv  # HVD left its own out
    assert argv[-2:] == ["--dtype=float32", "--no-enforce-eager"]
    assert argv[argv.index("--model") + 1] == str(hvd_serve.models["fp32"])  # the folder follows the dtype
    assert "dtype float32: --dtype passed to vLLM after `--`" in line
    code, argv, _, _ = hvd_serve("--", "--dtype", "bfloat16", "--enforce-eager")
    assert argv[-3:] == ["--dtype", "bfloat16", "--enforce-eager"] and argv.count("--dtype") == 1
    assert argv.count("--enforce-eager") == 1 and argv[argv.index("--model") + 1] == str(hvd_serve.models["bf16"])


@pytest.mark.parametrize("passed, message", [
    (["--model", "x"], "--model cannot be passed to vLLM after `--`: hvd serve sets it itself; it serves the "
                       "bundled SmolLM2-135M, the model the predictor and the EAGLE3 head are trained for (use hvd "
                       "serve --dtype to pick its bf16 or fp32 folder)"),
    (["--speculative-config", "{}"], "--speculative-config cannot be passed to vLLM after `--`: hvd serve sets it "
                                     "itself; use hvd serve --fallback model|none"),
    (["-sc", "{}"], "-sc (--speculative-config) cannot be passed"),
    (["--speculative_config.method", "ngram"], "--speculative_config.method (--speculative-config) cannot be passed"),
    (["--spec", "{}"], "--spec (--speculative-config) cannot be passed"),
    (["--enable-prefix-caching", "--port=9000"], "--port cannot be passed to vLLM after `--`: hvd serve sets it "
                                                 "itself; use hvd serve --port"),
    (["--host", "0.0.0.0"], "--host cannot be passed to vLLM after `--`: hvd serve sets it itself; use hvd serve "
                            "--host"),
    (["--served_model_name", "a"], "--served_model_name (--served-model-name) cannot be passed to vLLM after `--`: "
                                   "hvd serve sets it itself; use hvd serve --served-model-name"),
])
def test_what_hvd_sets_is_refused_after_the_double_dash_naming_the_option_to_use(hvd_serve, passed, message):
    code, argv, _, err = hvd_serve("--", *passed)
    assert code == 2 and argv is None
    assert err.startswith(f"hvd serve: error: {message}") and err.count("\n") == 1, err


@pytest.mark.parametrize("argv", [
    ["serve", "--engine", "replay", "--", "--max-num-seqs", "4"],
    ["versions", "--", "--log"],
])
def test_only_serve_with_vllm_takes_arguments_after_the_double_dash(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "only `hvd serve --engine vllm` takes them" in capsys.readouterr().err


def test_a_vllm_option_without_the_double_dash_is_a_usage_error(capsys):
    """argparse would take `--seed` for the replay engine's; vLLM's options need the `--`."""
    with pytest.raises(SystemExit) as info:
        main(["serve", "--engine", "vllm", "--enable-prefix-caching"])
    assert info.value.code == 2 and "unrecognized arguments: --enable-prefix-caching" in capsys.readouterr().err


def test_the_benchmark_keeps_the_engine_arguments_it_measured_with():
    """bench/vllm_methods.py's servers: the in-process engines' arguments, passed after `--`."""
    assert ve.measured_server_args() == [
        "--max-model-len", "4096", "--max-num-seqs", "8", "--max-num-batched-tokens", "4096", "--enforce-eager",
        "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.5"]
    kwargs = ve.engine_kwargs(ve.MODEL_BF16, "bfloat16") if (ve.MODEL_BF16 / "config.json").is_file() else None
    if kwargs is not None:
        assert (kwargs["max_model_len"], kwargs["max_num_seqs"], kwargs["enable_prefix_caching"],
                kwargs["enforce_eager"]) == (4096, 8, False, True)


def test_the_startup_line_never_shows_the_database_password(hvd_serve, monkeypatch, capsys):
    monkeypatch.setattr(ve, "CPUINFO", cpuinfo(hvd_serve.models["bf16"].parent, NO_BF16))
    execs = []
    monkeypatch.setattr(serve_vllm.os, "execve", lambda path, argv, env: execs.append(env))
    capsys.readouterr()
    url = "postgresql+psycopg2://hvd:s3cret-pw@db.example:5432/hvd"
    serve_vllm.exec_server(serve_vllm.ServeOptions(database_url=url, preload=False))
    line = capsys.readouterr().out
    assert "events -> postgresql+psycopg2://hvd:***@db.example:5432/hvd," in line
    assert "s3cret" not in line
    assert execs[0]["HVD_DATABASE_URL"] == url  # the server itself still gets the real URL
