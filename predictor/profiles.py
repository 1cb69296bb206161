"""Drafter and cost profiles for the policy simulator and the goodput rule, from profiles.toml."""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

PROFILES_FILE = Path(__file__).with_name("profiles.toml")


class ProfileError(ValueError):
    pass


@dataclass(frozen=True)
class DrafterProfile:
    """A simulated model drafter: chain of `draft_len` tokens, per-token acceptance `acceptance`."""

    name: str
    draft_len: int
    acceptance: float
    description: str = ""

    def __post_init__(self) -> None:
        if self.draft_len < 1:
            raise ProfileError(f"drafter {self.name}: draft_len must be >= 1, got {self.draft_len}")
        if not 0.0 <= self.acceptance < 1.0:
            raise ProfileError(f"drafter {self.name}: acceptance must be in [0, 1), got {self.acceptance}")

    @property
    def mean_accepted(self) -> float:
        return sum(self.acceptance**i for i in range(1, self.draft_len + 1))

    @property
    def tokens_per_cycle(self) -> float:
        return 1.0 + self.mean_accepted


@dataclass(frozen=True)
class CostProfile:
    """t(n) = base_ms + per_token_ms * n per target forward; draft_token_ms per model draft token."""

    name: str
    base_ms: float
    per_token_ms: float
    draft_token_ms: float
    description: str = ""
    # The same fit at batch 8 (n query tokens for each of 8 requests), where measured.
    batch8_base_ms: float | None = None
    batch8_per_token_ms: float | None = None

    def __post_init__(self) -> None:
        if self.base_ms <= 0 or self.per_token_ms < 0 or self.draft_token_ms < 0:
            raise ProfileError(f"cost profile {self.name}: base_ms must be > 0 and the others >= 0")
        if (self.batch8_base_ms is None) != (self.batch8_per_token_ms is None):
            raise ProfileError(f"cost profile {self.name}: give both batch8_base_ms and batch8_per_token_ms, or neither")

    def target_ms(self, query_tokens: float) -> float:
        return self.base_ms + self.per_token_ms * query_tokens

    def per_request(self, batch: int) -> "CostProfile":
        """One request's share of a step with `batch` running requests: the batch-1 and batch-8 fits
        interpolated (linearly in the batch size) and divided by the batch. The goodput rule then
        weighs a request's extra query tokens against its share of the step, so verification grows
        dearer as batches fill a compute-bound machine. Without a batch-8 fit: the batch-1 profile."""
        if self.batch8_base_ms is None or batch <= 1:
            return self
        w = (batch - 1) / 7.0
        base = self.base_ms + w * (self.batch8_base_ms - self.base_ms)
        per_token = self.per_token_ms + w * (self.batch8_per_token_ms - self.per_token_ms)
        return CostProfile(f"{self.name}@{batch}", base / batch, per_token / batch, self.draft_token_ms / batch)


def _load(path: Path = PROFILES_FILE) -> dict:
    with path.open("rb") as fh:
        return tomllib.load(fh)


def drafter_profiles(path: Path = PROFILES_FILE) -> dict[str, DrafterProfile]:
    return {name: DrafterProfile(name=name, **spec) for name, spec in _load(path).get("drafter", {}).items()}


def cost_profiles(path: Path = PROFILES_FILE) -> dict[str, CostProfile]:
    return {name: CostProfile(name=name, **spec) for name, spec in _load(path).get("cost", {}).items()}


def pick(profiles: dict, names: list[str] | None, kind: str) -> list:
    """The named profiles, in the given order; an unknown name lists the known ones."""
    if not names:
        return list(profiles.values())
    unknown = [n for n in names if n not in profiles]
    if unknown:
        raise ProfileError(f"unknown {kind} profile(s) {unknown}; known: {sorted(profiles)}")
    return [profiles[n] for n in names]
