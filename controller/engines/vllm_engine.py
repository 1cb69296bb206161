"""How this project starts vLLM on CPU: one place for the engine arguments, the speculative
configurations it compares, the bundled model folders (built by `make setup`) and the dtype a CPU
serves fastest in."""
from __future__ import annotations

import logging
import os
import sys
import sysconfig
from collections.abc import Sequence, Set
from pathlib import Path

log = logging.getLogger("hvd.vllm")

REPO_ROOT = Path(__file__).resolve().parents[2]
MODELS = REPO_ROOT / "var" / "models"
MODEL_BF16 = MODELS / "smollm2-135m-bf16"
MODEL_FP32 = MODELS / "smollm2-135m-fp32"
# The trained head (`make eagle3`, committed with its PROVENANCE.json) and, for comparison and for
# plumbing tests, a head with RANDOM weights built by `make setup` (it accepts ~nothing).
EAGLE_HEAD = REPO_ROOT / "models" / "eagle3-smollm2-135m"
EAGLE_HEAD_RANDOM = MODELS / "smollm2-eagle3-random"

# The longest cache draft verified: vLLM's suffix default (its tree depth, 24), the drafts the
# predictor was trained on and its survival head's positions (HVD's drafts reach 4x their match)
K_MAX = 24
MODEL_DRAFT_LEN = 3
# The EAGLE3 head's greedy pick as an argmax over its 8,192-token draft vocabulary, then d2t, instead
# of vLLM's default: scatter the draft logits into a 49,152-wide tensor of -inf (index arithmetic
# rebuilt every call) and argmax over that. The same token whenever d2t maps draft ids to increasing
# target ids (the committed head's does, so even ties resolve alike); bench/eagle_overhead.py
# measures what it saves per drafted token. Every EAGLE3-based method gets it alike.
LOCAL_ARGMAX = True
# hvd: the hybrid (the default rule, EAGLE3 fallback); hvd-binary: the hybrid with the seed's binary
# rule (whole cache draft iff the predicted length beats tau); arctic: ArcticInference's score rule on
# the same plugin; hvd-none: the hybrid with plain decoding as the fallback; hvd-off-policy: the hybrid
# with its traffic read as other models' text (HVD_ON_POLICY=0: the gate's on_policy feature off);
# hvd-floor: the hybrid whose live cost fit may add a compute floor (HVD_LIVE_COST_FLOOR=1);
# hvd-oracle: the hybrid planning each cache draft with its true accepted length, read from a recording
# of the same prompts (HVD_ORACLE, which the bench sets: controller/engines/served_oracle.py).
# vllm-adaptive, sglang-hybrid, trtllm: the competitors' rules (predictor.decision.rivals) on the same
# plugin, drafts and EAGLE3 fallback.
RIVAL_METHODS = ("vllm-adaptive", "sglang-hybrid", "trtllm")
METHODS = ("none", "ngram", "suffix", "eagle3", "arctic", "hvd", "hvd-binary", "hvd-none", "hvd-off-policy",
           "hvd-floor", "hvd-oracle", *RIVAL_METHODS)
HYBRIDS = ("arctic", "hvd", "hvd-binary", "hvd-none", "hvd-off-policy", "hvd-floor", "hvd-oracle", *RIVAL_METHODS)
_RULE_OF = {"arctic": "arctic", "hvd-binary": "binary", **{m: m for m in RIVAL_METHODS}}  # the others: the default rule

# What vLLM's CPU install guide preloads ("set LD_PRELOAD"): tcmalloc (Debian libtcmalloc-minimal4)
# and Intel OpenMP (libiomp5.so from the PyPI intel-openmp wheel, installed into the venv's lib/).
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so.4")
IOMP_NAMES = ("libiomp5.so",)


class PreloadError(FileNotFoundError):
    """A library vLLM's CPU guide preloads is not on this machine."""


def _library_dirs() -> list[Path]:
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    dirs = [Path(sys.prefix) / "lib", Path(sys.base_prefix) / "lib"]
    for root in ("/usr/lib", "/lib", "/usr/local/lib", "/usr/lib64"):
        if multiarch:
            dirs.append(Path(root) / multiarch)
        dirs.append(Path(root))
    return dirs


def find_library(names: Sequence[str], dirs: Sequence[Path]) -> Path | None:
    """The first of `names` found in `dirs` (in that order), or None."""
    for d in dirs:
        for name in names:
            if (d / name).is_file():
                return d / name
    return None


def preload_libraries(dirs: Sequence[Path] | None = None) -> list[Path]:
    """tcmalloc and Intel OpenMP, found at run time. Raises PreloadError naming what is missing and
    how to install it (`make setup` installs both)."""
    dirs = list(dirs) if dirs is not None else _library_dirs()
    found, missing = [], []
    for names, how in ((TCMALLOC_NAMES, "Debian package libtcmalloc-minimal4 (apt-get install libtcmalloc-minimal4)"),
                       (IOMP_NAMES, "PyPI package intel-openmp (pip install intel-openmp into this venv)")):
        path = find_library(names, dirs)
        if path is None:
            missing.append(f"{names[0]} from the {how}")
        else:
            found.append(path)
    if missing:
        raise PreloadError(f"LD_PRELOAD asked for but {' and '.join(missing)} not found in "
                           f"{', '.join(str(d) for d in dirs)}; run `make setup`, or turn preloading off "
                           "(--no-preload)")
    return found


def ld_preload(existing: str | None = None, dirs: Sequence[Path] | None = None) -> str:
    """The LD_PRELOAD value vLLM's CPU guide asks for: tcmalloc and Intel OpenMP first, then whatever
    `existing` already preloads (kept, not duplicated). Only a process started with it is affected:
    put it in a subprocess's environment, never in this process's."""
    ours = [str(p) for p in preload_libraries(dirs)]
    theirs = [e for e in (existing or "").replace(" ", ":").split(":") if e and e not in ours]
    return ":".join(ours + theirs)


def subprocess_env(preload: bool, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a process that starts vLLM: `base` (default: this process's), with
    tcmalloc and Intel OpenMP preloaded when `preload`, else with LD_PRELOAD as `base` has it."""
    env = dict(os.environ if base is None else base)
    if preload:
        env["LD_PRELOAD"] = ld_preload(env.get("LD_PRELOAD"))
    return env


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


# /proc/cpuinfo flags of CPUs with bf16 arithmetic. Without either, vllm-cpu emulates bf16: it
# answered 4.4x slower in bf16 than in fp32 on the AVX2 machines here (docs/results/eagle3.md).
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
CPUINFO = Path("/proc/cpuinfo")


def default_dtype(cpu_flags: Set[str]) -> str:
    """bfloat16 on a CPU with bf16 arithmetic (`avx512_bf16` or `amx_bf16` among its flags), else
    float32."""
    return "bfloat16" if any(flag in cpu_flags for flag in BF16_FLAGS) else "float32"


def read_cpu_flags(path: Path | None = None) -> set[str]:
    """The flags every processor in /proc/cpuinfo (or `path`) lists (their `flags` lines'
    intersection; none without such a line). OSError if the file cannot be read."""
    per_processor = []
    for line in (path or CPUINFO).read_text(errors="replace").splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            per_processor.append(set(value.split()))
    return set.intersection(*per_processor) if per_processor else set()


def cpu_dtype(path: Path | None = None) -> tuple[str, str]:
    """The dtype this CPU serves fastest in (`default_dtype` of its flags) and why, in words. An
    unreadable /proc/cpuinfo gives float32, which every CPU runs natively, and a warning."""
    path = path or CPUINFO
    try:
        flags = read_cpu_flags(path)
    except OSError as exc:
        why = (f"cannot read {path} ({exc.strerror or exc}) to tell whether the CPU has bf16 arithmetic: "
               "float32, native on any CPU")
        log.warning("hvd serve: %s", why)
        return "float32", why
    dtype = default_dtype(flags)
    if dtype == "bfloat16":
        return dtype, f"the CPU has bf16 arithmetic ({', '.join(f for f in BF16_FLAGS if f in flags)} in {path})"
    return dtype, (f"the CPU has no bf16 arithmetic (neither {' nor '.join(BF16_FLAGS)} in {path}): bf16 would be "
                   "emulated, several times slower than float32")


def model_folder(dtype: str) -> Path:
    """The bundled model's folder for vLLM's `dtype`: the fp32 one for float32, else the bf16 one
    (vLLM casts it to float16 or keeps it for auto)."""
    return MODEL_FP32 if dtype in ("float32", "float") else MODEL_BF16


def require_model(model: Path) -> Path:
    for needed in (model / "config.json",):
        if not needed.is_file():
            raise FileNotFoundError(f"{needed} is missing: run `make setup`")
    return model


# The engine arguments every in-process engine here runs with (tests, eagle3_training, the
# benchmarks) and every vllm-cpu figure in docs/results was measured with. `hvd serve --engine vllm`
# does not impose them: it keeps vLLM's defaults (prefix caching on) beyond what it must set.
MEASURED_ENGINE = dict(max_model_len=4096, max_num_batched_tokens=4096, enforce_eager=True, seed=0,
                       disable_log_stats=False, enable_prefix_caching=False, gpu_memory_utilization=0.5)


def engine_kwargs(model: Path, dtype: str, max_num_seqs: int = 8) -> dict:
    require_model(model)
    return dict(model=str(model), dtype=dtype, max_num_seqs=max_num_seqs, **MEASURED_ENGINE)


def measured_server_args(max_num_seqs: int = 8) -> list[str]:
    """`engine_kwargs`' arguments as vLLM server flags (model, dtype, seed and statistics logging
    aside, as `hvd serve` always started the server): what the benchmark passes after `--`, so its
    servers run as the in-process engines do."""
    k = MEASURED_ENGINE
    return ["--max-model-len", str(k["max_model_len"]), "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", str(k["max_num_batched_tokens"]),
            "--enforce-eager" if k["enforce_eager"] else "--no-enforce-eager",
            "--enable-prefix-caching" if k["enable_prefix_caching"] else "--no-enable-prefix-caching",
            "--gpu-memory-utilization", str(k["gpu_memory_utilization"])]


def speculative_config(method: str, head: Path = EAGLE_HEAD) -> dict | None:
    """The speculative_config of each compared method; the hybrids also need `method_env`."""
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if method in ("suffix", "hvd-none"):
        return {"method": "suffix", "num_speculative_tokens": K_MAX}
    if method in ("eagle3", "arctic", "hvd", "hvd-binary", "hvd-off-policy", "hvd-floor", "hvd-oracle", *RIVAL_METHODS):
        if not (head / "config.json").is_file():
            raise FileNotFoundError(f"{head}/config.json is missing: run `make setup` (random head) or "
                                    "`make eagle3` (trained head)")
        k = MODEL_DRAFT_LEN if method == "eagle3" else K_MAX
        return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k,
                "use_local_argmax_reduction": LOCAL_ARGMAX}
    raise ValueError(f"unknown method {method!r}; known: {METHODS}")


def method_env(method: str) -> dict[str, str | None]:
    """Environment each method needs (None: unset): the plugin is on for the hybrids only."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known: {METHODS}")
    hybrid = method in HYBRIDS
    return {"HVD_HYBRID": "1" if hybrid else None, "HVD_RULE": _RULE_OF.get(method),
            "HVD_MODEL_DRAFT_LEN": str(MODEL_DRAFT_LEN) if hybrid else None,
            "HVD_ON_POLICY": "0" if method == "hvd-off-policy" else None,
            "HVD_LIVE_COST_FLOOR": "1" if method == "hvd-floor" else None}


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

