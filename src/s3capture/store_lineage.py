"""``S3TokenStore``'s ``LineageResolver``: ``resolve`` and Gym's rule for interchangeable parents.

A delta parent's tokens are rebuilt by ``_StoreCore._cumulative`` (``s3capture.store_core``).
``_StoreLineage`` is a private mixin of ``s3capture.store.S3TokenStore``.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from typing import Any

from s3capture import fingerprint as _fp
from s3capture.cache import Stored as _Stored
from s3capture.layout import escape_id, parse_log_key
from s3capture.protocols import LineageMatch, LineageResolution
from s3capture.records import ParentResolutionStatus, RecordError, TokenEntry, compute_digest, cumulative_tokens
from s3capture.store_core import _StoreCore


def request_fingerprint(request_items: list) -> str | LineageResolution:
    """The assistant fingerprint a continuation request is looked up by
    (``fingerprint.assistant_fingerprint`` of its items), or the answer that ends a resolve before
    any request: ROOT for a request with no assistant turn, UNRESOLVED ``malformed_request`` for
    items that cannot be fingerprinted (never an error). Shared by ``S3TokenStore.resolve`` and
    ``S3CaptureLedger.resolve``."""
    try:
        fingerprint = _fp.assistant_fingerprint(request_items)
    except Exception as error:  # noqa: BLE001 - any malformed request is UNRESOLVED, never a crash
        return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason=f"malformed_request: {error}")
    return fingerprint or LineageResolution(ParentResolutionStatus.ROOT)


def _interchangeable(entries: Sequence[TokenEntry]) -> bool:
    """Whether several candidates for one request are one parent: Gym's rule (``lineage.py``,
    ``resolve_node``), equal non-empty ``digest`` and equal ``cum_len``, a missing ``cum_len``
    counted as the entry's token count as Gym's ``add_entry`` does; and, stricter than Gym, every
    full-prompt candidate's tokens hash to that digest (one whose tokens do not is damage, and
    the request may continue its tokens: never guess). Delta candidates are checked once one of
    them wins (``digest_mismatch``)."""
    shapes = {
        (entry.digest, entry.cum_len if entry.cum_len is not None else _cumulative_len(entry)) for entry in entries
    }
    if len(shapes) != 1 or not entries[0].digest:
        return False
    return all(entry.prompt_is_delta or compute_digest(cumulative_tokens(entry)) == entry.digest for entry in entries)


def _cumulative_len(entry: TokenEntry) -> int:
    """``len(prompt_token_ids) + len(generation_token_ids)``: what Gym counts for a missing ``cum_len``."""
    return len(entry.prompt_token_ids) + len(entry.generation_token_ids)


def _to_gym_resolution(answer: LineageResolution) -> Any:
    """``answer`` as NeMo Gym's ``LineageResolution`` (field for field; requires ``nemo_gym``)."""
    from nemo_gym.token_id_capture import protocols as gym
    from nemo_gym.token_id_capture.records import ParentResolutionStatus as GymStatus

    match = answer.match
    return gym.LineageResolution(
        GymStatus(ParentResolutionStatus(answer.status).value),
        None
        if match is None
        else gym.LineageMatch(
            model_call_id=match.model_call_id,
            cumulative_token_ids=match.cumulative_token_ids,
            digest=match.digest,
            staging_chain=match.staging_chain,
            prev_len=match.prev_len,
            chain_hash=match.chain_hash,
        ),
        answer.reason,
    )


class _StoreLineage(_StoreCore):
    """``resolve`` of ``S3TokenStore`` (private mixin)."""

    # ------------------------------------------------------------------ LineageResolver
    async def resolve(self, rollout_id: str, request_items: list[dict]) -> LineageResolution:
        """Return ROOT, RESOLVED (exactly one proven parent) or UNRESOLVED with a reason.

        On a store built with ``entry_type="gym"`` the answer is NeMo Gym's own
        ``LineageResolution`` (Gym's ``ParentResolutionStatus`` and ``LineageMatch``, same values),
        the types Gym's capture path stamps onto its pydantic entries: s3capture's enum there made
        every later ``model_dump`` of such an entry warn (a Gym-integration breaker, 2026-12-03).

        Requests: one LIST of the request fingerprint's prefix and GETs of the candidates not yet
        cached (two round trips), plus, for a delta winner whose tokens are not memoized, one
        parallel round trip: its own checkpoint, or its nearest checkpoint and the entries after it
        (more only where a checkpoint is missing or fails its digest). A call id
        with more than one payload under the fingerprint counts as zero candidates; candidates
        must match the recorded request context (``conversation_digest`` of the leading items);
        several candidates count as one only when their cumulative tokens are identical.

        ``request_items``: the continuation request's input items (Responses-API dicts), in order.
        Returns a ``LineageResolution``: ROOT (no assistant turn in the request); RESOLVED with a
        ``LineageMatch`` (``model_call_id``, the parent's ``cumulative_token_ids``, its ``digest``,
        ``prev_len`` = their count); or UNRESOLVED with a ``reason`` (``docs/reasons.md``,
        "Unresolved lineage reasons"). Malformed request items give UNRESOLVED, never an error.

        Raises:
            ValueError: an unstorable ``rollout_id`` (before any request).
            StoreError: the store failed the LIST or a GET.
        """
        answer = await self._resolve(rollout_id, request_items)
        return _to_gym_resolution(answer) if self.entry_type == "gym" else answer

    async def _resolve(self, rollout_id: str, request_items: list[dict]) -> LineageResolution:
        prefix = self.layout.rollout(rollout_id)
        fingerprint = request_fingerprint(request_items)
        if isinstance(fingerprint, LineageResolution):
            return fingerprint
        listing = await self._list(f"{prefix}log/e/{escape_id(fingerprint)}/")
        by_call: dict[str, list[str]] = collections.defaultdict(list)
        sizes: dict[str, int] = {}
        for item in listing:
            parsed = parse_log_key(item.key[len(prefix) :])
            if parsed is not None and parsed[0] == "e" and parsed[2] == fingerprint:
                by_call[parsed[1]].append(item.key)
                sizes[item.key] = item.size
        if not by_call:
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="no_match")
        conflicted = sorted(cid for cid, keys in by_call.items() if len(keys) > 1)
        if conflicted:
            # A call id with several payloads is zero candidates, and it must not let another call
            # with the same model output win by elimination either: that would be a guess.
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="conflicting_payloads")
        singles = [keys[0] for cid, keys in by_call.items() if len(keys) == 1]

        async def load(key: str) -> _Stored | None:
            try:
                return await self._load(key, key.rsplit("/", 1)[-1][:-4], sizes.get(key))
            except RecordError:
                return None

        # The common single candidate is loaded in this task (no task and gathering future for it).
        loaded = [await load(singles[0])] if len(singles) == 1 else await asyncio.gather(*(load(k) for k in singles))
        if any(stored is None for stored in loaded):
            # An unreadable or vanished candidate might be the parent: never win by elimination.
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="unreadable_candidate")
        candidates: list[tuple[str, _Stored]] = []
        for key, stored in zip(singles, loaded):
            assert stored is not None
            entry = stored.entry
            if entry.rollout_id != rollout_id or entry.continuation_fingerprint != fingerprint:
                continue
            if entry.fingerprint_version is not None and entry.fingerprint_version != _fp.FINGERPRINT_VERSION:
                continue
            if not entry.continuation_context_digest or len(request_items) < entry.continuation_context_len:
                continue
            try:
                context = _fp.conversation_digest(request_items[: entry.continuation_context_len])
            except Exception as error:  # noqa: BLE001 - malformed request items: UNRESOLVED
                return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason=f"malformed_request: {error}")
            if context != entry.continuation_context_digest:
                continue
            self._remember(rollout_id, entry.model_call_id, key[len(prefix) :])
            candidates.append((key, stored))
        if len(candidates) > 1 and _interchangeable([stored.entry for _, stored in candidates]):
            candidates = [min(candidates, key=lambda c: c[1].entry.model_call_id)]
        if len(candidates) != 1:
            reason = "ambiguous" if candidates else "no_match"
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason=reason)
        key, stored = candidates[0]
        if stored.entry.prompt_is_delta and not stored.entry.digest:
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="unverifiable_parent")
        try:
            tokens = await self._cumulative(prefix, key, stored)
            digest = compute_digest(tokens)
        except (RecordError, ValueError) as error:
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason=f"unreadable_parent: {error}")
        entry = stored.entry
        if entry.digest and digest != entry.digest:
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="digest_mismatch")
        return LineageResolution(
            ParentResolutionStatus.RESOLVED,
            match=LineageMatch(
                model_call_id=entry.model_call_id,
                cumulative_token_ids=tuple(tokens),
                digest=digest,
                prev_len=len(tokens),
            ),
        )
