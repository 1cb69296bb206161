"""Drafter and cost profiles for the policy simulator and the goodput rule: the bundled ones
(profiles.toml), then this deployment's own (the user profiles file, HVD_PROFILES_FILE, which
`hvd profile` writes: a profile measured on the deployment's engine rather than on another machine)."""
from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from storage.env import raw_env

PROFILES_FILE = Path(__file__).with_name("profiles.toml")
DEFAULT_COST_PROFILE = "gpu-8b"  # what decisions and reports are priced with unless told otherwise
USER_PROFILES_ENV = "HVD_PROFILES_FILE"
# The user profiles file when HVD_PROFILES_FILE is unset, relative to the working directory (as the
# default database, sqlite:///var/hvd.db, is); used only if it exists.
DEFAULT_USER_PROFILES = Path("var") / "profiles.toml"
KINDS = ("cost", "drafter")  # the tables a profiles file holds: [cost.NAME] and [drafter.NAME]


class ProfileError(ValueError):
    pass


@dataclass(frozen=True)
class DrafterProfile:
    """A model drafter for the simulator and the allocator's prior: a draft of `draft_len` tokens
    whose survival curve S(j) = P(accepted >= j) is either MEASURED per position (`survival`, and
    per workload `survival_by_workload`, from vLLM's per-position acceptance counters) or a chain
    where each token is accepted with probability `acceptance` (per workload where `by_workload`
    says) given the earlier ones were. `measured` says the figures were measured under an engine,
    not assumed; the draws the simulator makes from the curve are simulated either way."""

    name: str
    draft_len: int
    acceptance: float
    description: str = ""
    by_workload: dict[str, float] = field(default_factory=dict)
    measured: bool = False
    survival: tuple[float, ...] = ()
    survival_by_workload: dict[str, tuple[float, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.draft_len < 1:
            raise ProfileError(f"drafter {self.name}: draft_len must be >= 1, got {self.draft_len}")
        for label, value in [("acceptance", self.acceptance), *((f"by_workload.{w}", a) for w, a in self.by_workload.items())]:
            if not 0.0 <= value < 1.0:
                raise ProfileError(f"drafter {self.name}: {label} must be in [0, 1), got {value}")
        object.__setattr__(self, "survival", tuple(float(v) for v in self.survival))
        object.__setattr__(self, "survival_by_workload",
                           {w: tuple(float(v) for v in c) for w, c in self.survival_by_workload.items()})
        curves = ([("survival", self.survival)] if self.survival else []) + \
            [(f"survival_by_workload.{w}", c) for w, c in self.survival_by_workload.items()]
        for label, curve in curves:
            if len(curve) != self.draft_len:
                raise ProfileError(f"drafter {self.name}: {label} must give {self.draft_len} positions "
                                   f"(draft_len), got {len(curve)}")
            if not all(0.0 <= v < 1.0 for v in curve) or any(b > a for a, b in zip(curve, curve[1:])):
                raise ProfileError(f"drafter {self.name}: {label} must be non-increasing in [0, 1), got {list(curve)}")

    def _measured_curve(self, workload: str) -> tuple[float, ...] | None:
        """The measured S(j) that applies to a workload: its own, else the overall one unless the
        workload has its own chain acceptance; None where the profile is a chain."""
        curve = self.survival_by_workload.get(workload)
        if curve is None and self.survival and workload not in self.by_workload:
            curve = self.survival
        return curve

    def acceptance_for(self, workload: str) -> float:
        """The per-token chain acceptance: the profile's, or the chain with the measured curve's mean."""
        curve = self._measured_curve(workload)
        if curve is not None:
            return chain_acceptance(sum(curve), self.draft_len)
        return self.by_workload.get(workload, self.acceptance)

    def survival_for(self, workload: str) -> np.ndarray:
        """S(j) = P(accepted >= j), j = 1..draft_len, of this drafter on a workload: the allocator's
        prior for the model drafter before live drafts are seen, and what the simulator draws from."""
        curve = self._measured_curve(workload)
        if curve is not None:
            return np.array(curve, dtype=np.float64)
        return np.cumprod(np.full(self.draft_len, self.acceptance_for(workload), dtype=np.float64))

    def mean_accepted_for(self, workload: str) -> float:
        return float(self.survival_for(workload).sum())

    @property
    def mean_accepted(self) -> float:
        if self.survival:
            return float(sum(self.survival))
        return chain_mean(self.acceptance, self.draft_len)

    @property
    def tokens_per_cycle(self) -> float:
        return 1.0 + self.mean_accepted


def accepted_from_survival(survival: np.ndarray, u: "float | np.ndarray") -> "int | np.ndarray":
    """Accepted tokens of a draft drawn with uniform u: #{j : u < S(j)}, so P(accepted >= j) = S(j).
    For a chain (S(j) = p^j) this is floor(log u / log p) capped at the draft length. `survival` is
    one curve, or one curve per draw ((n, k) against n draws)."""
    s = np.asarray(survival, dtype=np.float64)
    out = (np.asarray(u, dtype=np.float64)[..., None] < s).sum(axis=-1)
    return int(out) if out.ndim == 0 else out.astype(np.int64)


def known_survival(accepted: np.ndarray, width: int) -> np.ndarray:
    """The survival curves of drafts whose accepted lengths are known: S(j) = 1 for j <= accepted, 0
    after ((n, width) float64). What a perfect predictor would say; accepted_from_survival's inverse."""
    return (np.arange(1, width + 1)[None, :] <= np.asarray(accepted)[:, None]).astype(np.float64)


def chain_mean(acceptance: float, draft_len: int) -> float:
    """Mean accepted tokens of a chain draft: sum_{i=1..k} acceptance^i."""
    return sum(acceptance**i for i in range(1, draft_len + 1))


def chain_acceptance(mean_accepted: float, draft_len: int) -> float:
    """The per-token acceptance whose chain has this mean (the inverse of chain_mean, by bisection)."""
    if not 0.0 <= mean_accepted < draft_len:
        raise ProfileError(f"mean accepted {mean_accepted} is outside [0, {draft_len})")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chain_mean(mid, draft_len) < mean_accepted else (lo, mid)
    return lo


@dataclass(frozen=True)
class CostProfile:
    """What one engine step costs, for the simulator, the goodput rule and the allocator.

    One target forward over n query tokens at batch 1: t(n) = base_ms + per_token_ms * n. Where a
    batch-8 fit exists (n query tokens for each of 8 requests) the base and the per-request slope are
    interpolated linearly in the batch size (and extrapolated past 8); without one, each running
    request adds `per_request_ms` (its KV cache read) to the base. `compute_ms_per_token` is a
    compute-bound floor: a step of Q query tokens takes at least Q times it, which is what makes a
    GPU's verification dear at large batch. The model drafter costs `draft_call_ms` per call plus
    `draft_token_ms` per drafted position (the batch-8 figure interpolated likewise), paid once per
    step whatever the number of requests that use it."""

    name: str
    base_ms: float
    per_token_ms: float
    draft_token_ms: float
    description: str = ""
    # The same fit at batch 8 (n query tokens for each of 8 requests), where measured.
    batch8_base_ms: float | None = None
    batch8_per_token_ms: float | None = None
    batch8_draft_token_ms: float | None = None
    draft_call_ms: float = 0.0
    per_request_ms: float = 0.0
    compute_ms_per_token: float = 0.0
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.base_ms <= 0 or self.per_token_ms < 0 or self.draft_token_ms < 0:
            raise ProfileError(f"cost profile {self.name}: base_ms must be > 0 and the others >= 0")
        if (self.batch8_base_ms is None) != (self.batch8_per_token_ms is None):
            raise ProfileError(f"cost profile {self.name}: give both batch8_base_ms and batch8_per_token_ms, or neither")
        for label in ("batch8_base_ms", "batch8_per_token_ms", "batch8_draft_token_ms", "draft_call_ms",
                      "per_request_ms", "compute_ms_per_token"):
            value = getattr(self, label)
            if value is not None and not value >= 0:
                raise ProfileError(f"cost profile {self.name}: {label} must be >= 0, got {value}")

    def target_ms(self, query_tokens: float) -> float:
        return self.base_ms + self.per_token_ms * query_tokens

    def _batch_weight(self, batch: int) -> float:
        return (max(batch, 1) - 1) / 7.0

    def step_line(self, batch: int) -> tuple[float, float]:
        """(base ms, ms per query token of the whole step) of the memory-bound line at this batch size."""
        if self.batch8_base_ms is None:
            return self.base_ms + self.per_request_ms * (max(batch, 1) - 1), self.per_token_ms
        w = self._batch_weight(batch)
        base = self.base_ms + w * (self.batch8_base_ms - self.base_ms)
        per_request_slope = self.per_token_ms + w * (self.batch8_per_token_ms - self.per_token_ms)
        return base, per_request_slope / max(batch, 1)

    def draft_ms(self, batch: int, model_k: "int | np.ndarray") -> "float | np.ndarray":
        """The model drafter's cost for one step that drafts `model_k` positions (0: not called)."""
        per_token = self.draft_token_ms
        if self.batch8_draft_token_ms is not None:
            per_token += self._batch_weight(batch) * (self.batch8_draft_token_ms - self.draft_token_ms)
        k = np.asarray(model_k, dtype=np.float64)
        out = np.where(k > 0, self.draft_call_ms + k * per_token, 0.0)
        return float(out) if out.ndim == 0 else out

    def step_ms(self, batch: int, query_tokens: "float | np.ndarray", model_k: "int | np.ndarray" = 0) -> "float | np.ndarray":
        """One whole engine step: `batch` running requests, `query_tokens` verified in all (one per
        request plus their draft tokens), the model drafter called for `model_k` positions."""
        base, per_query = self.step_line(batch)
        q = np.asarray(query_tokens, dtype=np.float64)
        out = np.maximum(base + per_query * q, self.compute_ms_per_token * q) + self.draft_ms(batch, model_k)
        return float(out) if out.ndim == 0 else out

    def per_request(self, batch: int) -> "CostProfile":
        """One request's share of a step with `batch` running requests: the batch-1 and batch-8 fits
        interpolated (linearly in the batch size) and divided by the batch. The goodput rule then
        weighs a request's extra query tokens against its share of the step, so verification grows
        dearer as batches fill a compute-bound machine. Without a batch-8 fit: the batch-1 profile."""
        if self.batch8_base_ms is None or batch <= 1:
            return self
        w = self._batch_weight(batch)
        base = self.base_ms + w * (self.batch8_base_ms - self.base_ms)
        per_token = self.per_token_ms + w * (self.batch8_per_token_ms - self.per_token_ms)
        return CostProfile(f"{self.name}@{batch}", base / batch, per_token / batch, self.draft_token_ms / batch)


def _load(path: Path = PROFILES_FILE) -> dict:
    """A profiles file as TOML; ProfileError naming the file when it cannot be read or parsed."""
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read it: {exc.strerror or exc}") from None


def user_profiles_file(environ: Mapping[str, str] | None = None) -> Path | None:
    """The deployment's own profiles file: HVD_PROFILES_FILE, else var/profiles.toml (relative to
    the working directory) if it exists, else None. A file named explicitly must exist: a typo in
    the setting should not silently leave a replica on the bundled profiles."""
    raw = raw_env(USER_PROFILES_ENV, environ)
    if raw is None:
        return DEFAULT_USER_PROFILES if DEFAULT_USER_PROFILES.is_file() else None
    path = Path(raw).expanduser()
    if not path.is_file():
        raise ProfileError(f"{USER_PROFILES_ENV}={raw!r} names no file ({path.absolute()}): write it with "
                           f"`hvd profile --out {raw}`, or unset {USER_PROFILES_ENV} "
                           f"(then {DEFAULT_USER_PROFILES} is read if it exists)")
    return path


def _tables(data: dict, kind: str, path: Path) -> dict[str, dict]:
    tables = data.get(kind, {})
    if not isinstance(tables, dict) or not all(isinstance(v, dict) for v in tables.values()):
        raise ProfileError(f"{path}: `{kind}` must hold one table per profile, [{kind}.NAME]")
    return tables


def read_profiles_file(path: Path) -> dict:
    """A user profiles file as TOML, its top level checked: only [cost.NAME] and [drafter.NAME] tables (a
    misspelt table would otherwise be ignored without a word)."""
    data = _load(path)
    unknown = sorted(set(data) - set(KINDS))
    if unknown:
        raise ProfileError(f"{path}: unknown top-level key(s) {unknown}: a profiles file holds only "
                           "[cost.NAME] and [drafter.NAME] tables")
    for kind in KINDS:
        _tables(data, kind, path)
    return data


def _specs(kind: str, path: Path, environ: Mapping[str, str] | None) -> dict[str, tuple[Path, dict]]:
    """Every profile of `kind` with the file it came from: `path`'s (the bundled file by default),
    then the user profiles file's, which may add names but not reuse one of `path`'s (a profile
    must mean one thing wherever its name is read)."""
    bundled = _tables(_load(path), kind, path)
    out = {name: (path, spec) for name, spec in bundled.items()}
    user = user_profiles_file(environ)
    if user is None or user.resolve() == path.resolve():
        return out
    own = _tables(read_profiles_file(user), kind, user)
    reused = sorted(set(own) & set(bundled))
    if reused:
        raise ProfileError(f"{user}: {kind} profile name(s) {reused} are bundled ones ({path}): "
                           "name the deployment's own profile differently")
    out.update((name, (user, spec)) for name, spec in own.items())
    return out


def _build(cls: type, kind: str, name: str, spec: dict, source: Path) -> Any:
    """One profile from its table; every problem is a ProfileError naming the file and the profile."""
    spec = dict(spec)
    if kind == "cost" and isinstance(spec.get("sources"), list):
        spec["sources"] = tuple(spec["sources"])
    try:
        return cls(name=name, **spec)
    except ProfileError as exc:
        raise ProfileError(f"{source}: {exc}") from None
    except (TypeError, ValueError) as exc:  # an unknown key, a value of the wrong type
        raise ProfileError(f"{source}: {kind} profile {name!r}: {exc}") from None


def drafter_profiles(path: Path = PROFILES_FILE, environ: Mapping[str, str] | None = None) -> dict[str, DrafterProfile]:
    """The drafter profiles of `path`, then of the user profiles file (`user_profiles_file(environ)`)."""
    return {name: _build(DrafterProfile, "drafter", name, spec, source)
            for name, (source, spec) in _specs("drafter", path, environ).items()}


def cost_profiles(path: Path = PROFILES_FILE, environ: Mapping[str, str] | None = None) -> dict[str, CostProfile]:
    """The cost profiles of `path`, then of the user profiles file (`user_profiles_file(environ)`)."""
    return {name: _build(CostProfile, "cost", name, spec, source)
            for name, (source, spec) in _specs("cost", path, environ).items()}


# ------------------------------------------------------------------ writing the user profiles file
# tomllib only reads. The writer below covers what a profiles file holds (tables of strings,
# numbers, booleans and arrays of them), and every write is read back and compared before it lands.
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
USER_FILE_HEADER = ("This deployment's own profiles, read after predictor/decision/profiles.toml (HVD_PROFILES_FILE, "
                    "default var/profiles.toml).\n`hvd profile` adds or replaces [cost.NAME] here and rewrites the "
                    "file: comments are not kept.")


def toml_string(text: str) -> str:
    """`text` as a TOML basic string: quotes, backslashes and control characters escaped, other
    characters (any Unicode) as they are."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04X}")
        elif 0xD800 <= code <= 0xDFFF:
            raise ProfileError(f"cannot write a lone surrogate (U+{code:04X}) in a TOML string: {text!r}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else toml_string(key)


def _toml_value(value: Any, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value)  # '1e-06', '-0.0', 'inf', '-inf': all TOML floats, exact when read back
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v, where) for v in value) + "]"
    raise ProfileError(f"{where}: cannot write a {type(value).__name__} value as TOML here: {value!r}")


def dumps_toml(data: Mapping[str, Any], header: str = "") -> str:
    """`data` (nested mappings of strings, numbers, booleans and arrays of them) as TOML text, each
    mapping a [table] (its plain values first), `header` as comment lines on top."""
    lines = [f"# {line}".rstrip() for line in header.splitlines()]

    def emit(path: list[str], table: Mapping[str, Any]) -> None:
        plain = [key for key, value in table.items() if not isinstance(value, Mapping)]
        if path and (plain or not table):  # a table of tables only is defined by its subtables' headers
            if lines:
                lines.append("")
            lines.append("[" + ".".join(toml_key(k) for k in path) + "]")
        for key, value in table.items():
            if not isinstance(value, Mapping):
                lines.append(f"{toml_key(key)} = {_toml_value(value, '.'.join([*path, key]))}")
        for key, value in table.items():
            if isinstance(value, Mapping):
                emit([*path, key], value)

    emit([], data)
    return "\n".join(lines) + "\n"


def _same(a: Any, b: Any) -> bool:
    """Equal as TOML values: the same type (a tuple reads back as a list) and value, nan equal to nan."""
    if isinstance(a, Mapping):
        return isinstance(b, Mapping) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def cost_profile_table(profile: CostProfile) -> dict[str, Any]:
    """A CostProfile as its [cost.NAME] table: description first, then every figure that is set."""
    table: dict[str, Any] = {"description": profile.description}
    for f in fields(CostProfile):
        value = getattr(profile, f.name)
        if f.name in ("name", "description") or value is None or (f.name == "sources" and not value):
            continue
        table[f.name] = list(value) if f.name == "sources" else float(value)
    return table


def check_user_profile_name(name: str, kind: str = "cost", bundled: Path = PROFILES_FILE) -> None:
    """ProfileError if `name` is a bundled profile's (a user profile may not shadow one)."""
    if name in _tables(_load(bundled), kind, bundled):
        raise ProfileError(f"{kind} profile {name!r} is a bundled one ({bundled}): give the measured profile "
                           "another name")


def save_cost_profile(profile: CostProfile, path: Path, bundled: Path = PROFILES_FILE) -> None:
    """Add or replace [cost.NAME] in the user profiles file `path` (made if missing), keeping its
    other entries. The new text is read back and must give the same tables and the same profile
    before it replaces the file (atomically: a reader never sees half a file)."""
    check_user_profile_name(profile.name, "cost", bundled)
    data = read_profiles_file(path) if path.exists() else {}
    data.setdefault("cost", {})[profile.name] = cost_profile_table(profile)
    text = dumps_toml(data, USER_FILE_HEADER)
    back = tomllib.loads(text)
    if not _same(data, back) or _build(CostProfile, "cost", profile.name, back["cost"][profile.name], path) != profile:
        raise ProfileError(f"{path}: the TOML written for cost profile {profile.name!r} does not read back as the "
                           "same profile; nothing was written")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)

def pick(profiles: dict, names: list[str] | None, kind: str) -> list:
    """The named profiles, in the given order; an unknown name lists the known ones."""
    if not names:
        return list(profiles.values())
    unknown = [n for n in names if n not in profiles]
    if unknown:
        raise ProfileError(f"unknown {kind} profile(s) {unknown}; known: {sorted(profiles)}")
    return [profiles[n] for n in names]
