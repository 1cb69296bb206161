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
the hvd_* series (controller/core/metrics.py) appear beside vLLM's own vllm:* ones."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from controller.engines import vllm_engine as ve


@dataclass(frozen=True)
class ServeOptions:
    database_url: str
    host: str = "127.0.0.1"
    port: int = 8000
    fallback: str = "model"  # model (EAGLE3 head) | none
    dtype: str = "bfloat16"
    max_running: int | None = None
    backoff: str = "none"
    served_model_name: str = "smollm2"
    preload: bool = True  # tcmalloc + Intel OpenMP in LD_PRELOAD (vllm_engine.ld_preload)


def command(opts: ServeOptions) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that start the server."""
    argv = server_argv(opts, ve.speculative_config("hvd" if opts.fallback == "model" else "hvd-none"))
    env = ve.subprocess_env(opts.preload)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update({"HVD_HYBRID": "1", "HVD_DATABASE_URL": _absolute(opts.database_url), "HVD_FALLBACK": opts.fallback,
                "HVD_BACKOFF": opts.backoff})
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


def server_argv(opts: ServeOptions, speculative: dict | None) -> list[str]:
    """vLLM's own OpenAI server on the bundled model with this project's engine arguments and the
    given speculative_config (None: no speculation). `hvd serve` and the benchmark's baselines
    start the same server, so they differ only in what drafts."""
    model = ve.MODEL_BF16 if opts.dtype == "bfloat16" else ve.MODEL_FP32
    kwargs = ve.engine_kwargs(model, opts.dtype)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--host", opts.host, "--port", str(opts.port), "--served-model-name", opts.served_model_name,
            "--model", kwargs["model"], "--dtype", opts.dtype, "--max-model-len", str(kwargs["max_model_len"]),
            "--max-num-seqs", str(kwargs["max_num_seqs"]),
            "--max-num-batched-tokens", str(kwargs["max_num_batched_tokens"]), "--enforce-eager",
            "--no-enable-prefix-caching", "--gpu-memory-utilization", str(kwargs["gpu_memory_utilization"])]
    if speculative is not None:
        argv += ["--speculative-config", json.dumps(speculative)]
    return argv


def _absolute(url: str) -> str:
    """A relative SQLite path made absolute: the server's processes may not share our cwd."""
    prefix = "sqlite:///"
    if url.startswith(prefix) and not url.startswith(prefix + "/") and url != "sqlite:///:memory:":
        return prefix + str(Path(url[len(prefix):]).resolve())
    return url


def exec_server(opts: ServeOptions) -> None:
    """Replace this process with the server (Ctrl-C and signals then reach vLLM directly)."""
    argv, env = command(opts)
    print(f"hvd serve: vLLM on http://{opts.host}:{opts.port}/v1 (model {opts.served_model_name}, "
          f"fallback {opts.fallback}, events -> {env['HVD_DATABASE_URL']}, "
          f"LD_PRELOAD {env.get('LD_PRELOAD') or 'none'})", flush=True)
    os.execve(argv[0], argv, env)
