"""How this project starts vLLM on CPU: one place for the engine arguments, the speculative
configurations it compares, and the bundled model folders (built by `make setup`)."""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
MODELS = REPO_ROOT / "var" / "models"
MODEL_BF16 = MODELS / "smollm2-135m-bf16"
MODEL_FP32 = MODELS / "smollm2-135m-fp32"
# The trained head (`make eagle3`, committed with its PROVENANCE.json) and, for comparison and for
# plumbing tests, a head with RANDOM weights built by `make setup` (it accepts ~nothing).
EAGLE_HEAD = REPO_ROOT / "models" / "eagle3-smollm2-135m"
EAGLE_HEAD_RANDOM = MODELS / "smollm2-eagle3-random"

K_MAX = 16  # longest cache draft verified (vLLM's suffix defaults rarely exceed ~12)
MODEL_DRAFT_LEN = 3
# hvd: the hybrid (gate, EAGLE3 fallback); arctic: ArcticInference's score rule on the same plugin;
# hvd-none: the hybrid with plain decoding as the fallback.
METHODS = ("none", "ngram", "suffix", "eagle3", "arctic", "hvd", "hvd-none")


def cpu_environment() -> None:
    """Defaults measured on these machines: in-process engine, 1 GiB of KV cache."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    patch_llvmlite()


def patch_llvmlite() -> None:
    """Once numba is imported (vLLM's ngram proposer does), the next engine in the process dies in
    vllm/triton_utils/dispatcher.py, which calls vars(x).get on every module attribute, and
    llvmlite's ffi.lib answers any attribute, `__dict__` included. Give it a real one."""
    try:
        import llvmlite.binding.ffi as ffi
    except ImportError:
        return
    table = getattr(ffi.lib, "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})


def engine_kwargs(model: Path, dtype: str, max_num_seqs: int = 8) -> dict:
    for needed in (model / "config.json",):
        if not needed.is_file():
            raise FileNotFoundError(f"{needed} is missing: run `make setup`")
    return dict(
        model=str(model), dtype=dtype, max_model_len=4096, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=4096, enforce_eager=True, seed=0, disable_log_stats=False,
        enable_prefix_caching=False, gpu_memory_utilization=0.5,
    )


def speculative_config(method: str, head: Path = EAGLE_HEAD) -> dict | None:
    """The speculative_config of each compared method; the hybrids also need `method_env`."""
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if method in ("suffix", "hvd-none"):
        return {"method": "suffix", "num_speculative_tokens": K_MAX}
    if method in ("eagle3", "arctic", "hvd"):
        if not (head / "config.json").is_file():
            raise FileNotFoundError(f"{head}/config.json is missing: run `make setup` (random head) or "
                                    "`make eagle3` (trained head)")
        k = MODEL_DRAFT_LEN if method == "eagle3" else K_MAX
        return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}
    raise ValueError(f"unknown method {method!r}; known: {METHODS}")


def method_env(method: str) -> dict[str, str | None]:
    """Environment each method needs (None: unset): the plugin is on for the hybrids only."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known: {METHODS}")
    hybrid = method in ("arctic", "hvd", "hvd-none")
    return {"HVD_HYBRID": "1" if hybrid else None, "HVD_RULE": "arctic" if method == "arctic" else None,
            "HVD_MODEL_DRAFT_LEN": str(MODEL_DRAFT_LEN) if hybrid else None}


def apply_method_env(method: str) -> None:
    """Set the method's environment. vLLM registers its plugins once per process, so a hybrid asked
    for after an engine without HVD_HYBRID also needs the plugin registered here."""
    env = method_env(method)
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if env["HVD_HYBRID"]:
        from controller.engines import vllm_plugin

        vllm_plugin.register()

