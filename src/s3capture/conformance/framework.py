"""The conformance suite's framework: per-check context, fixtures and shared assertions.

``ConformanceError`` (a failed contract), ``_Ctx`` (each check's fresh clients, rollout ids, fixture
entries and commits, and cleanup), ``_Suite`` (the factories and options of one run), ``_Skip`` (a
check that does not apply), and the helpers the checks of every protocol share: ``_expect_error``,
``_check_removal``, ``_has_error``, ``_output``, ``_dump`` and the ``RESOLVED``/``UNRESOLVED``/``ROOT``
statuses.
"""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from s3capture.fingerprint import FINGERPRINT_VERSION, assistant_fingerprint, stamp_continuation
from s3capture.ledger_records import RecordError, to_wire, validate_commit, validate_removal
from s3capture.records import ParentResolutionStatus, TokenEntry, stamp_lineage, to_gym

Factory = Callable[[], Any]
RESOLVED = ParentResolutionStatus.RESOLVED
UNRESOLVED = ParentResolutionStatus.UNRESOLVED
ROOT = ParentResolutionStatus.ROOT


class ConformanceError(AssertionError):
    """One named contract check failed (``check`` names it, ``detail`` says what was observed)."""

    def __init__(self, check: str, detail: str) -> None:
        self.check = check
        self.detail = detail
        super().__init__(f"{check}: {detail}")


# ---------------------------------------------------------------------------------------- fixtures
_REQUEST = [{"role": "user", "content": "What is the weather in Paris?"}]


def _has_error(error: BaseException, name: str) -> bool:
    """Whether ``error`` is (a subclass of) the protocol error ``name``, s3capture's or Gym's."""
    return any(klass.__name__ == name for klass in type(error).__mro__)


def _output(text: str) -> list[dict]:
    return [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]


class _Ctx:
    """Per-check state: fresh clients, rollout ids, and cleanup."""

    def __init__(self, suite: "_Suite", name: str) -> None:
        self.suite = suite
        self.name = name
        self.opened: list[Any] = []
        self.rollouts: list[str] = []
        self.ledger_rollouts: list[str] = []

    def rollout(self, tag: str = "", *, ledger: bool = False) -> str:
        rid = f"{self.suite.prefix}-{self.name.replace('_', '-')}{'-' + tag if tag else ''}-{uuid.uuid4().hex[:10]}"
        (self.ledger_rollouts if ledger else self.rollouts).append(rid)
        return rid

    async def _open(self, factory: Factory | None) -> Any:
        assert factory is not None
        client = factory()
        if inspect.isawaitable(client):
            client = await client
        self.opened.append(client)
        return client

    async def sink(self) -> Any:
        return await self._open(self.suite.sink_factory)

    async def source(self) -> Any:
        return await self._open(self.suite.source_factory)

    async def resolver(self) -> Any:
        return await self._open(self.suite.resolver_factory)

    async def ledger(self) -> Any:
        return await self._open(self.suite.ledger_factory)

    def require(self, condition: bool, detail: str) -> None:
        if not condition:
            raise ConformanceError(self.name, detail)

    def entry(
        self,
        rollout_id: str,
        call_id: str,
        *,
        prompt: list[int],
        generation: list[int],
        request: list[dict] | None = None,
        text: str = "a",
    ) -> Any:
        """A committed ROOT entry with the lookup metadata ``capture_tokens`` records."""
        entry = TokenEntry(
            rollout_id=rollout_id,
            model_call_id=call_id,
            model="conformance-model",
            prompt_token_ids=list(prompt),
            generation_token_ids=list(generation),
            generation_log_probs=[-0.1] * len(generation),
            output_items=_output(text),
            token_item_index=0,
            created_at=1700000000.0,  # fixed, so a retry resends byte-identical payloads
        )
        stamp_continuation(entry, list(request if request is not None else _REQUEST))
        stamp_lineage(entry, None, parent_resolution=ROOT)
        return to_gym(entry) if self.suite.entry_type == "gym" else entry

    def commit(
        self,
        rollout_id: str,
        call_id: str,
        *,
        text: str = "a",
        request: list[dict] | None = None,
        delta: int = 3,
        weight_version: int = 0,
    ) -> Any:
        """A valid root ``CaptureLedgerCommit`` whose digests are distinct per payload.

        Its record carries the fingerprints Gym's capture stamps (``external_capture``): a ledger
        may, like Gym's ``FileLineageStore``, resolve only rows of the current fingerprint version.
        """
        seed = f"{rollout_id}/{call_id}/{text}/{delta}/{weight_version}"
        request_items = list(request if request is not None else _REQUEST)

        def hexdigest(tag: str) -> str:
            import hashlib

            return hashlib.sha256(f"{tag}:{seed}".encode()).hexdigest()

        wire = {
            "rollout_id": rollout_id,
            "record": {
                "model_call_id": call_id,
                "parent_call_id": None,
                "prev_len": 0,
                "delta_len": delta,
                "cum_len": delta,
                "weight_version": weight_version,
                "digest": hexdigest("digest"),
                "extras_digest": hexdigest("extras"),
                "staging_key": f"{rollout_id}/{call_id}",
                "mode": "text",
                "chain_hash": hexdigest("chain"),
                "cumulative_hash": hexdigest("cumulative"),
                "response_id": f"resp-{call_id}",
                "admitted_at": 1700000000.0,
                "output_fingerprint": assistant_fingerprint(_output(text)) or None,
                "continuation_fingerprint": assistant_fingerprint(request_items + _output(text)) or None,
                "fingerprint_version": FINGERPRINT_VERSION,
            },
            "staging_chain": [f"{rollout_id}/{call_id}"],
            "request_items": request_items,
            "response_items": _output(text),
        }
        commit = validate_commit(wire)
        if self.suite.entry_type == "gym":
            from nemo_gym.token_id_capture.staging.records import CaptureLedgerCommit

            return CaptureLedgerCommit.model_validate(to_wire(commit))
        return commit

    async def close(self) -> None:
        for client in reversed(self.opened):
            try:
                result = client.close()
                if inspect.isawaitable(result):
                    await result
            except Exception:  # noqa: BLE001 - closing is best effort
                pass


def _dump(entry: Any) -> Any:
    return entry.model_dump(mode="json")


async def _expect_error(ctx: _Ctx, awaitable: Awaitable[Any], names: Sequence[str], what: str) -> BaseException | None:
    """Await; return the raised error when it is one of ``names``; fail the check otherwise."""
    try:
        await awaitable
    except Exception as error:
        if any(_has_error(error, name) for name in names):
            return error
        raise ConformanceError(
            ctx.name, f"{what} raised {type(error).__name__}: {error}; expected {' or '.join(names)}"
        ) from error
    return None


def _check_removal(ctx: _Ctx, removal: Any, *, removed: list[str], absent: list[str]) -> None:
    try:
        validate_removal(dict(removal))
    except (RecordError, TypeError, ValueError) as error:
        raise ConformanceError(ctx.name, f"retire/delete returned {removal!r}, not a RolloutRemoval: {error}") from None
    ctx.require(
        sorted(removal["removed"]) == sorted(removed) and sorted(removal["absent"]) == sorted(absent),
        f"expected removed={removed} absent={absent}, got {dict(removal)}",
    )


class _Skip(Exception):
    pass


@dataclass
class _Suite:
    sink_factory: Factory | None
    source_factory: Factory | None
    resolver_factory: Factory | None
    ledger_factory: Factory | None
    prefix: str
    entry_type: str
