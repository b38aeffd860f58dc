"""The token-capture protocols of NeMo Gym, as described in ``protocols-reference.txt``.

Source of the contract: ``nemo_gym.token_id_capture.protocols`` (the revision described in
``shared/spec/protocols-reference.txt``, newer than nemo-gym 0.7.0: it adds ``retire``, ``delete``,
the frozen and retired errors and ``RolloutRetiredError``). This module imports only the standard
library, ``s3capture.records`` and ``s3capture.gym_compat`` (standard library only), so a process
can depend on the contracts without aioboto3.

The runtime-checkable protocols check method presence only. s3capture's S3 implementation lives in
``s3capture.store``; the install functions below keep one process-wide default of each kind. There
is one registry per process: when ``nemo_gym`` is importable, ``install_*`` and ``installed_*``
are Gym's own (``nemo_gym.token_id_capture.protocols``), so a store installed through either
package is the one Gym's capture middleware and consumers see; without Gym they use s3capture's.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, TypedDict, runtime_checkable

from s3capture import gym_compat
from s3capture.records import ParentResolutionStatus, TokenEntry

gym_compat.apply_if_gym_installed()  # Gym 0.7.0's build_sink() on Python 3.11; see s3capture.gym_compat

__all__ = [
    "TokenCaptureSnapshot",
    "LineageMatch",
    "LineageResolution",
    "RolloutRemovalPayload",
    "TokenCaptureFrozenError",
    "TokenCaptureRetiredError",
    "RolloutRetiredError",
    "TokenSink",
    "TokenSource",
    "LineageResolver",
    "CaptureLedger",
    "install_token_sink",
    "install_token_source",
    "install_lineage_store",
    "installed_token_sink",
    "installed_token_source",
    "installed_lineage_store",
    "gym_registry",
]


@dataclass(frozen=True)
class TokenCaptureSnapshot:
    """An immutable view of one rollout's frozen capture records.

    ``entries`` holds one entry per model call id (order carries no meaning); ``incomplete`` is
    True when the rollout must be masked; ``snapshot_id`` and ``version`` identify the frozen
    state for a conditional ``TokenSource.drop``.
    """

    rollout_id: str
    entries: tuple[Any, ...]
    incomplete: bool
    snapshot_id: str
    version: int


@dataclass(frozen=True)
class LineageMatch:
    """A uniquely verified parent from a shared lineage store."""

    model_call_id: str
    cumulative_token_ids: tuple[int, ...]
    digest: str
    staging_chain: tuple[str, ...] = ()
    prev_len: int = 0
    chain_hash: str = ""


@dataclass(frozen=True)
class LineageResolution:
    """One immutable request-time parent decision.

    Raises ``ValueError`` when constructed RESOLVED without a match, or with a match on any other
    status.
    """

    status: ParentResolutionStatus
    match: LineageMatch | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        if self.status == ParentResolutionStatus.RESOLVED and self.match is None:
            raise ValueError("resolved lineage requires a match")
        if self.status != ParentResolutionStatus.RESOLVED and self.match is not None:
            raise ValueError(f"{ParentResolutionStatus(self.status).value} lineage cannot carry a match")


class RolloutRemovalPayload(TypedDict):
    """The result of retiring or deleting rollouts, as plain wire data (``{"removed", "absent"}``)."""

    removed: list[str]
    absent: list[str]


class TokenCaptureFrozenError(RuntimeError):
    """Reject a write that arrived after its rollout's capture was frozen.

    The caller drops the late record and must not mark the rollout incomplete.
    """


class TokenCaptureRetiredError(TokenCaptureFrozenError):
    """Reject a write that arrived after its rollout's capture was retired (handle like frozen)."""


class RolloutRetiredError(LookupError):
    """Reject reading the ledger of a rollout that was retired; delete it to reuse the id."""


@runtime_checkable
class TokenSink(Protocol):
    """Receive captured records (``put``, ``mark_incomplete``, ``close``)."""

    async def put(self, entry: TokenEntry) -> None: ...

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None: ...

    async def close(self) -> None: ...


@runtime_checkable
class TokenSource(Protocol):
    """Where a trajectory builder freezes, reads, and retires records."""

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot: ...

    async def drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool: ...

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload: ...

    async def delete(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload: ...

    async def close(self) -> None: ...


@runtime_checkable
class LineageResolver(Protocol):
    """Resolve request-time lineage from entries committed by a token sink."""

    async def resolve(self, rollout_id: str, request_items: list[dict]) -> LineageResolution: ...

    def is_process_shared(self) -> bool: ...

    async def close(self) -> None: ...


@runtime_checkable
class CaptureLedger(LineageResolver, Protocol):
    """Store metadata for calls whose token data is staged externally."""

    async def record(self, commit: Any) -> None: ...

    async def record_failure(self, rollout_id: str, model_call_id: str, reason: str) -> None: ...

    async def manifest(self, rollout_id: str) -> dict: ...

    async def has_rows(self, rollout_id: str) -> bool: ...

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload: ...

    async def delete(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload: ...


_INSTALLED_SINK: TokenSink | None = None
_INSTALLED_SOURCE: TokenSource | None = None
_INSTALLED_LINEAGE_STORE: LineageResolver | None = None
"""s3capture's own registry: used only when NeMo Gym is not importable (see ``gym_registry``)."""

_GYM_MODULE = "nemo_gym.token_id_capture.protocols"
_GYM_REGISTRY: ModuleType | None = None


def gym_registry() -> ModuleType | None:
    """NeMo Gym's registry module (``nemo_gym.token_id_capture.protocols``), or None without Gym.

    Looked up on ``install_*`` / ``installed_*`` calls, not at import (importing it imports
    ``nemo_gym.token_id_capture``, about a third of a second). Once found it is kept for the
    process; while not found (no ``nemo_gym`` package, or importing it raises ``ImportError``, for
    example without pydantic) it is looked for again on the next call, and s3capture's own registry
    is used. When Gym is first found, anything already in s3capture's own registry moves into
    Gym's where Gym's slot is empty, so nothing installed earlier is lost.
    """
    global _GYM_REGISTRY, _INSTALLED_SINK, _INSTALLED_SOURCE, _INSTALLED_LINEAGE_STORE
    if _GYM_REGISTRY is not None:
        return _GYM_REGISTRY
    try:
        if importlib.util.find_spec("nemo_gym") is None:
            return None
        registry = importlib.import_module(_GYM_MODULE)
    except (ImportError, ValueError):
        return None
    for value, installed, install in (
        (_INSTALLED_SINK, registry.installed_token_sink, registry.install_token_sink),
        (_INSTALLED_SOURCE, registry.installed_token_source, registry.install_token_source),
        (_INSTALLED_LINEAGE_STORE, registry.installed_lineage_store, registry.install_lineage_store),
    ):
        if value is not None and installed() is None:
            install(value)
    _INSTALLED_SINK = _INSTALLED_SOURCE = _INSTALLED_LINEAGE_STORE = None
    _GYM_REGISTRY = registry
    return registry


def install_token_sink(sink: TokenSink | None) -> None:
    """Set (or clear, with ``None``) the process-wide default sink.

    With NeMo Gym importable this is Gym's ``install_token_sink`` (one registry: Gym's capture
    middleware then uses ``sink`` for every training-capture call without a configured sink), else
    s3capture's own registry. Raises ``TypeError`` when ``sink`` lacks ``put``, ``mark_incomplete``
    or ``close`` (nothing is installed then).
    """
    global _INSTALLED_SINK
    if sink is not None:
        missing = [name for name in ("put", "mark_incomplete", "close") if not callable(getattr(sink, name, None))]
        if missing:
            raise TypeError(f"{type(sink).__name__} is not a TokenSink: it lacks {', '.join(missing)}")
    gym = gym_registry()
    if gym is not None:
        gym.install_token_sink(sink)
    else:
        _INSTALLED_SINK = sink


def install_token_source(source: TokenSource | None) -> None:
    """Set (or clear) the caller-owned source in this process. It is never closed for you.

    Gym's registry when NeMo Gym is importable, else s3capture's own.
    """
    global _INSTALLED_SOURCE
    gym = gym_registry()
    if gym is not None:
        gym.install_token_source(source)
    else:
        _INSTALLED_SOURCE = source


def install_lineage_store(store: LineageResolver | None) -> None:
    """Set (or clear) the process-wide request-time lineage store (or ``CaptureLedger``).

    Gym's registry when NeMo Gym is importable, else s3capture's own.
    """
    global _INSTALLED_LINEAGE_STORE
    gym = gym_registry()
    if gym is not None:
        gym.install_lineage_store(store)
    else:
        _INSTALLED_LINEAGE_STORE = store


def installed_token_sink() -> TokenSink | None:
    """The process-wide sink (Gym's ``installed_token_sink()`` when Gym is importable), or None."""
    gym = gym_registry()
    return gym.installed_token_sink() if gym is not None else _INSTALLED_SINK


def installed_token_source() -> TokenSource | None:
    """The process-wide source (Gym's ``installed_token_source()`` when Gym is importable), or None."""
    gym = gym_registry()
    return gym.installed_token_source() if gym is not None else _INSTALLED_SOURCE


def installed_lineage_store() -> LineageResolver | None:
    """The process-wide lineage store (Gym's ``installed_lineage_store()`` when Gym is importable), or None."""
    gym = gym_registry()
    return gym.installed_lineage_store() if gym is not None else _INSTALLED_LINEAGE_STORE
