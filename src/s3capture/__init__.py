"""s3capture: NeMo Gym's token-capture protocols on S3-compatible object storage.

``S3TokenStore`` (in ``s3capture.store``) implements ``TokenSink`` (with ``begin_call``),
``TokenSource`` and ``LineageResolver`` without compare-and-swap; ``S3CaptureLedger`` (in
``s3capture.ledger``) implements ``CaptureLedger`` for token data staged elsewhere. Both list a root's
rollouts (``rollouts()``, yielding ``RolloutInfo``), and ``S3TokenStore.read_snapshot`` reads a
frozen rollout with GET and LIST permission only. The record types are in
``s3capture.records`` and the protocols in ``s3capture.protocols``; see ``docs/design.md``.
"""

from s3capture.protocols import (
    CaptureLedger,
    LineageMatch,
    LineageResolution,
    LineageResolver,
    RolloutRemovalPayload,
    RolloutRetiredError,
    TokenCaptureFrozenError,
    TokenCaptureRetiredError,
    TokenCaptureSnapshot,
    TokenSink,
    TokenSource,
    install_lineage_store,
    install_token_sink,
    install_token_source,
    installed_lineage_store,
    installed_token_sink,
    installed_token_source,
)
from s3capture.errors import ListingError, SnapshotNotSealedError, StoreError
from s3capture.records import ParentResolutionStatus, RecordError, TokenEntry, UnsupportedSchemaError

__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: importing the protocols must not import aioboto3
    if name in ("S3TokenStore", "FrozenSnapshot"):
        from s3capture import store

        return getattr(store, name)
    if name == "RolloutInfo":
        from s3capture import rollouts

        return rollouts.RolloutInfo
    if name in ("S3CaptureLedger", "LedgerConflictError"):
        from s3capture import ledger

        return getattr(ledger, name)
    raise AttributeError(name)


__all__ = [
    "CaptureLedger",
    "FrozenSnapshot",
    "LedgerConflictError",
    "LineageMatch",
    "ListingError",
    "LineageResolution",
    "LineageResolver",
    "ParentResolutionStatus",
    "RecordError",
    "RolloutInfo",
    "RolloutRemovalPayload",
    "RolloutRetiredError",
    "S3CaptureLedger",
    "S3TokenStore",
    "SnapshotNotSealedError",
    "StoreError",
    "TokenCaptureFrozenError",
    "TokenCaptureRetiredError",
    "TokenCaptureSnapshot",
    "TokenEntry",
    "TokenSink",
    "TokenSource",
    "UnsupportedSchemaError",
    "install_lineage_store",
    "install_token_sink",
    "install_token_source",
    "installed_lineage_store",
    "installed_token_sink",
    "installed_token_source",
]
