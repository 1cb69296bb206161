"""The hybrid drafter of one vLLM model runner: the HVD runtime and its services, and the step glue
that turns the runtime's plan into vLLM's variable-length draft lists.

Imported only when a runner with HVD_HYBRID on first drafts (controller.engines.vllm_plugin), so
vLLM processes without HVD never load torch-side learning, river or SQLAlchemy for it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
from pathlib import Path

from controller.core.decision import CACHE, MODEL
from controller.core.metrics import HvdMetrics
from controller.core.request_metadata import RequestMetadata, RequestMetadataError, parse_request_metadata
from controller.core.runtime import RequestInput
from controller.services.stack import ServiceStack, decision_config
from controller.settings import ServingSettings, SettingsError
from predictor.data.tokens import TraceTokenizer
from predictor.decision.profiles import cost_profiles, drafter_profiles
from predictor.drafting.cache_drafter import SuffixConfig
from predictor.drafting.token_classes import token_classes
from storage.engine import make_engine
from storage.migrate import upgrade
from storage.settings import database_url

log = logging.getLogger("hvd.vllm")


class HybridState:
    """The runtime, its services and the glue for one model runner."""

    def __init__(self, runner) -> None:
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
        engine = make_engine(database_url(settings.database_url))
        upgrade(engine)
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
        self._meta: dict[str, RequestMetadata] = {}  # per running request, parsed when first seen
        # Every replica follows the control plane (overrides apply from the first step: one poll
        # before serving); the one holding the learner lock also learns.
        # The hvd_* metrics go into the registry vLLM serves at /metrics (across processes: see
        # controller.core.metrics).
        metrics = HvdMetrics.shared(max_tenants=settings.metrics_max_tenants)
        self.stack = ServiceStack.build(engine, decision, token_classes(tokenizer),
                                        replica=f"{socket.gethostname()}-{os.getpid()}", learn=settings.learn,
                                        suffix=suffix, metrics=metrics)
        self.stack.poller.poll_once()
        self.stack.start()
        self.runtime = self.stack.runtime
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

    def propose(self, runner, original, scheduler_output, sampled_token_ids, args, kwargs) -> list[list[int]]:
        ib = runner.input_batch
        req_ids = list(ib.req_ids)
        valid = _valid_sampled_lists(runner, sampled_token_ids)
        inputs, rows = [], []
        known = self.runtime.requests
        for i, req_id in enumerate(req_ids):
            if not valid[i]:  # still prefilling: nothing sampled, nothing to draft
                continue
            meta = self._metadata(runner, req_id)
            prompt = None if req_id in known else ib.token_ids_cpu[i, : int(ib.num_prompt_tokens[i])].copy()
            inputs.append(RequestInput(req_id, valid[i], prompt, tenant=meta.tenant, workload=meta.workload,
                                       speculate=meta.speculate))
            rows.append(i)
        running = set(req_ids)
        finished = [r for r in known if r not in running]
        for r in [r for r in self._meta if r not in running]:
            del self._meta[r]
        plan = self.runtime.step(inputs, finished)
        eagle_rows = None
        wanted = (plan.source == MODEL).any()
        if self.run_eagle and (wanted or (self.settings.eagle_warm and (plan.source == CACHE).any())):
            # Without a model draft this step EAGLE still runs one position: that writes the head's
            # KV cache for the tokens this step verified, which its later drafts attend to.
            k_e = plan.model_k if wanted else 1
            sched = dataclasses.replace(scheduler_output, num_spec_tokens_to_schedule=k_e)
            eagle = original(runner, sched, sampled_token_ids, *args, **kwargs)
            eagle_rows = eagle.tolist() if hasattr(eagle, "tolist") else [list(r) for r in eagle]
        out: list[list[int]] = [[] for _ in req_ids]
        for j, i in enumerate(rows):
            if plan.source[j] == CACHE:  # the prefix the plan verifies
                out[i] = plan.drafts[j][: self.k_max]
            elif plan.source[j] == MODEL and eagle_rows is not None:
                out[i] = [int(t) for t in eagle_rows[i][: plan.model_k]]
        return out


def _valid_sampled_lists(runner, sampled_token_ids) -> list[list[int]]:
    """This step's accepted + bonus tokens per request (empty for partial prefills). vLLM passes
    lists when it drafts after bookkeeping, a padded tensor (-1 = rejected) otherwise."""
    if isinstance(sampled_token_ids, list):
        return sampled_token_ids
    rows = sampled_token_ids.tolist()
    discard = runner.discard_request_mask.np[: len(rows)]
    return [[] if discard[i] else [t for t in row if t >= 0] for i, row in enumerate(rows)]


def _extra_args(runner, req_id: str) -> object:
    state = runner.requests.get(req_id)
    params = getattr(state, "sampling_params", None)
    return getattr(params, "extra_args", None)
