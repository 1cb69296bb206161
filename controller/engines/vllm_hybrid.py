"""The hybrid drafter of one vLLM model runner: the HVD runtime and its services, and the step glue
that turns the runtime's plan into vLLM's variable-length draft lists.

Built when a model runner with HVD_HYBRID on is constructed (controller.engines.vllm_plugin), at
the engine's start-up: the database connection, the migrations, the champion and the first poll
happen there, never inside a step. A database that cannot be reached then stops the engine with an
`HvdStartupError` naming the database and the way out. vLLM processes without HVD never import this.

Tensor and pipeline parallelism are refused at start-up: HVD would decide in every worker process
(each with its own poller swapping champions at a different step), and workers that planned
differently would call the sharded EAGLE head with different draft lengths.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from pathlib import Path

import numpy as np

from controller.core.decision import CACHE, MODEL
from controller.core.metrics import HvdMetrics
from controller.core.request_metadata import RequestMetadata, RequestMetadataError, parse_request_metadata
from controller.core.runtime import RequestInput
from controller.core.step_costs import StepTimingError
from controller.engines.served_oracle import OracleFileError, ServedOracle, recorded_outputs
from controller.engines.vllm_step_clock import StepClock
from controller.services.live_cost_fitter import follow
from controller.services.stack import ServiceStack, decision_config
from controller.services.step_log import StepLog
from controller.services.trace_recorder import ServedRequest, TraceRecorder
from controller.settings import ServingSettings, SettingsError
from predictor.data.tokens import TraceTokenizer
from predictor.decision.live_cost import LiveCostError, LiveCostModel, StepSample
from predictor.decision.profiles import cost_profiles, drafter_profiles
from predictor.drafting.cache_drafter import SuffixConfig
from predictor.drafting.token_classes import token_classes
from predictor.gate.mlp import BlobError
from predictor.gate.registry import NoChampionError
from sqlalchemy.exc import SQLAlchemyError

from storage.engine import make_engine, masked_url
from storage.errors import StorageError
from storage.migrate import upgrade
from storage.settings import database_url

log = logging.getLogger("hvd.vllm")


class HvdStartupError(RuntimeError):
    """HVD cannot serve in this engine: raised while vLLM starts, never inside a step."""


def check_parallelism(parallel_config) -> None:
    """HVD decides in the worker process; with more than one worker per engine each would decide
    on its own: refused until the plan is broadcast from one rank."""
    tp = int(getattr(parallel_config, "tensor_parallel_size", 1))
    pp = int(getattr(parallel_config, "pipeline_parallel_size", 1))
    if tp > 1 or pp > 1:
        raise HvdStartupError(
            f"HVD's hybrid drafter runs with one worker per engine; this engine has tensor_parallel_size {tp} "
            f"and pipeline_parallel_size {pp}. Serve with --tensor-parallel-size 1 --pipeline-parallel-size 1 "
            f"(scale out with more replicas on one database instead), or unset HVD_HYBRID for vLLM's own drafter")


def cache_config(spec, k_max: int) -> SuffixConfig:
    """HVD's suffix cache under vLLM's speculative config: the trees' size is vLLM's to set; the
    drafts' shape (`max_spec_factor`, `min_token_prob`) is the one HVD's predictor was trained on (it
    is in the feature schema), whatever vLLM's own suffix proposer would use."""
    return SuffixConfig(max_tree_depth=spec.suffix_decoding_max_tree_depth,
                        max_cached_requests=spec.suffix_decoding_max_cached_requests,
                        num_speculative_tokens=k_max)


class HybridState:
    """The runtime, its services and the glue for one model runner."""

    def __init__(self, runner) -> None:
        check_parallelism(runner.parallel_config)
        settings = ServingSettings.from_env()
        spec = runner.speculative_config
        self.k_max = int(spec.num_speculative_tokens)
        fallback = settings.fallback or ("model" if spec.method == "eagle3" else "none")
        if fallback == "model" and spec.method != "eagle3":
            raise SettingsError(f"HVD_FALLBACK=model needs speculative method eagle3, got {spec.method!r}")
        self.run_eagle = fallback == "model"
        decision = decision_config(
            drafter_profiles()[settings.drafter_profile], cost_profiles()[settings.cost_profile],
            model_draft_len=min(settings.model_draft_len, self.k_max), fallback=fallback,
            max_running_for_speculation=settings.max_running, backoff=settings.backoff,
            fixed_tau=settings.fixed_tau, rule=settings.rule)
        url = database_url(settings.database_url)
        try:
            engine = make_engine(url)
            upgrade(engine)  # once per deployment: under the migration lock (storage.migrate)
        except (StorageError, SQLAlchemyError) as exc:
            raise HvdStartupError(
                f"HVD cannot start: its database {masked_url(url)} is not usable ({exc}). Start the database "
                f"(HVD_DATABASE_URL names it), or unset HVD_HYBRID to serve without HVD") from exc
        tokenizer_file = Path(runner.model_config.tokenizer) / "tokenizer.json"
        tokenizer = TraceTokenizer(tokenizer_file if tokenizer_file.is_file() else None)
        suffix = cache_config(spec, self.k_max)
        try:  # read before anything starts: a bad file stops the server at once, naming what is wrong
            oracle_outputs = recorded_outputs(settings.oracle) if settings.oracle else None
        except OracleFileError as exc:
            raise HvdStartupError(str(exc)) from exc
        self.settings = settings
        self._meta: dict[str, RequestMetadata] = {}  # per running request, parsed when first seen
        # Every replica follows the control plane (overrides apply from the first step: one poll
        # before serving); it learns only with HVD_LEARN=1 (else `hvd learn`, its own process).
        # The hvd_* metrics go into the registry vLLM serves at /metrics (across processes: see
        # controller.core.metrics).
        metrics = HvdMetrics.shared(max_tenants=settings.metrics_max_tenants)
        try:
            self.stack = ServiceStack.build(engine, decision, token_classes(tokenizer),
                                            replica=f"{socket.gethostname()}-{os.getpid()}", learn=settings.learn,
                                            suffix=suffix, metrics=metrics, live_cost=settings.live_cost)
        except NoChampionError as exc:
            raise HvdStartupError(f"HVD cannot start: {exc}") from exc
        except (StorageError, SQLAlchemyError, BlobError) as exc:
            raise HvdStartupError(f"HVD cannot start: the champion predictor in {masked_url(url)} cannot be "
                                  f"loaded ({exc}); promote a good version (hvd versions) or unset HVD_HYBRID") from exc
        self.stack.start()  # the poller polls once before it returns: overrides apply from the first step
        self.runtime = self.stack.runtime
        self.metrics = metrics
        self.clock = StepClock()
        self._timing_failed = False
        # The allocator prices steps with what this engine's steps cost (the named profile until
        # the fit has enough decode steps); HVD_LIVE_COST=0 keeps the named profile.
        self.live_cost = LiveCostModel(decision.cost, floor=settings.live_cost_floor) if settings.live_cost else None
        self._live_floored: bool | None = None  # the live fit's last floor state, for the log
        self.oracle = None
        if oracle_outputs is not None:
            self.oracle = ServedOracle(oracle_outputs, tokenizer.decode,
                                       lambda outcome: metrics.oracle_requests.labels(outcome).inc())
            log.warning("HVD_ORACLE: cache drafts are planned with their true accepted lengths, read from %d "
                        "recorded outputs in %s (a measurement of the served upper bound, not a serving mode)",
                        len(oracle_outputs), settings.oracle)
        self.recorder = None
        if settings.record:
            self.recorder = TraceRecorder(settings.record, tokenizer, replica=self.stack.writer.replica,
                                          model=str(runner.model_config.served_model_name or runner.model_config.model),
                                          max_requests=settings.record_max_requests).start()
        self.step_log = StepLog(settings.step_log).start() if settings.step_log else None
        self.files = [f for f in (self.recorder, self.step_log) if f is not None]  # what writes files, not SQL
        log.info("HVD hybrid drafter on: predictor v%s, rule %s, fallback %s, K_MAX %d", self.runtime.version_id,
                 self.runtime.rule, fallback, self.k_max)

    def _metadata(self, runner, req_id: str) -> RequestMetadata:
        """The request's metadata, parsed once. vLLM refuses bad values when it builds the
        SamplingParams (vllm_plugin.check_requests); one that gets here anyway (extra_args changed
        afterwards) is refused once: logged, and the request decodes without speculation, as its
        tenant's overrides cannot be known."""
        meta = self._meta.get(req_id)
        if meta is None:
            s = self.settings
            try:
                meta = parse_request_metadata(_extra_args(runner, req_id), s.default_tenant, s.default_workload)
            except RequestMetadataError as exc:
                log.error("request %s: refused HVD metadata (%s); decoding it without speculation", ascii(req_id), exc)
                meta = RequestMetadata(s.default_tenant, s.default_workload, speculate=False)
            self._meta[req_id] = meta
        return meta

    def finish_requests(self, req_ids) -> None:
        """Requests vLLM's scheduler finished or aborted: it says so at the start of a later step
        (`finished_req_ids`), often one that schedules nothing, where no drafter is called; so the
        plugin calls this from `execute_model`, before the step. Their remaining drafts are labelled
        with what they output, and they are recorded (HVD_RECORD)."""
        known = self.runtime.requests
        for r in req_ids:
            self._meta.pop(r, None)
            if self.oracle is not None:
                self.oracle.forget(r)
            st = known.get(r)
            if st is None:
                continue
            if self.recorder is not None:
                h = st.hindsight
                self.recorder.add(ServedRequest(r, st.tenant, st.workload, h.tokens[: h.prompt_len].copy(),
                                                np.asarray(h.out, dtype=np.int32)))
            self.runtime.finish(r)

    def finish_held(self) -> int:
        """Finish every request HVD still holds, as a later step would have: recorded (HVD_RECORD) and
        its drafts labelled. vLLM names finished requests only at the start of a later step, which an
        engine that goes idle, or stops, never runs: without this the last requests a process served
        were never recorded and their last drafts' labels never reached SQL. Only when no step can
        come (the process is ending); returns how many were finished."""
        held = list(self.runtime.requests)
        self.finish_requests(held)
        return len(held)

    def decide(self, runner, scheduler_output, sampled_token_ids):
        """The step as vLLM ran it: requests leave only when the scheduler says they finished or
        were aborted (`finish_requests`; a request missing from this batch was preempted or not
        scheduled: it keeps its state and continues where it was), and each request's last draft
        counts only as far as the scheduler verified it."""
        ib = runner.input_batch
        req_ids = list(ib.req_ids)
        valid = _valid_sampled_lists(runner, sampled_token_ids)
        known = self.runtime.requests
        scheduled = scheduler_output.scheduled_spec_decode_tokens
        inputs, rows = [], []
        for i, req_id in enumerate(req_ids):
            if not valid[i]:  # still prefilling: nothing sampled, nothing to draft
                continue
            meta = self._metadata(runner, req_id)
            first = req_id not in known
            emitted = 0 if first else known[req_id].hindsight.output_len
            params = _sampling_params(runner, req_id)
            new = _kept(params, valid[i], emitted)
            room, stops = _end(params, emitted + len(new))
            prompt = ib.token_ids_cpu[i, : int(ib.num_prompt_tokens[i])].copy() if first else None
            inputs.append(RequestInput(req_id, new, prompt, tenant=meta.tenant, workload=meta.workload,
                                       room=room, stops=stops,
                                       speculate=meta.speculate, verified=_verified(scheduled.get(req_id)),
                                       sampled=len(valid[i]) if len(new) != len(valid[i]) else None,
                                       on_policy=self.settings.on_policy,
                                       continuation=None if self.oracle is None else
                                       self.oracle.continuation(req_id, prompt, new, emitted)))
            rows.append(i)
        plan = self.runtime.step(inputs)
        return plan, rows, req_ids

    def propose(self, runner, original, scheduler_output, sampled_token_ids, args, kwargs) -> list[list[int]]:
        """The runtime's plan as vLLM's draft lists, the EAGLE proposer run where the plan wants it;
        HVD's own time and the proposer's go to the step's clock."""
        t0 = time.perf_counter()
        plan, rows, req_ids = self.decide(runner, scheduler_output, sampled_token_ids)
        eagle_rows = None
        wanted = (plan.source == MODEL).any()
        if self.run_eagle and (wanted or (self.settings.eagle_warm and (plan.source == CACHE).any())):
            # Without a model draft this step EAGLE still runs one position: that writes the head's
            # KV cache for the tokens this step verified, which its later drafts attend to.
            k_e = plan.model_k if wanted else 1
            sched = dataclasses.replace(scheduler_output, num_spec_tokens_to_schedule=k_e)
            t1 = time.perf_counter()
            eagle = original(runner, sched, sampled_token_ids, *args, **kwargs)
            eagle_rows = eagle.tolist() if hasattr(eagle, "tolist") else [list(r) for r in eagle]
            t2 = time.perf_counter()
            self.clock.add("drafter", t2 - t1, k_e)
            t0 += t2 - t1
        out: list[list[int]] = [[] for _ in req_ids]
        for j, i in enumerate(rows):
            if plan.source[j] == CACHE:  # the prefix the plan verifies
                out[i] = plan.drafts[j][: self.k_max]
            elif plan.source[j] == MODEL and eagle_rows is not None:
                out[i] = [int(t) for t in eagle_rows[i][: plan.model_k]]
        self.clock.add("hvd", time.perf_counter() - t0)
        return out

    def end_step(self) -> None:
        """The engine step is over: its timing goes to the Prometheus histograms and the per-minute
        summaries, and a decode step to the live cost model, whose refits (on the fitter's thread) the
        allocator prices the next steps with. Nothing here waits on I/O or on a fit."""
        try:
            step = self.clock.end()
            if step is None:
                return
            t = step.timing
            if self.metrics is not None:
                self.metrics.step_seconds(t, step.decode)
            if self.stack.step_costs is not None:
                self.stack.step_costs.add(t)
            if self.step_log is not None:
                self.step_log.add((t, step.decode))
            if self.live_cost is not None:
                sample = StepSample(t.batch, t.query_tokens, t.model_k, t.total) if step.decode else None
                if follow(self.live_cost, self.stack.live_cost, sample) is not None:
                    self._price_with_live_fit()
        except (StepTimingError, LiveCostError) as exc:  # a timer gone wrong must not stop serving
            if not self._timing_failed:
                self._timing_failed = True
                log.exception("HVD step timing failed (logged once); serving goes on: %s", exc)

    def _price_with_live_fit(self) -> None:
        """Price the next steps with the live fit; say so in the log at the first fit and whenever the
        compute floor comes or goes (a refit every 200 steps would flood it)."""
        fit = self.live_cost.current
        self.runtime.set_cost(self.live_cost.profile(f"live-{self.stack.writer.replica}"))
        if self.metrics is not None:
            self.metrics.live_cost_fit(fit.coefficients, fit.floor_ms_per_token, fit.samples)
        floored = fit.floor_ms_per_token > 0
        if floored != self._live_floored:
            log.info("HVD prices steps with this engine's own step times (%d steps): %s", fit.samples, fit.formula())
            self._live_floored = floored


def _valid_sampled_lists(runner, sampled_token_ids) -> list[list[int]]:
    """This step's accepted + bonus tokens per request (empty for partial prefills). vLLM passes
    lists when it drafts after bookkeeping, a padded tensor (-1 = rejected) otherwise."""
    if isinstance(sampled_token_ids, list):
        return sampled_token_ids
    rows = sampled_token_ids.tolist()
    discard = runner.discard_request_mask.np[: len(rows)]
    return [[] if discard[i] else [t for t in row if t >= 0] for i, row in enumerate(rows)]


def _verified(spec_tokens) -> int:
    """Draft tokens the step verified for a request: the scheduled ones up to the first -1 (the
    placeholders of drafts a grammar refused)."""
    if not spec_tokens:
        return 0
    n = 0
    for t in spec_tokens:
        if t < 0:
            break
        n += 1
    return n


def _kept(params, tokens: list[int], output_len: int) -> list[int]:
    """What vLLM keeps of a step's tokens for a request that has emitted `output_len`: its scheduler
    appends them one by one and stops at the first that ends the request (vllm.v1.core.sched.utils.
    check_stop): the eos token (`eos_token_id`, None under ignore_eos), a stop token id, or the
    request's `max_tokens`; the rest were sampled by the runner but never output, and HVD must not
    learn from them. Not `all_stop_token_ids`: it holds the eos token even under ignore_eos (for the
    min_tokens logits processor), and a step that emitted one there goes on. (Stop strings are cut
    later, by the detokenizer: not seen here.)"""
    if params is None or not tokens:
        return tokens
    keep = len(tokens)
    if params.max_tokens is not None:
        keep = min(keep, max(0, params.max_tokens - output_len))
    eos, stops = params.eos_token_id, params.stop_token_ids or ()
    for j in range(keep):
        if tokens[j] == eos or tokens[j] in stops:
            keep = j + 1
            break
    return tokens if keep == len(tokens) else tokens[:keep]


def _end(params, output_len: int) -> tuple[int | None, tuple[int, ...]]:
    """Where vLLM would end a request that has emitted `output_len` tokens, as `check_stop` does
    (see `_kept`): the tokens it may still emit (None: no max_tokens), and the ids that end it when
    emitted. Short of min_tokens they would not, but there vLLM's min-tokens processor forbids the
    target to sample them, so a drafted one is rejected: what follows it cannot be output either."""
    if params is None:
        return None, ()
    room = None if params.max_tokens is None else max(0, params.max_tokens - output_len)
    eos, stops = params.eos_token_id, params.stop_token_ids or ()
    return room, (*stops, eos) if eos is not None else tuple(stops)


def _sampling_params(runner, req_id: str):
    return getattr(runner.requests.get(req_id), "sampling_params", None)


def _extra_args(runner, req_id: str) -> object:
    return getattr(_sampling_params(runner, req_id), "extra_args", None)
