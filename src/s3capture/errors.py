"""Errors raised by s3capture's object-store layer."""

from __future__ import annotations

__all__ = ["StoreError", "ListingError", "SnapshotNotSealedError", "ExportWorkerDied", "install_hint"]


def install_hint(extra: str) -> str:
    """How to install one of s3capture's optional extras, for an error message: from a package
    index, and from a checkout (s3capture is installed from its repository, as the README does)."""
    return f"pip install 's3capture[{extra}]' (in a checkout of s3capture: pip install -e '.[{extra}]')"


class StoreError(RuntimeError):
    """The object store refused or failed an operation (missing bucket, access denied, outage,
    an unverifiable listing, a body cut short, ...).

    ``operation`` is the S3 operation (``"PUT"``, ``"GET"``, ``"LIST"``, ``"DELETE"``, ...) and
    ``key`` the object key or LIST prefix it concerned, when known.
    """

    def __init__(self, message: str, *, operation: str = "", key: str = "") -> None:
        super().__init__(message)
        self.operation = operation
        self.key = key


class ListingError(StoreError):
    """A LIST answer that cannot be trusted: an empty or unparseable 200, a truncated page without
    a continuation token, a key repeated across pages, or a listing that lacks an object this
    client just wrote (stale or incomplete). Raised after bounded retries; never read as "no
    objects"."""


class SnapshotNotSealedError(StoreError):
    """``S3TokenStore.read_snapshot(sealed=True)`` found no sealed manifest of the rollout's listed
    state: the rollout is open (never frozen), or it changed since its freeze (a late write), or
    its freeze did not finish (fence without manifest). The message says which; ``key`` is the
    manifest key the listed state would have (``snap/<version:020d>-<snapshot_id>``).

    ``state`` is ``"open"`` or ``"changed"``. Freeze the rollout (with write permission), or read
    it unsealed with ``read_snapshot(..., sealed=False)``.
    """

    def __init__(self, message: str, *, state: str, key: str = "") -> None:
        super().__init__(message, operation="LIST", key=key)
        self.state = state


class ExportWorkerDied(RuntimeError):
    """A local-engine worker process of ``s3capture export`` ended abruptly (killed, out of
    memory, a crash): the export stops (exit status 1); the shards published before are durable
    and a re-run resumes from them."""
