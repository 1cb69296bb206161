"""Prototype: a per-request hybrid drafter (suffix cache or EAGLE3) inside vLLM 0.32's model runner.

The engine is configured with method "eagle3" (so the runner keeps the target's aux hidden states
and builds an EagleProposer) and num_speculative_tokens = K_MAX (the longest suffix draft we want
to verify). `GPUModelRunner.propose_draft_token_ids` -- inherited unchanged by the CPU runner --
is wrapped so that:

  1. the original method always runs, with `num_spec_tokens_to_schedule` lowered to K_EAGLE
     (EagleProposer.propose accepts any k <= the configured one). This keeps the EAGLE head's own
     KV cache in step with every request, whichever drafter ends up being used for it;
  2. per request, the row returned is chosen from SamplingParams.extra_args["hvd_drafter"]
     (read from self.requests[req_id].sampling_params): "suffix" -> an arctic-inference
     SuffixDecodingCache draft (0..K_MAX tokens), "eagle" -> the EAGLE row (K_EAGLE tokens),
     "none" -> [];
  3. the result is returned as list[list[int]] of variable lengths, which
     _copy_draft_token_ids_to_cpu / _get_draft_token_ids_cpu / take_draft_token_ids pass through
     to Scheduler.update_draft_token_ids unchanged (async scheduling is off on CPU).

The check: greedy float32 outputs at batch 4 (even requests "suffix", odd "eagle") must be
token-identical to plain decoding, and the suffix rows must actually be accepted.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python tools/vllm_hybrid_probe.py \
        --model var/models/smollm2-135m-fp32 --head var/models/smollm2-eagle3-random

`--via-entry-point` installs the patch the way an out-of-tree package would: through a
`vllm.general_plugins` entry point (a throw-away *.dist-info put on sys.path), which vLLM calls
from EngineArgs.__post_init__ and again in each worker (WorkerWrapperBase.init_worker) -- i.e.
before any model runner exists.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

K_MAX = 16  # configured num_speculative_tokens: upper bound on any draft row
K_EAGLE = 3  # EAGLE draft length actually computed
STATS = {"suffix_rows": 0, "suffix_tokens": 0, "eagle_rows": 0, "eagle_tokens": 0, "empty": 0,
         "calls": 0}
_PATCHED = False


# ----------------------------------------------------------------------------- the monkeypatch
def _valid_sampled_lists(runner, sampled_token_ids) -> list[list[int]]:
    """Per-request accepted+bonus tokens of this step as CPU lists (empty for partial prefills).

    With disable_padded_drafter_batch=True the runner already passes these lists; with the padded
    (default) EAGLE path it passes a [num_reqs, max_draft+1] tensor with -1 for rejected slots.
    """
    if isinstance(sampled_token_ids, list):
        return sampled_token_ids
    rows = sampled_token_ids.tolist()
    num_reqs = len(rows)
    discard = runner.discard_request_mask.np[:num_reqs]
    return [[] if discard[i] else [t for t in row if t >= 0] for i, row in enumerate(rows)]


def _suffix_drafts(runner, valid: list[list[int]], want: list[bool], k_max: int,
                   before_bookkeeping: bool) -> list[list[int]]:
    """Same bookkeeping as vllm/v1/spec_decode/suffix_decoding.py, on our own cache.

    before_bookkeeping: in the padded EAGLE path the drafter runs *before* _bookkeeping_sync, so
    input_batch.token_ids_cpu / num_tokens_no_spec do not yet hold this step's sampled tokens;
    they are appended to the pattern by hand (without this, suffix drafts lag one step behind and
    are almost never accepted).
    """
    import numpy as np
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    spec = runner.speculative_config
    cache = getattr(runner, "_hvd_suffix_cache", None)
    if cache is None:
        cache = runner._hvd_suffix_cache = SuffixDecodingCache(
            max_tree_depth=spec.suffix_decoding_max_tree_depth,
            max_cached_requests=spec.suffix_decoding_max_cached_requests,
        )
    ib = runner.input_batch
    max_len = runner.max_model_len
    depth = spec.suffix_decoding_max_tree_depth
    out: list[list[int]] = []
    for i, sampled in enumerate(valid):
        req_id = ib.req_ids[i]
        if not sampled:
            out.append([])
            continue
        if req_id not in cache.active_requests:
            if req_id in cache.cached_requests:
                cache.evict_cached_response(req_id)
            n_prompt = ib.num_prompt_tokens[i]
            cache.start_request(req_id, ib.token_ids_cpu[i, :n_prompt])
        # Every request's output feeds the global cache, whichever drafter it uses.
        cache.add_active_response(req_id, sampled)
        n = int(ib.num_tokens_no_spec[i])
        if before_bookkeeping:
            pattern = np.concatenate(
                [ib.token_ids_cpu[i, max(0, n - depth):n], np.asarray(sampled, dtype=np.int32)]
            )[-depth:]
            n += len(sampled)
        else:
            pattern = ib.token_ids_cpu[i, max(0, n - depth):n]
        if not want[i] or n >= max_len:
            out.append([])
            continue
        draft = cache.speculate(
            req_id, pattern,
            max_spec_tokens=min(k_max, max_len - n - 1),
            max_spec_factor=spec.suffix_decoding_max_spec_factor,
            min_token_prob=spec.suffix_decoding_min_token_prob,
        )
        out.append(list(draft.token_ids))
    for req_id in cache.active_requests - ib.req_id_to_index.keys():
        cache.stop_request(req_id)
    return out


def install(k_eagle: int = K_EAGLE) -> None:
    """Wrap GPUModelRunner.propose_draft_token_ids (CPUModelRunner inherits it). Idempotent."""
    global _PATCHED
    if _PATCHED:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.propose_draft_token_ids

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        spec = self.speculative_config
        if spec is None or spec.method != "eagle3":
            return original(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        STATS["calls"] += 1
        k_max = scheduler_output.num_spec_tokens_to_schedule
        # 1. EAGLE for the whole batch, shorter than the configured k (keeps its KV in sync).
        sched_eagle = dataclasses.replace(
            scheduler_output, num_spec_tokens_to_schedule=min(k_eagle, k_max)
        )
        eagle = original(self, sched_eagle, sampled_token_ids, *args, **kwargs)
        eagle_rows = eagle.tolist() if hasattr(eagle, "tolist") else [list(r) for r in eagle]
        # 2. Per-request choice from SamplingParams.extra_args.
        req_ids = self.input_batch.req_ids
        choice = []
        for req_id in req_ids:
            sp = self.requests[req_id].sampling_params
            extra = (sp.extra_args or {}) if sp is not None else {}
            choice.append(extra.get("hvd_drafter", "eagle"))
        key = "list_input_calls" if isinstance(sampled_token_ids, list) else "tensor_input_calls"
        STATS[key] = STATS.get(key, 0) + 1
        valid = _valid_sampled_lists(self, sampled_token_ids)
        suffix = _suffix_drafts(self, valid, [c == "suffix" for c in choice], k_max,
                                before_bookkeeping=not isinstance(sampled_token_ids, list))
        # 3. Variable-length rows.
        out: list[list[int]] = []
        for i, c in enumerate(choice):
            if not valid[i]:  # partial prefill: no draft
                row = []
            elif c == "suffix":
                row = suffix[i]
                STATS["suffix_rows"] += 1
                STATS["suffix_tokens"] += len(row)
            elif c == "eagle":
                row = [int(t) for t in eagle_rows[i]]
                STATS["eagle_rows"] += 1
                STATS["eagle_tokens"] += len(row)
            else:
                row = []
            if not row:
                STATS["empty"] += 1
            out.append(row[:k_max])  # never longer than num_speculative_tokens (see report)
        return out

    propose_draft_token_ids.__wrapped__ = original  # type: ignore[attr-defined]
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    _PATCHED = True


def plugin_entry() -> None:
    """What a `vllm.general_plugins` entry point would call."""
    install()
    STATS["installed_by_plugin"] = 1


def _fake_entry_point_dist() -> str:
    """Put a throw-away dist-info declaring `vllm.general_plugins` on sys.path."""
    root = Path(tempfile.mkdtemp(prefix="hvd_plugin_"))
    dist = root / "hvd_hybrid_probe-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hvd-hybrid-probe\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nhvd_hybrid = vllm_hybrid_probe:plugin_entry\n"
    )
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # so `vllm_hybrid_probe` imports
    sys.path.insert(0, str(root))
    return str(root)


# ----------------------------------------------------------------------------- the experiment
CODE = '''def load_config(path):
    with open(path) as fh:
        data = json.load(fh)
    if "name" not in data:
        raise ValueError("config has no name")
    return data
'''
PROMPTS = [
    "Copy this function exactly, then add a docstring:\n\n" + CODE,
    "Write a haiku about the sea.",
    "Repeat the following list twice: apple, banana, cherry, date, elderberry, fig, grape.",
    "Explain recursion to a child in two sentences.",
]


def _patch_llvmlite() -> None:
    ffi = sys.modules.get("llvmlite.binding.ffi")
    if ffi is not None and hasattr(ffi, "lib") and hasattr(ffi.lib, "_fntab"):
        ffi.lib._fntab.setdefault("__dict__", {})


def _metrics(llm) -> dict:
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            out["drafts"] += m.value
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            out["draft_tokens"] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["per_pos"] = list(m.values)
    return out


def run(args, hybrid: bool) -> tuple[list[list[int]], dict]:
    from vllm import LLM, SamplingParams

    _patch_llvmlite()
    spec = None
    if hybrid:
        spec = {"method": "eagle3", "model": args.head, "num_speculative_tokens": K_MAX,
                "disable_padded_drafter_batch": args.no_padded}
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype="float32", max_model_len=4096, max_num_seqs=8,
              max_num_batched_tokens=4096, enforce_eager=True, seed=0,
              enable_prefix_caching=False, gpu_memory_utilization=0.5,
              disable_log_stats=False, speculative_config=spec)
    startup = time.perf_counter() - t0
    params = []
    for i in range(len(PROMPTS)):
        extra = {"hvd_drafter": "suffix" if i % 2 == 0 else "eagle"}
        params.append(SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                     extra_args=extra))
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS]
    t1 = time.perf_counter()
    outs = llm.chat(msgs, params, use_tqdm=False)
    dt = time.perf_counter() - t1
    toks = [list(o.outputs[0].token_ids) for o in outs]
    info = {"startup_s": round(startup, 1), "secs": round(dt, 2),
            "tok_s": round(sum(map(len, toks)) / dt, 1)}
    if hybrid:
        info["metrics"] = _metrics(llm)
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        info["runner"] = type(runner).__name__
        info["drafter"] = type(runner.drafter).__name__
        info["patched"] = getattr(type(runner).propose_draft_token_ids, "__wrapped__", None) \
            is not None
    del llm
    gc.collect()
    return toks, info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="var/models/smollm2-135m-fp32")
    ap.add_argument("--head", default="var/models/smollm2-eagle3-random")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-padded", action="store_true",
                    help="disable_padded_drafter_batch=True (EAGLE drafts after bookkeeping)")
    ap.add_argument("--via-entry-point", action="store_true",
                    help="install through a vllm.general_plugins entry point, not install()")
    args = ap.parse_args()

    if args.via_entry_point:
        # Must exist before the first EngineArgs of the process: load_general_plugins() runs
        # once per process (vllm/plugins/__init__.py `plugins_loaded`), so a plugin that appears
        # after the first engine was created is never loaded.
        where = _fake_entry_point_dist()
        print(f"entry point dist-info in {where}")
    else:
        install()
    # The patch is inert unless the method is eagle3, so the plain reference run is unaffected.
    ref, ref_info = run(args, hybrid=False)
    print(f"[plain]  {ref_info}", flush=True)
    out, info = run(args, hybrid=True)
    if args.via_entry_point:
        import vllm_hybrid_probe as mod  # the instance vLLM's plugin loader imported
        stats = mod.STATS
    else:
        stats = STATS
    print(f"[hybrid] {info}", flush=True)
    print(f"[hybrid] drafter stats {stats}")
    ok = True
    for i, (a, b) in enumerate(zip(ref, out)):
        same = a == b
        ok &= same
        print(f"request {i} ({'suffix' if i % 2 == 0 else 'eagle '}): {len(a)} tokens, "
              f"token-identical: {same}")
    acc = info["metrics"]["accepted"]
    print(f"accepted draft tokens: {acc} (random EAGLE head ~0, so these are the suffix rows')")
    ok &= stats["calls"] > 0 and stats["suffix_rows"] > 0 and stats["eagle_rows"] > 0
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
