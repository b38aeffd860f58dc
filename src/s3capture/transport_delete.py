"""Delete with fallback: ``Transport.delete`` and ``delete_one`` (``DeleteMixin``), DeleteObjects
in batches of 1,000 with Content-MD5, or one DELETE per key where a store does not implement it or
refuses the batch.

Part of the transport seam: ``s3capture.transport``'s ``Transport`` inherits these methods.
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from s3capture.clocks import awake_clock
from s3capture.errors import StoreError
from s3capture.transport_errors import _NOT_FOUND, RETRY_CODES
from s3capture.transport_listing import settle_each

log = logging.getLogger("s3capture")

T = TypeVar("T")

BULK_DENIED_SECONDS = 600.0
"""Seconds a transport sends single DELETEs after a DeleteObjects refused with AccessDenied whose
single DELETEs were allowed, before it tries DeleteObjects again."""
_BULK_UNSUPPORTED = frozenset({"NotImplemented", "MethodNotAllowed", "501", "405"})
"""Answers to DeleteObjects that mean the store has none: remembered (``Transport.delete``). The
rest of ``_NOT_IMPLEMENTED`` (a digest or body the store refuses, a bare 400) sends that batch as
single DELETEs and tries DeleteObjects again next time; ``AccessDenied`` for
``BULK_DENIED_SECONDS`` once the single DELETEs of its batch succeeded."""


class DeleteMixin:
    """The delete methods of ``Transport`` (``delete``, ``delete_one``)."""

    if TYPE_CHECKING:  # provided by Transport
        bucket: str
        _max_concurrency: int
        _bulk_delete: bool
        _bulk_denied_until: float
        _bulk_denied_said: bool

        async def _call(self, operation: str, key: str, fn: Callable[[Any], Awaitable[T]]) -> T: ...

        async def _send(
            self, operation: str, key: str, request: Callable[[], Awaitable[T]], continuation: str | None = None
        ) -> T: ...

        async def _delete_batch_once(self, client: Any, keys: list[str]) -> tuple[list[dict], set[str]] | str: ...

        async def _delete_one_once(self, client: Any, key: str) -> None: ...

    async def delete(self, keys: builtins.list[str]) -> None:  # `list` is also a Transport method (ListingMixin)
        """Delete ``keys`` with DeleteObjects in batches of 1,000, or one DELETE each where the store
        does not implement it (remembered: after a NotImplemented or MethodNotAllowed answer this
        transport sends single DELETEs only; a batch the store refuses otherwise, e.g. 400
        MalformedXML, goes out as single DELETEs this once). A batch refused with AccessDenied goes
        out as single DELETEs, one key first: refused too, that key's ``StoreError`` is raised and
        no other key is sent; allowed (the Ceph gateway authorizes DeleteObjects against the
        bucket's ARN, single DELETEs against each key's), the rest follow and this transport sends
        single DELETEs for ``BULK_DENIED_SECONDS`` before it tries DeleteObjects again (credentials
        or a policy may change). A key the answer neither confirms
        deleted nor reports failed (an answer that is not a DeleteObjects result, such as an empty
        or HTML 200 body from a proxy, or one cut short) is deleted again with a single DELETE, whose answer is
        unambiguous, as is a key the answer reports failed with a code of ``RETRY_CODES``
        (the client retries that DELETE). Missing keys are not an error. Raises ``StoreError``."""
        for start in range(0, len(keys), 1000):
            batch = keys[start : start + 1000]
            if not self._bulk_delete or awake_clock() < self._bulk_denied_until:
                await settle_each(batch, self.delete_one, limit=self._max_concurrency, what="keys")
                continue

            async def run(client: Any, batch: list[str] = batch) -> builtins.list[str] | str:
                answer = await self._send("DeleteObjects", batch[0], lambda: self._delete_batch_once(client, batch))
                if isinstance(answer, str):
                    return answer  # the store's code: fall back to single DELETEs
                reported, confirmed = answer
                # A per-key error the store may not repeat (InternalError, SlowDown, ...) is left
                # to a single DELETE of that key, which the client retries; others fail at once.
                reported = [e for e in reported if e.get("Code") not in RETRY_CODES]
                errors = [e for e in reported if e.get("Code") not in _NOT_FOUND]
                if errors:
                    raise StoreError(
                        f"DeleteObjects failed for {len(errors)} keys, first: {errors[0]}",
                        operation="DeleteObjects",
                        key=errors[0].get("Key", ""),
                    )
                # Absent (NoSuchKey) counts as done; a key the answer does not name at all does not.
                confirmed.update(e.get("Key", "") for e in reported)
                return [k for k in batch if k not in confirmed]

            outcome = await self._call("DeleteObjects", batch[0], run)
            if isinstance(outcome, str):
                if outcome in _BULK_UNSUPPORTED:
                    if self._bulk_delete:
                        log.warning(
                            "s3://%s: the store does not implement DeleteObjects (%s); this client sends one "
                            "DELETE per key from now on",
                            self.bucket,
                            outcome,
                        )
                    self._bulk_delete = False
                if outcome == "AccessDenied":
                    # One key first: refused too, its StoreError, and no other key is sent (a role
                    # without any delete right would otherwise send a DELETE per key to fail).
                    await self.delete_one(batch[0])
                    await settle_each(batch[1:], self.delete_one, limit=self._max_concurrency, what="keys")
                    if not self._bulk_denied_said:
                        self._bulk_denied_said = True
                        log.warning(
                            "s3://%s: DeleteObjects was refused (AccessDenied) but the DELETE of each key was "
                            "allowed (the Ceph gateway checks a DeleteObjects request against the bucket's ARN: "
                            "docs/permissions.md); this client sends one DELETE per key, and tries DeleteObjects "
                            "again every %.0f minutes",
                            self.bucket,
                            BULK_DENIED_SECONDS / 60,
                        )
                    self._bulk_denied_until = awake_clock() + BULK_DENIED_SECONDS
                    continue
                outcome = batch
            elif outcome:
                log.warning(
                    "s3://%s: a DeleteObjects answer confirmed %d of %d keys; deleting the other %d one by one",
                    self.bucket,
                    len(batch) - len(outcome),
                    len(batch),
                    len(outcome),
                )
            await settle_each(outcome, self.delete_one, limit=self._max_concurrency, what="keys")

    async def delete_one(self, key: str) -> None:
        """DELETE one key (missing is not an error). Raises ``StoreError``."""

        async def run(client: Any) -> None:
            await self._send("DeleteObject", key, lambda: self._delete_one_once(client, key))

        await self._call("DELETE", key, run)
