"""What a request tells HVD about itself (`SamplingParams.extra_args`, `vllm_xargs` in the OpenAI
API): tenant, workload and whether it may be speculated. Checked once, where the request enters,
so a bad value is a 400 naming the field instead of a guess repeated at every decoding step."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from storage.workloads import WORKLOADS
from storage.errors import FieldError
from storage.tenants import normalise_tenant

TENANT, WORKLOAD, SPECULATE = "hvd_tenant", "hvd_workload", "hvd_speculate"
FIELDS = (TENANT, WORKLOAD, SPECULATE)


class RequestMetadataError(ValueError):
    """A refused metadata value; ``field`` is the `vllm_xargs` key, and the message names it too."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


@dataclass(frozen=True)
class RequestMetadata:
    tenant: str
    workload: str
    speculate: bool


def parse_request_metadata(extra_args: object, default_tenant: str = "default",
                           default_workload: str = "chat") -> RequestMetadata:
    """The request's metadata with defaults for what it leaves out. Keys other than ``hvd_*`` belong
    to others and are ignored; an unknown ``hvd_*`` key is refused (a typo would otherwise be
    silently ignored)."""
    if extra_args is None:
        extra_args = {}
    if not isinstance(extra_args, Mapping):
        raise RequestMetadataError("vllm_xargs", f"vllm_xargs must be an object, got {_kind(extra_args)}")
    for key in extra_args:
        if isinstance(key, str) and key.startswith("hvd_") and key not in FIELDS:
            raise RequestMetadataError(key, f"{_cap(ascii(key)[1:-1])} is not an HVD field; known: {', '.join(FIELDS)}")
    tenant = extra_args.get(TENANT, default_tenant)
    try:
        tenant = normalise_tenant(tenant, TENANT)
    except FieldError as exc:
        raise RequestMetadataError(TENANT, str(exc)) from None
    workload = extra_args.get(WORKLOAD, default_workload)
    if not isinstance(workload, str) or workload not in WORKLOADS:
        raise RequestMetadataError(WORKLOAD, f"{WORKLOAD} must be one of {', '.join(WORKLOADS)}; got {_show(workload)}")
    speculate = extra_args.get(SPECULATE, True)
    if not isinstance(speculate, bool):
        raise RequestMetadataError(SPECULATE, f"{SPECULATE} must be a JSON boolean (true or false); got {_show(speculate)}")
    return RequestMetadata(tenant, workload, speculate)


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _show(value: object, cap: int = 60) -> str:
    """A client's value quoted for an error message: escaped (no control characters reach a log or
    terminal) and cut to ``cap`` characters."""
    return _cap(ascii(value), cap)


def _cap(text: str, cap: int = 60) -> str:
    return text if len(text) <= cap else text[: cap - 1] + "…"
