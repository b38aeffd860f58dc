"""The verified listing: ``ListedObject`` and ``ListPage``, the check of every LIST answer
(``_verify_page``), the confirmation that a listing reached its end (``ListingMixin``:
``Transport.list``, ``list_page`` and ``confirm_listing_end``), and ``beside_confirmation``, which
overlaps that confirmation with the caller's own requests.

Part of the transport seam: ``s3capture.transport`` re-exports these names, and its ``Transport``
inherits the listing methods from ``ListingMixin``. ``warn_start_after_ignored`` reads
``_IGNORES_START_AFTER`` here: a test that resets it sets it on this module.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from s3capture.errors import ListingError
from s3capture.transport_errors import _backoff

log = logging.getLogger("s3capture")

T = TypeVar("T")


@dataclass(frozen=True)
class ListedObject:
    """One object of a verified listing."""

    key: str
    etag: str
    size: int
    modified: float = 0.0
    """LastModified, seconds since the epoch by the *store's* clock. Informational only: s3capture
    never subtracts it from another machine's clock."""


@dataclass(frozen=True)
class ListPage:
    """One verified ListObjectsV2 page: objects under the prefix, and the continuation token."""

    objects: list[ListedObject]
    next_token: str | None


def _new_token(prefix: str, token: str, tokens: set[str]) -> None:
    """Add a listing's continuation ``token`` to ``tokens``; a token seen before is a paging cycle."""
    if token in tokens:
        raise _Unverified(
            f"LIST {prefix!r} returned continuation token {token[:40]!r} twice (a paging cycle)",
            operation="LIST",
            key=prefix,
        )
    tokens.add(token)


async def cancel_unfinished(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` unless it is done, and wait until it is (its result or error is dropped):
    a request sent beside others is never left running unobserved when they fail. A task that is
    done already is not awaited: this runs in the ``finally`` of async generators too, where a
    needless suspension let a second ``aclose()`` (the loop's at shutdown) find the generator still
    running."""
    if task.done():
        if not task.cancelled():
            task.exception()  # retrieved: never "exception was never retrieved"
        return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def gather_fail_fast(aws: Iterable[Awaitable[T]]) -> list[T]:
    """The results of ``aws`` run concurrently, in their order; on the first error, the others
    are cancelled and waited for (none is left running unobserved), and the error of the first
    awaitable in order that failed is raised. ``asyncio.gather`` either leaves the others running
    (the default) or waits for all of them, each with its own retries (``return_exceptions``): a
    failing store was reported only after every request of the wave had failed (a review,
    2026-12-04). A cancelled caller cancels them all before ``CancelledError`` propagates."""
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        unfinished = [task for task in tasks if not task.done()]
        for task in unfinished:
            task.cancel()
        if unfinished:
            await asyncio.gather(*unfinished, return_exceptions=True)
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]  # not None: checked on the line above
    return [task.result() for task in tasks]


async def gather_settled(aws: Iterable[Awaitable[T]]) -> list[T]:
    """The results of ``aws`` run concurrently, in their order, once every one has finished; if
    any failed, the error of the first in order is raised then (with a note counting the others).
    For waves of writes and deletes: when the call raises, none of its requests is still in flight,
    so nothing it sent can land after its caller saw the error and acted on it. A write is never
    cancelled midway (its outcome would be unknown), as ``gather_fail_fast`` would. Plain
    ``asyncio.gather`` raises at the first error and leaves the rest running: a failed ``delete``
    of several rollouts went on removing the others, and deleted a reused id's acknowledged entry
    (a review, 2026-12-04). A cancelled caller cancels them all and waits for them (``gather``)."""
    results = await asyncio.gather(*aws, return_exceptions=True)
    errors = [result for result in results if isinstance(result, BaseException)]
    if errors:
        if len(errors) > 1:
            errors[0].add_note(f"{len(errors) - 1} more of these {len(results)} requests failed too")
        raise errors[0]
    return results  # type: ignore[return-value]  # no BaseException among them: checked above


async def settle_each(
    items: Sequence[T], fn: Callable[[T], Awaitable[Any]], *, limit: int, what: str, then: str = ""
) -> None:
    """``fn(item)`` for each item, at most ``limit`` at a time. After the first failure no item is
    started; the ones under way finish (a write or delete is never cancelled midway), then the
    error of the first failed item in order is raised, with a note: how many of ``what`` (e.g.
    ``"rollouts"``) failed, naming that item, how many finished and how many were not started, and
    ``then``. When it raises, nothing it started is still running; a store that is down costs one
    wave of failures, not one per item (a review, 2026-12-04: 24 queued DELETEs each went out with
    their retries after the first had failed, 78 s instead of 14 s). A cancelled caller cancels the
    items under way (``gather``) and starts no more."""
    semaphore = asyncio.Semaphore(limit)
    errors: dict[int, BaseException] = {}
    finished = 0

    async def one(index: int, item: T) -> None:
        nonlocal finished
        async with semaphore:
            if errors:
                return
            try:
                await fn(item)
            except BaseException as error:  # noqa: BLE001 - raised below, once the wave has settled
                # Any error, a CancelledError an item raises included (a cancelled caller gets
                # CancelledError from gather whatever the items return).
                errors[index] = error
                return
            finished += 1

    await asyncio.gather(*(one(index, item) for index, item in enumerate(items)))
    if errors:
        first = min(errors)
        error = errors[first]
        skipped = len(items) - finished - len(errors)
        error.add_note(
            f"{len(errors)} of {len(items)} {what} failed (the first in order: {items[first]!r}), {finished} finished, "
            f"{skipped} not started after the failure; none is still running.{' ' + then if then else ''}"
        )
        raise error


async def beside_confirmation(
    confirm: Awaitable[list[ListedObject]],
    listing: list[ListedObject],
    work: Callable[[list[ListedObject]], Awaitable[T]],
) -> T:
    """``work(listing)`` while ``confirm`` (a LIST that confirms the listing's end, e.g.
    ``Transport.confirm_listing_end``; it returns the keys after the listing's last one) runs
    beside it, so the confirmation costs no round trip of its own. Where it shows more keys, the
    answer is ``work(listing + more)``. An error of the first ``work`` is raised only once the
    confirmation found nothing more (it may come from the keys the listing lacked), or failed too;
    an error of ``confirm`` alone is raised as it is. The other request is never left running."""
    confirming = asyncio.ensure_future(confirm)
    try:
        try:
            result = await work(listing)
        except Exception as error:  # noqa: BLE001 - held until the confirmation answers, then raised
            failed: Exception | None = error
        else:
            failed = None
        try:
            more = await confirming
        except Exception as confirm_error:
            if failed is not None:
                raise failed from confirm_error  # the work's own error first
            raise
    finally:
        await cancel_unfinished(confirming)
    if more:
        return await work(listing + more)
    if failed is not None:
        raise failed
    return result


_IGNORES_START_AFTER = False
"""Whether a store answered a LIST with ``StartAfter`` with keys it had listed already (warned
about once): it ignores ``StartAfter``, so confirming where a listing ends lists it again."""


def warn_start_after_ignored(prefix: str, key: str) -> None:
    """Log, once per process, that a LIST after a key showed ``key`` again."""
    global _IGNORES_START_AFTER
    if not _IGNORES_START_AFTER:
        _IGNORES_START_AFTER = True
        log.warning(
            "LIST %r after its last key returned %r, which it had listed already: this store ignores "
            "StartAfter, so each confirmation of a listing's end lists its prefix again",
            prefix,
            key,
        )


class _Unverified(ListingError):
    """One LIST attempt that cannot be trusted; retried by the ``Transport`` before it escapes."""


def _verify_page(page: dict, prefix: str, seen: set[str]) -> ListPage:
    """Check one parsed ListObjectsV2 answer; the only place a listing is trusted.

    - a 200 without ``IsTruncated`` (an empty or unparseable body) is not "no objects": it raises;
    - a truncated page without a continuation token raises;
    - a key repeated across the pages of one listing (``seen``) raises;
    - a key that does not start with ``prefix`` (a server that answers ``Prefix=r1/`` with keys of
      ``r1000/``) is dropped and logged: it is never counted, masked or deleted.
    """
    if "IsTruncated" not in page:
        raise _Unverified(
            f"LIST {prefix!r} answered 200 with an empty or unparseable body", operation="LIST", key=prefix
        )
    objects: list[ListedObject] = []
    for item in page.get("Contents", ()) or ():
        key = item.get("Key")
        if not isinstance(key, str):
            raise _Unverified(f"LIST {prefix!r} returned an object without a key", operation="LIST", key=prefix)
        if not key.startswith(prefix):
            log.warning("LIST %r returned key %r outside the requested prefix; ignored", prefix, key)
            continue
        if key in seen:
            raise _Unverified(f"LIST {prefix!r} returned key {key!r} twice", operation="LIST", key=prefix)
        seen.add(key)
        modified = item.get("LastModified")
        objects.append(
            ListedObject(
                key,
                str(item.get("ETag", "")).strip('"'),
                int(item.get("Size", 0) or 0),
                modified.timestamp() if modified is not None else 0.0,
            )
        )
    token = None
    if page.get("IsTruncated"):
        token = page.get("NextContinuationToken")
        if not token:
            raise _Unverified(
                f"LIST {prefix!r} was truncated without a continuation token", operation="LIST", key=prefix
            )
    return ListPage(objects, token)


class ListingMixin:
    """The listing methods of ``Transport`` (``list_page``, ``list``, ``confirm_listing_end``):
    every page verified (``_verify_page``), a listing that fails verification taken again."""

    if TYPE_CHECKING:  # provided by Transport
        _list_attempts: int
        _warned_more_keys: bool

        async def _call(self, operation: str, key: str, fn: Callable[[Any], Awaitable[T]]) -> T: ...

        async def _send(
            self, operation: str, key: str, request: Callable[[], Awaitable[T]], continuation: str | None = None
        ) -> T: ...

        async def _list_once(
            self, client: Any, prefix: str, max_keys: int, token: str | None, start_after: str | None = None
        ) -> dict: ...

        def _note_date(self, page: dict) -> None: ...

    async def list_page(
        self, prefix: str, max_keys: int = 1000, token: str | None = None, start_after: str | None = None
    ) -> ListPage:
        """One verified ListObjectsV2 page of ``prefix`` (``_verify_page``), after the key
        ``start_after`` when given (ignored with a ``token``); a page that fails verification is
        asked again (``list_attempts`` in all), then raises ``ListingError``."""
        last: ListingError | None = None
        for attempt in range(self._list_attempts):
            if attempt:
                await asyncio.sleep(_backoff(attempt))
            try:
                return await self._list_page_once(prefix, max_keys, token, set(), None if token else start_after)
            except _Unverified as error:
                last = error
        raise ListingError(f"{last} ({self._list_attempts} attempts)", operation="LIST", key=prefix)

    async def _list_page_once(
        self, prefix: str, max_keys: int, token: str | None, seen: set[str], start_after: str | None = None
    ) -> ListPage:
        async def run(client: Any) -> dict:
            return await self._send(
                "ListObjectsV2",
                prefix,
                lambda: self._list_once(client, prefix, max_keys, token, start_after),
                token,
            )

        answer = await self._call("LIST", prefix, run)
        page = _verify_page(answer, prefix, seen)
        self._note_date(answer)
        return page

    async def _rest_of_listing(self, prefix: str, out: builtins.list[ListedObject], seen: set[str]) -> None:
        """Confirm that the listing ``out`` of ``prefix`` reached its end: LIST again after its
        last key (``StartAfter``), and append what that shows, until it shows nothing.

        A page that says "not truncated" ends a listing, and nothing else on the wire tells a
        listing cut short there from a whole one. The keys a cut would hide are the last ones,
        and under a rollout prefix those are its evidence: intents (``log/i/``) and markers
        (``log/x/``) sort after every entry (``log/e/``), and a lost last call leaves no other
        trace. One more request, usually an empty page, closes that (a breaker, 2026-12-02: an
        export wrote a marked rollout as trainable from a freeze whose LIST said it was complete
        before its marker). Keys written while the listing ran show up here too and are kept.
        After ``list_attempts`` rounds that each found more, raises ``_Unverified``.

        A store whose ``StartAfter`` also returns the key it names, or is ignored (the LIST starts
        from the prefix's first key), still confirms: the keys it lists again are passed over, the
        LIST is paged to its end, and every key it shows that the listing lacked is kept (a breaker,
        2026-12-04: such an answer showed the marker a cut listing had hidden, and the marker was
        dropped with the rest of the page). On a store that ignores ``StartAfter`` the confirmation
        is that one whole listing of the prefix again, with no further round: keys written
        anywhere in a live rollout would otherwise count as "more after the end" round after
        round (a second breaker on the fix)."""
        for _ in range(self._list_attempts):
            start = out[-1].key if out else None
            more: builtins.list[ListedObject] = []
            token: str | None = None
            tokens: set[str] = set()
            again: set[str] = set()  # this LIST's own keys: a key twice within it is refused
            ignored = False
            while True:
                page = await self._list_page_once(prefix, 1000, token, again, None if token else start)
                fresh = [item for item in page.objects if item.key not in seen]
                if (
                    not ignored
                    and len(fresh) < len(page.objects)
                    and not (token is None and len(fresh) == len(page.objects) - 1 and page.objects[0].key == start)
                ):
                    # Keys it had listed already (beyond the StartAfter key itself, which an
                    # inclusive StartAfter returns first): the store ignores StartAfter, so this
                    # LIST is the whole prefix again (compared by the store's own listing order,
                    # which SeaweedFS's is, not by bytes).
                    warn_start_after_ignored(prefix, page.objects[0].key)
                    ignored = True
                more.extend(fresh)
                token = page.next_token
                if token is None:
                    break
                _new_token(prefix, token, tokens)
            if ignored:
                out.extend(more)
                seen.update(item.key for item in more)
                return
            if not more:
                return
            # Writes racing a freeze or an export of a live rollout do this every day; a store that
            # cuts listings short does it too, and nothing tells them apart: warn once per client.
            level = logging.INFO if self._warned_more_keys else logging.WARNING
            self._warned_more_keys = True
            log.log(
                level,
                "LIST %r ended at %r, but %d more key(s) follow it (%r...): a listing cut short, or "
                "writes racing it; listing on%s",
                prefix,
                start,
                len(more),
                more[0].key,
                "" if level == logging.INFO else " (later ones on this client are logged at INFO)",
            )
            out.extend(more)
            seen.update(item.key for item in more)
        raise _Unverified(
            f"LIST {prefix!r} kept showing more keys after its end ({self._list_attempts} rounds)",
            operation="LIST",
            key=prefix,
        )

    async def list(
        self,
        prefix: str,
        *,
        require: Iterable[str] = (),
        unless: Iterable[str] = (),
        confirm_end: bool = False,
    ) -> list[ListedObject]:
        """Every object under ``prefix`` (one request per 1,000 keys), verified.

        ``require`` names keys this client has just written under ``prefix``: a listing that lacks
        one of them is stale or incomplete. ``unless`` names keys whose presence settles the
        caller's question without the required ones (a drop whose tombstone a concurrent drop
        deleted after writing the retire tombstone): a listing that shows one of them is returned
        as it is. A listing that fails verification or lacks a required key is taken again from
        the start, with backoff (``list_attempts`` in all), then raises ``ListingError``. Keys
        outside ``prefix`` are never returned. ``confirm_end``: one more
        LIST after the last key must show nothing (``confirm_listing_end``), so a page that says it
        is the last when it is not cannot cut the listing short.
        """
        required = set(require)
        settling = set(unless)
        last: ListingError | None = None
        for attempt in range(self._list_attempts):
            if attempt:
                await asyncio.sleep(_backoff(attempt))
            try:
                out: list[ListedObject] = []
                seen: set[str] = set()
                tokens: set[str] = set()
                token: str | None = None
                while True:
                    page = await self._list_page_once(prefix, 1000, token, seen)
                    out.extend(page.objects)
                    token = page.next_token
                    if token is None:
                        break
                    _new_token(prefix, token, tokens)
                if confirm_end:
                    await self._rest_of_listing(prefix, out, seen)
                missing = required - seen
                if missing and not settling & seen:
                    raise _Unverified(
                        f"LIST {prefix!r} lacks {sorted(missing)[0]!r}, which this client has just written "
                        "(a stale or incomplete listing)",
                        operation="LIST",
                        key=prefix,
                    )
                return out
            except _Unverified as error:
                last = error
                log.warning("%s; listing again", error)
        raise ListingError(f"{last} ({self._list_attempts} attempts)", operation="LIST", key=prefix)

    async def confirm_listing_end(
        self, prefix: str, listing: builtins.list[ListedObject]
    ) -> builtins.list[ListedObject]:
        """The keys of ``prefix`` after the last one of ``listing`` (a whole, verified listing of
        it): empty when ``listing`` reached the end. One LIST with ``StartAfter`` (usually one
        empty page); where it shows more, the listing goes on from there until a LIST shows
        nothing. Retried like ``list``; raises ``ListingError``. For a caller that overlaps the
        confirmation with other requests (``freeze`` with its GETs); ``list(confirm_end=True)``
        does the same in line."""
        last: ListingError | None = None
        for attempt in range(self._list_attempts):
            if attempt:
                await asyncio.sleep(_backoff(attempt))
            out = builtins.list(listing)
            try:
                await self._rest_of_listing(prefix, out, {item.key for item in listing})
                return out[len(listing) :]
            except _Unverified as error:
                last = error
                log.warning("%s; listing again", error)
        raise ListingError(f"{last} ({self._list_attempts} attempts)", operation="LIST", key=prefix)
