"""Model-based state machines of ``S3TokenStore`` and ``S3CaptureLedger`` against a real S3 server.

Shared by ``tests/test_model.py`` (a small fixed budget in CI) and ``tools/chaos.py`` (long runs).
``docs/reliability.md`` states the invariants and how to run both.

Each hypothesis example is one run of a machine: a fresh bucket on the server, one event loop,
three clients of one class on that bucket, each through its own ``FaultProxy`` (client 0's never
injects a fault; the faults of clients 1 and 2 are switched on and off by rules). Rules issue
the protocol's operations on two rollouts, sometimes two at once (a race, with small start
delays), and a model tracks what each operation's outcome promises:

* an operation that returned is *acknowledged*; one that raised is not, but may have landed (a
  lost response applies the request, then drops the answer);
* time is this process's ``time.monotonic()``; "acknowledged before X" means the operation
  returned before X was called, so every request of it was answered before X sent its first.

After every operation the machine checks the invariants of ``docs/reliability.md``; a violated
one raises ``Violation`` (an ``AssertionError``: hypothesis then shrinks the run to a minimal one).
Every check, operation and fault is counted in ``Stats`` (printed by ``tools/chaos.py``).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import html
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from helpers import assistant_output, build_conversation, canonical, make_commit, make_entry, user

try:  # the extended proxy (branch h-faults), when merged
    from faultproxy import (  # type: ignore[import-not-found]
        ApplyLate,
        DropResponse,
        FaultProxy,
        ListCutShort,
        ListHideYoung,
        Respond,
    )
except ImportError:  # the proxy of the adversarial tests
    from test_adversarial_faultproxy import ApplyLate, DropResponse, FaultProxy, ListCutShort, ListHideYoung, Respond

from s3capture.errors import StoreError
from s3capture.protocols import RolloutRetiredError, TokenCaptureFrozenError, TokenCaptureRetiredError
from s3capture.records import ParentResolutionStatus, RecordError

__all__ = ["Stats", "Violation", "ci_settings", "store_machine", "ledger_machine", "GRACE"]

GRACE = 0.2
"""``fence_grace`` of every client (they must agree); drop waits GRACE + 0.1 s after a freeze."""
ROLLOUTS = ("r0", "r1")
TURNS = 3
CLIENTS = 3
ALL_FAULT_KINDS = ("503", "lost", "transient503", "transientlost", "slow", "late", "cut", "lag")
FAULT_KINDS = tuple(kind for kind in os.environ.get("S3CAPTURE_MODEL_FAULTS", "").split(",") if kind) or ALL_FAULT_KINDS
"""The kinds the ``fault`` rule draws from (``S3CAPTURE_MODEL_FAULTS``, comma-separated, narrows
them for a long run aimed at one kind; ``tools/chaos.py --faults``)."""
if set(FAULT_KINDS) - set(ALL_FAULT_KINDS):
    raise ValueError(f"S3CAPTURE_MODEL_FAULTS: unknown kinds {sorted(set(FAULT_KINDS) - set(ALL_FAULT_KINDS))}")
FAULT_SCOPES = ("PUT", "GET", "LIST", "DELETE", "ALL")
RACE_DELAYS = (0.0, 0.0, 0.05, 0.15, 0.3, 0.35, 0.45)
SLOW = 0.3
"""Seconds the ``slow`` fault holds a request before forwarding it (it widens race windows)."""
RETRY_WINDOW = 5.0
"""Seconds within which a request repeated by a client without botocore's attempt header (the
obstore transport) counts as a retry of the earlier one (``FaultSwitch._first_attempt``)."""
LATE = 0.6
"""Seconds after which the ``late`` fault applies a request whose client already gave up on it
(longer than a drop's wait, so a late fence PUT can land inside another operation's window)."""
CUT_KEYS = 2
"""Keys the ``cut`` fault leaves in a listing it cuts short."""
LAG_MS = 300
"""Milliseconds for which the ``lag`` fault leaves a key out of a listing after its first PUT was
acknowledged (a PUT through either client's proxy: the proxies share one record of PUT times)."""
_UNCONFIRMED_LISTINGS = ("/log/e/", "/ledger-index/", "/ledger/row/")
CANCEL_AFTER = (0.0, 0.002, 0.005, 0.01, 0.02, 0.05, 0.15)
"""Seconds after which the ``cancelled`` rules cancel an operation's task (0: before it starts)."""
SETTLE = SLOW + LATE + 0.4
QUIESCE = 30.0
"""Seconds a ``delete`` waits for requests still in flight under the ids it removes (``quiesce``)."""
PROBED_CLIENT = 2
"""The client each machine builds with ``probe_listing=True`` (the others without)."""
"""Seconds within which a request of a cancelled operation may still be applied (the connection is
closed, but the server or a proxy holding the request can still apply it): a cancelled operation
counts as a write until then, and after a cancelled removal the machine waits this long before the
id is used again (a removal's request landing after the id is reused is outside the contract:
docs/design.md, race 8)."""
_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>injected by the model test</Message><RequestId>fault</RequestId></Error>"
)


def ci_settings(**overrides: Any) -> settings:
    """The fixed, small CI budget (about 10-40 s per machine and server)."""
    values: dict[str, Any] = dict(
        max_examples=10,
        stateful_step_count=15,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    if os.environ.get("S3CAPTURE_MODEL_NO_SHRINK"):  # report the first failing run as it is (faster)
        values["phases"] = [Phase.explicit, Phase.reuse, Phase.generate]
    values.update(overrides)
    return settings(**values)


class Violation(AssertionError):
    """An invariant of docs/reliability.md does not hold."""


class CallerCancelled(Exception):
    """The outcome of an operation whose caller cancelled its task (``task.cancel()``, as
    ``asyncio.timeout`` does) before it returned: not acknowledged, but it may have landed, or may
    still land within ``SETTLE`` seconds."""


@dataclass
class Stats:
    """What the machines did: operations by outcome, faults injected, invariant checks made."""

    ops: collections.Counter = field(default_factory=collections.Counter)
    faults: collections.Counter = field(default_factory=collections.Counter)
    checks: collections.Counter = field(default_factory=collections.Counter)
    violations: list[str] = field(default_factory=list)
    runs: int = 0
    steps: int = 0
    log: Callable[[str], None] | None = None

    def say(self, text: str) -> None:
        if self.log is not None:
            self.log(text)

    def check(self, ok: bool, name: str, message: Callable[[], str] | str) -> None:
        self.checks[name] += 1
        if not ok:
            text = f"{name}: {message() if callable(message) else message}"
            self.violations.append(text)
            self.say(f"    VIOLATION {text}")
            raise Violation(text)


def _pick(data: st.DataObject, choices: list[str]) -> str:
    """One of ``choices`` (one or two rollouts), drawn the same way whatever their number: which
    rollouts qualify depends on how earlier operations ended (a fault, a cancellation landing
    before or after the operation finished), and hypothesis refuses a run whose draws change shape
    with such outside state (``FlakyStrategyDefinition``)."""
    return choices[data.draw(st.integers(0, len(ROLLOUTS) - 1)) % len(choices)]


# --------------------------------------------------------------------------- faults
def _op_of(request: Any) -> str:
    method, query = request.method, request.query
    if method == "GET" and "list-type" in query:
        return "LIST"
    if method in ("GET", "HEAD"):
        return "GET"
    if method == "DELETE" or (method == "POST" and "delete" in query):
        return "DELETE"
    return method


class FaultSwitch:
    """The rule of one client's proxy: off, or a fault kind on one S3 operation class.

    ``503``: answer 503 SlowDown without forwarding (not applied), on every attempt;
    ``lost``: forward, let the server apply it, then close the connection without an answer;
    ``transient503`` / ``transientlost``: the same on a request's first attempt only
    (``_first_attempt``), so the transport's retry succeeds;
    ``cut``: answer a LIST with its first ``CUT_KEYS`` keys as the whole listing (``IsTruncated``
    false): a listing cut short. Not on the listings whose end nothing confirms (``resolve``'s
    candidates and a ledger's row and index listings, which a cut reads as "fewer candidates":
    design.md's caveat of a LIST that skips a key) and not on a continuation or a LIST after a key;
    ``slow``: hold the request ``SLOW`` seconds, then forward it (applied late; this widens the
    windows between an operation's requests, e.g. drop's retired fence and its decisive LIST);
    ``late``: on a request's first attempt, close the client's connection at once (so it retries
    and moves on) and apply the request ``LATE`` seconds later, after its retry: a delayed
    duplicate, such as a freeze's fence PUT landing inside a later drop (not on DELETEs, see
    ``__call__``);
    ``lag``: answer every LIST without the keys whose PUT was acknowledged less than ``LAG_MS``
    ago (a listing that lags writes, on every listing, resolve's and the ledger's included).
    """

    def __init__(self, stats: Stats, name: str, created: _CreationTimes | None = None) -> None:
        self.stats = stats
        self.name = name
        self.created = created
        self.kind: str | None = None
        self.scope = "ALL"
        self._recent: dict[tuple[str, str, str], float] = {}

    def _first_attempt(self, request: Any) -> bool:
        """Whether ``request`` is a first attempt: botocore says so (``amz-sdk-request:
        attempt=N``); the obstore transport sends no such header, so there a request is a retry
        when the same method, path and query came within ``RETRY_WINDOW`` seconds (without this,
        every obstore attempt was "first": the transient faults never let a retry through)."""
        header = request.headers.get("amz-sdk-request", "")
        if header:
            return header.split(";")[0].strip() == "attempt=1"
        now = time.monotonic()
        key = (request.method, request.path, request.query)
        last = self._recent.get(key)
        self._recent[key] = now
        if len(self._recent) > 4096:
            self._recent = {k: t for k, t in self._recent.items() if now - t < RETRY_WINDOW}
        return last is None or now - last >= RETRY_WINDOW

    async def __call__(self, request: Any) -> Any:
        action = await self._action(request)
        if self.created is not None and not isinstance(action, Respond) and _op_of(request) == "DELETE":
            self.created.forwarded(request)  # applied (or, with ``lost``, applied unanswered)
        return action

    async def _action(self, request: Any) -> Any:
        kind = self.kind
        if kind is None:
            return None
        op = _op_of(request)
        if self.scope != "ALL" and op != self.scope:
            return None
        if kind == "late" and op == "DELETE":
            # A delete's request applied after the rollout id was deleted and written again removes
            # the new attempt's objects: outside the contract (ids are reused only once nothing of
            # the old attempt, its delete's requests included, can still land; docs/design.md,
            # race 8), and the machines reuse ids after `remove`. DELETEs get every other fault.
            return None
        if kind == "lag":
            if op != "LIST":
                return None
            self.stats.faults[f"{kind}:{op}"] += 1
            return ListHideYoung(LAG_MS)
        if kind == "cut":
            params = request.params
            prefix = params.get("prefix", "")
            if (
                op != "LIST"
                or "start-after" in params
                or "continuation-token" in params
                or any(part in prefix for part in _UNCONFIRMED_LISTINGS)
            ):
                return None
            self.stats.faults[f"{kind}:{op}"] += 1
            return ListCutShort(CUT_KEYS)
        if (kind.startswith("transient") or kind == "late") and not self._first_attempt(request):
            return None
        self.stats.faults[f"{kind}:{op}"] += 1
        if kind == "slow":
            await asyncio.sleep(SLOW)
            return None
        if kind.endswith("503"):
            return Respond(503, _SLOWDOWN, reason="Slow Down")
        if kind == "late":
            return ApplyLate(LATE)
        return DropResponse()


class _CreationTimes(dict):
    """The proxies' record of when each key was created, for the ``lag`` fault (``put_times`` of
    every proxy): a store whose listings lag leaves a key out for a while after it is *created*,
    not after an existing one is written again (an identical retry of a ledger row rewrote its key,
    and the row vanished from the listing), and again after it was deleted and created anew (a
    rollout id reused after ``delete``). Every client's requests pass a proxy, so every PUT and
    DELETE of the run is seen."""

    def __setitem__(self, key: str, value: float) -> None:
        if key not in self:
            super().__setitem__(key, value)

    def forwarded(self, request: Any) -> None:
        """Forget the keys a DELETE or DeleteObjects that is about to be applied removes."""
        if request.method == "DELETE":
            self.pop(request.key, None)
        elif request.method == "POST" and "delete" in request.query:
            for found in re.findall(rb"<Key>(.*?)</Key>", request.body or b"", re.S):
                self.pop(html.unescape(found.decode("utf-8", "replace")), None)


# --------------------------------------------------------------------------- common plumbing
@dataclass
class Outcome:
    name: str
    client: int
    start: float
    end: float
    value: Any = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def describe(self) -> str:
        what = f"-> {type(self.error).__name__}: {str(self.error)[:120]}" if self.error else f"-> {_short(self.value)}"
        return f"{self.name} (client {self.client}, {1000 * (self.end - self.start):.0f} ms) {what}"


def _short(value: Any) -> str:
    if value is None:
        return "ok"
    if hasattr(value, "snapshot_id") and hasattr(value, "entries"):
        return (
            f"snapshot v{value.version} {value.snapshot_id[:8]} entries={sorted(e.model_call_id for e in value.entries)} "
            f"incomplete={value.incomplete} {list(getattr(value, 'reasons', ()))[:4]}"
        )
    if hasattr(value, "status"):
        match = getattr(value, "match", None)
        return f"{value.status.name} {getattr(value, 'reason', '')} {match.model_call_id if match else ''}".strip()
    if isinstance(value, dict) and "records" in value:
        return f"records={[r['model_call_id'] for r in value['records']]} failures={[(f['model_call_id'], f['reason']) for f in value['failures']]}"
    return str(value)[:160]


_ALLOWED_ERRORS = (StoreError, CallerCancelled)


class _Machine(RuleBasedStateMachine):
    """Bucket, loop, proxies and clients of one run; subclasses set ``client_class``."""

    server: Any = None
    stats: Stats = Stats()
    client_class: Any = None

    def __init__(self) -> None:
        super().__init__()
        import aioboto3

        from conftest import make_boto3_client
        from s3capture.transport import default_botocore_config

        self.stats.runs += 1
        self.loop = asyncio.new_event_loop()
        if getattr(type(self), "_raw", None) is None:
            type(self)._raw = make_boto3_client(self.server)
            type(self)._session = aioboto3.Session()  # credentials and service model, loaded once
        self.raw = type(self)._raw
        self.bucket = f"s3capture-model-{uuid.uuid4().hex[:16]}"
        self.raw.create_bucket(Bucket=self.bucket)
        self.url = f"s3://{self.bucket}/m"
        self.put_times = _CreationTimes()
        self.switches = [FaultSwitch(self.stats, f"client {i}", self.put_times) for i in range(CLIENTS)]
        self.proxies: list[Any] = []
        session = type(self)._session
        # Two attempts and short timeouts: a fault that stays on fails an operation in about a second.
        config = default_botocore_config(
            32, retries={"mode": "standard", "max_attempts": 2}, connect_timeout=2, read_timeout=10
        )
        self.clients: list[Any] = []
        for i in range(CLIENTS):
            # Client 0's proxy never injects a fault (the ``fault`` rule switches clients 1 and 2):
            # it only shows the ``lag`` fault's record every PUT and DELETE of the run.
            proxy = FaultProxy.for_server(self.server)
            self.loop.run_until_complete(proxy.start())
            proxy.rule = self.switches[i]
            proxy.put_times = self.put_times
            self.proxies.append(proxy)
            endpoint = proxy.endpoint
            self.clients.append(self.make_client(endpoint, session, config))
        self.stats.say(f"run {self.stats.runs}: bucket {self.bucket}")

    def make_client(self, endpoint: str, session: Any, config: Any) -> Any:
        raise NotImplementedError

    def teardown(self) -> None:
        try:
            for client in self.clients:
                try:
                    self.loop.run_until_complete(client.close())
                except Exception:  # noqa: BLE001 - teardown is best effort
                    pass
            for proxy in self.proxies:
                self.loop.run_until_complete(proxy.stop())
        finally:
            self.loop.close()
            from conftest import delete_bucket_quietly

            delete_bucket_quietly(self.raw, self.bucket)

    # ------------------------------------------------------------------ running operations
    async def _timed(
        self, name: str, client: int, fn: Callable[[], Any], delay: float = 0.0, cancel_after: float | None = None
    ) -> Outcome:
        if delay:
            await asyncio.sleep(delay)
        start = time.monotonic()
        try:
            if cancel_after is None:
                value = await fn()
            else:
                value = await self._cancelled_after(fn, cancel_after)
            out = Outcome(name, client, start, time.monotonic(), value)
        except Exception as error:  # noqa: BLE001 - the outcome is judged by the model
            out = Outcome(name, client, start, time.monotonic(), error=error)
        self.stats.ops[f"{name.split('(')[0]}:{'ok' if out.ok else type(out.error).__name__}"] += 1
        return out

    async def _cancelled_after(self, fn: Callable[[], Any], seconds: float) -> Any:
        """Run ``fn()`` as a task and cancel it after ``seconds`` unless it finished: the caller's
        deadline. The cancellation must reach the caller as ``CancelledError`` (``asyncio.timeout``
        and task groups rely on it); an operation that finished first returns or raises as usual."""
        task = asyncio.ensure_future(fn())
        done, _ = await asyncio.wait({task}, timeout=seconds)
        if done:
            return task.result()
        task.cancel()
        try:
            value = await task
        except asyncio.CancelledError:
            raise CallerCancelled(f"cancelled by its caller after {1000 * seconds:.0f} ms") from None
        except Exception as error:
            # Turned into another error: `asyncio.timeout` would surface it instead of TimeoutError.
            self.stats.check(
                False, "cancellation_propagates", f"raised {type(error).__name__}: {error} after task.cancel()"
            )
            raise
        # task.cancel() on a pending task throws CancelledError in at its next step, so a normal
        # return means the operation swallowed its caller's cancellation.
        self.stats.check(False, "cancellation_propagates", f"returned {_short(value)} after task.cancel()")
        return value

    def run(self, name: str, client: int, fn: Callable[[], Any], cancel_after: float | None = None) -> Outcome:
        self.stats.steps += 1
        self.racing = []
        out = self.loop.run_until_complete(self._timed(name, client, fn, cancel_after=cancel_after))
        self.stats.say(
            f"  {out.describe()}"
            + (f" [cancel after {1000 * cancel_after:.0f} ms]" if cancel_after is not None else "")
        )
        return out

    def settle(self) -> None:
        """Wait until every request of a cancelled operation has been applied or dropped."""
        self.loop.run_until_complete(asyncio.sleep(SETTLE))

    def quiesce(self, prefixes: list[str]) -> None:
        """Wait (up to ``QUIESCE`` seconds) until no proxy holds a request naming one of
        ``prefixes``: the precondition of ``delete`` (nothing of the attempt can still write).
        A cancelled operation's request can reach the server and be applied long after its caller
        gave up, beyond ``SETTLE``: SeaweedFS held the first PUT with a body into a new bucket for
        2 s while it grew volumes, and that row landed inside a later delete (chaos seed 103)."""
        deadline = time.monotonic() + QUIESCE
        while any(proxy.in_flight(p) for proxy in self.proxies for p in prefixes):
            if time.monotonic() > deadline:
                self.stats.say(f"  requests under {prefixes} still in flight after {QUIESCE} s; deleting anyway")
                return
            self.loop.run_until_complete(asyncio.sleep(0.01))

    def do(self, op: tuple) -> Outcome:
        """Run one operation tuple ``(name, client, fn, delay, after)`` and judge it with ``after``."""
        out = self.run(op[0], op[1], op[2])
        op[4](out)
        return out

    def race_ops(self, ops: list[tuple]) -> list[Outcome]:
        """Run operation tuples at once; judge them in order of completion, so that time-based
        checks see the state each one ran in."""
        outs = self.run_together([op[:4] for op in ops])
        self.racing = outs  # what ran alongside, for checks that depend on it
        judged = sorted(zip(outs, ops), key=lambda pair: pair[0].end)
        for out, op in judged:
            op[4](out)
        return outs

    def run_together(self, ops: list[tuple[str, int, Callable[[], Any], float]]) -> list[Outcome]:
        self.stats.steps += 1

        async def together() -> list[Outcome]:
            return list(await asyncio.gather(*(self._timed(*op) for op in ops)))

        outs = self.loop.run_until_complete(together())
        self.stats.say("  race: " + " | ".join(o.describe() for o in outs))
        return list(outs)

    def expect_error_types(self, out: Outcome, allowed: tuple[type[BaseException], ...]) -> None:
        """Every failure a caller sees is one of the documented types (never a raw aiohttp error)."""
        if out.error is not None:
            self.stats.check(
                isinstance(out.error, allowed + _ALLOWED_ERRORS),
                "documented_error_type",
                lambda: f"{out.name} raised {type(out.error).__name__}: {out.error}",
            )

    def raw_keys(self, prefix: str) -> list[str]:
        keys: list[str] = []
        for page in self.raw.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            keys.extend(item["Key"] for item in page.get("Contents", []))
        return keys

    # ------------------------------------------------------------------ faults
    @rule(
        client=st.integers(1, CLIENTS - 1),
        kind=st.sampled_from((None, *FAULT_KINDS)),
        scope=st.sampled_from(FAULT_SCOPES),
    )
    def fault(self, client: int, kind: str | None, scope: str) -> None:
        """Switch client ``client``'s proxy to a fault (``kind`` on ``scope``) or off (None)."""
        self.switches[client].kind = kind
        self.switches[client].scope = scope
        self.stats.ops["fault_on" if kind else "fault_off"] += 1
        self.stats.say(f"  fault: client {client} {kind} on {scope}" if kind else f"  fault off: client {client}")

    def faulted(self, client: int) -> bool:
        return self.switches[client].kind is not None

    def lagging(self, client: int) -> bool:
        """Whether ``client``'s listings lag writes (the ``lag`` fault on its LISTs)."""
        switch = self.switches[client]
        return switch.kind == "lag" and switch.scope in ("LIST", "ALL")

    def visible_before(self, out: Outcome) -> float:
        """The time before which a write acknowledged is in every listing ``out``'s client took:
        ``out.start``, or ``LAG_MS`` earlier when its listings lag (the ``lag`` fault)."""
        return out.start - (LAG_MS / 1000 if self.lagging(out.client) else 0.0)


# --------------------------------------------------------------------------- token store model
@dataclass
class _Ack:
    cid: str
    key: str  # sha for puts, "" for intents and markers
    start: float
    end: float


@dataclass
class _Snap:
    snap: Any
    start: float
    end: float
    shas: dict[str, str]  # cid -> sha of the entry handed out
    seen_before: float = 0.0  # writes acknowledged before this are in its listing (``before``)


@dataclass
class _StoreRollout:
    gen: int = 0
    dirty: bool = False
    """A removal failed midway in this or an earlier generation: leftovers may exist."""
    puts: list[_Ack] = field(default_factory=list)  # acknowledged
    landed: dict[str, dict[str, float]] = field(default_factory=lambda: collections.defaultdict(dict))
    """cid -> sha -> when it is known to have landed (acknowledged, or refused as frozen)."""
    attempted: dict[str, set[str]] = field(default_factory=lambda: collections.defaultdict(set))
    intents: list[_Ack] = field(default_factory=list)
    markers: list[_Ack] = field(default_factory=list)
    writes: list[float] = field(default_factory=list)  # start times of every mutating operation
    fenced_at: float | None = None  # a freeze returned (a frozen fence exists unless removed since)
    retired_at: float | None = None  # retire returned or drop returned True
    maybe_removed: bool = False  # a retire, drop or delete raised: state unknown
    snaps: list[_Snap] = field(default_factory=list)
    freezes: list[tuple[float, float]] = field(default_factory=list)  # every freeze call, failed or not
    retire_start: float | None = None  # start of the latest retire that returned or drop that returned True
    broken_freezes: list[float] = field(default_factory=list)
    """End times of freezes that raised an error other than TokenCaptureRetiredError (a fault)."""
    dropped: _Snap | None = None
    drop_end: float = 0.0


class _Variant:
    """One payload for (rollout, turn): variant 0 is the conversation's, 1 the same output with
    other tokens (a conflict under the same fingerprint), 2 another output (another fingerprint)."""

    def __init__(self, rollout: str, turn: int, variant: int, delta: bool) -> None:
        conv = build_conversation(rollout, TURNS)
        t = conv[turn]
        generation = list(t.generation) + ([77] if variant == 1 else [])
        self.output = assistant_output(f"other answer {turn} of {rollout}") if variant == 2 else t.output_items
        parent_cum = conv[turn - 1].cumulative if turn else None
        self.entry = make_entry(
            rollout,
            t.call_id,
            t.request_items,
            self.output,
            t.prompt,
            generation,
            parent_call_id=t.parent_call_id,
            parent_cumulative=parent_cum,
            delta=delta and variant == 0 and turn > 0,
        )
        self.cid = t.call_id
        self.sha = hashlib.sha256(canonical(self.entry)).hexdigest()
        self.cumulative = tuple(t.prompt) + tuple(generation)
        self.digest = self.entry.digest
        self.request = list(t.request_items) + list(self.output) + [user(f"after {turn}")]
        self.output_key = repr(self.output)


class TokenStoreMachine(_Machine):
    """Several ``S3TokenStore`` clients on one bucket, with faults (docs/reliability.md)."""

    def make_client(self, endpoint: str, session: Any, config: Any) -> Any:
        from s3capture.store import S3TokenStore

        probe = len(self.clients) == PROBED_CLIENT  # the clients are made in order: this is client i
        return S3TokenStore(
            self.url,
            endpoint_url=endpoint,
            session=session,
            botocore_config=config,
            fence_grace=GRACE,
            probe_listing=probe,
        )

    def __init__(self) -> None:
        super().__init__()
        self.delta = False
        self.model = {r: _StoreRollout() for r in ROLLOUTS}
        self.variants: dict[tuple[str, int, int], _Variant] = {}
        self.by_sha: dict[str, _Variant] = {}

    @initialize(delta=st.sampled_from((False, False, True)))
    def choose_mode(self, delta: bool) -> None:
        self.delta = delta
        self.stats.say(f"  mode: {'delta' if delta else 'full'} prompts")

    def variant(self, rollout: str, turn: int, v: int) -> _Variant:
        key = (rollout, turn, v)
        if key not in self.variants:
            self.variants[key] = made = _Variant(rollout, turn, v, self.delta)
            self.by_sha[made.sha] = made
        return self.variants[key]

    # ------------------------------------------------------------------ operations (model updates)
    def op_put(self, client: int, rollout: str, var: _Variant, delay: float = 0.0) -> tuple:
        m = self.model[rollout]
        store = self.clients[client]
        m.attempted[var.cid].add(var.sha)

        async def go() -> Any:
            m.writes.append(time.monotonic())
            return await store.put(var.entry)

        return (
            f"put({rollout},{var.cid},{var.sha[:6]})",
            client,
            go,
            delay,
            lambda out: self.after_put(rollout, var, out),
        )

    def after_put(self, rollout: str, var: _Variant, out: Outcome) -> None:
        m = self.model[rollout]
        self.expect_error_types(out, (TokenCaptureFrozenError, RecordError))
        if out.ok:
            m.puts.append(_Ack(var.cid, var.sha, out.start, out.end))
            m.landed[var.cid].setdefault(var.sha, out.end)
        elif isinstance(out.error, TokenCaptureFrozenError) and not isinstance(out.error, TokenCaptureRetiredError):
            m.landed[var.cid].setdefault(var.sha, out.end)  # documented: it landed and moved the version
        self.check_fenced_write(rollout, out)

    def check_fenced_write(self, rollout: str, out: Outcome) -> None:
        """A write that starts after the rollout was retired raises TokenCaptureRetiredError, after a
        freeze TokenCaptureFrozenError (a failing store may also raise StoreError)."""
        m = self.model[rollout]
        if isinstance(out.error, CallerCancelled):
            return  # its caller gave up before it could be refused
        if m.retired_at is not None and m.retired_at < out.start:
            allowed: tuple[type[BaseException], ...] = (TokenCaptureRetiredError, StoreError, RecordError)
            freezes = m.freezes + [
                (o.start, o.end) for o in getattr(self, "racing", []) if o.name == f"freeze({rollout})"
            ]
            if "mark_incomplete" not in out.name and any(a < out.end and b > out.start for a, b in freezes):
                # Documented: a freeze of a retired rollout rewrites its fence as "frozen" until its
                # LIST shows the tombstone; a put or begin_call reading it then is refused as frozen.
                allowed += (TokenCaptureFrozenError,)
            elif "mark_incomplete" not in out.name and any(end > (m.retire_start or 0.0) for end in m.broken_freezes):
                # Documented (docs/reliability.md, Finding 2): a freeze of a retired rollout that a
                # fault interrupted after it PUT the frozen fence, before it restored the retired one,
                # leaves the fence "frozen" until the next retire, drop or delete; a put or
                # begin_call reading it is refused as frozen. Only a freeze that raised since the
                # latest retire (or one overlapping it) can have done that.
                allowed += (TokenCaptureFrozenError,)
            self.stats.check(
                isinstance(out.error, allowed),
                "write_after_retire_raises_retired",
                lambda: f"{out.describe()} after the rollout was retired",
            )
        elif m.fenced_at is not None and m.fenced_at < out.start and "mark_incomplete" not in out.name:
            self.stats.check(
                isinstance(out.error, (TokenCaptureFrozenError, StoreError, RecordError)),
                "write_after_freeze_raises_frozen",
                lambda: f"{out.describe()} after the rollout was frozen",
            )

    def op_begin(self, client: int, rollout: str, turn: int, delay: float = 0.0) -> tuple:
        m = self.model[rollout]
        store = self.clients[client]
        cid = build_conversation(rollout, TURNS)[turn].call_id

        async def go() -> Any:
            m.writes.append(time.monotonic())
            return await store.begin_call(rollout, cid)

        return (f"begin_call({rollout},{cid})", client, go, delay, lambda out: self.after_begin(rollout, out))

    def after_begin(self, rollout: str, out: Outcome) -> None:
        self.expect_error_types(out, (TokenCaptureFrozenError,))
        cid = out.name.split(",")[1].rstrip(")")
        if out.ok:
            self.model[rollout].intents.append(_Ack(cid, "", out.start, out.end))
        self.check_fenced_write(rollout, out)

    def op_mark(self, client: int, rollout: str, turn: int, delay: float = 0.0) -> tuple:
        m = self.model[rollout]
        store = self.clients[client]
        cid = build_conversation(rollout, TURNS)[turn].call_id

        async def go() -> Any:
            m.writes.append(time.monotonic())
            return await store.mark_incomplete(rollout, cid)

        return (f"mark_incomplete({rollout},{cid})", client, go, delay, lambda out: self.after_mark(rollout, out))

    def after_mark(self, rollout: str, out: Outcome) -> None:
        self.expect_error_types(out, (TokenCaptureRetiredError,))
        cid = out.name.split(",")[1].rstrip(")")
        if out.ok:
            self.model[rollout].markers.append(_Ack(cid, "", out.start, out.end))
        self.check_fenced_write(rollout, out)

    def op_freeze(self, client: int, rollout: str, delay: float = 0.0) -> tuple:
        store = self.clients[client]
        return (
            f"freeze({rollout})",
            client,
            lambda: store.freeze(rollout),
            delay,
            lambda out: self.after_freeze(rollout, out),
        )

    def after_freeze(self, rollout: str, out: Outcome) -> None:
        m = self.model[rollout]
        m.freezes.append((out.start, out.end))
        self.expect_error_types(out, (TokenCaptureRetiredError,))
        if not out.ok and not isinstance(out.error, TokenCaptureRetiredError):
            m.broken_freezes.append(out.end)
        if m.retired_at is not None and m.retired_at < out.start:
            self.stats.check(not out.ok, "freeze_after_retire_raises", lambda: out.describe())
        if not out.ok:
            return
        snap = out.value
        shas: dict[str, str] = {}
        for entry in snap.entries:
            sha = hashlib.sha256(canonical(entry)).hexdigest()
            self.stats.check(entry.model_call_id not in shas, "one_entry_per_call", lambda: out.describe())
            self.stats.check(
                sha in self.by_sha and entry.rollout_id == rollout,
                "no_phantom_entries",
                lambda: f"{out.describe()}: entry {entry.model_call_id} {sha[:8]} was never put to {rollout}",
            )
            shas[entry.model_call_id] = sha
        record = _Snap(snap, out.start, out.end, shas)
        # A freeze proves its listing fresh by the fence it writes; through a listing that lags the
        # creation of keys, only a fence that did not exist before does (a re-freeze answers for the
        # state up to the lag earlier; the drop's new tombstone then refuses what it missed:
        # docs/reliability.md, "Listings that lag").
        # Client PROBED_CLIENT's freezes list behind a probe (``probe_listing``): judged against the
        # state at the call, re-freeze or not.
        refreeze = m.dirty or any(start < out.start for start, _ in m.freezes[:-1])  # dirty: a fence may be left
        before = self.visible_before(out) if refreeze and out.client != PROBED_CLIENT else out.start
        record.seen_before = before
        # Every marker acknowledged before the freeze masks it, and is named: a snapshot masked for
        # another reason (a conflict) must not hide a lost marker. Counted when it holds too, so a
        # CI budget that never checks it shows (test_model.py).
        marked = sorted({ack.cid for ack in m.markers if ack.end < before})
        if marked and not m.maybe_removed:  # a removal in doubt may have deleted one (see check_complete_snapshot)
            self.stats.check(
                snap.incomplete and all(f"marked_incomplete:{cid}" in snap.reasons for cid in marked),
                "marker_masks",
                lambda: f"{out.describe()} although {marked} were marked incomplete",
            )
        if not snap.incomplete:
            self.check_complete_snapshot(rollout, record, before, "freeze")
            for entry in snap.entries:
                self.stats.check(
                    entry.parent_call_id is None or entry.parent_call_id in shas,
                    "no_missing_parent_in_trainable",
                    lambda: f"{out.describe()}: {entry.model_call_id}'s parent {entry.parent_call_id} is missing",
                )
        # Idempotent across clients: nothing was written since the previous freeze -> same pair.
        # A re-freeze through a lagging listing sees the writes acknowledged up to the lag before
        # it only (``before``), so both must have seen every write: none since the earlier of the
        # two (chaos seed 114: a lagging client's re-freeze missed a put that a fresh freeze had
        # already taken, both correct).
        previous = [s for s in m.snaps if s.end < out.start]
        if previous and not m.dirty:
            last = previous[-1]
            seen = min(last.start, last.seen_before or last.start, before)
            if seen < last.start:  # ``writes`` holds start times: one acknowledged later may be hidden
                seen -= SETTLE
            if not any(t >= seen for t in m.writes) and not m.maybe_removed:
                self.stats.check(
                    (snap.version, snap.snapshot_id, snap.incomplete)
                    == (last.snap.version, last.snap.snapshot_id, last.snap.incomplete),
                    "freeze_is_idempotent",
                    lambda: f"{out.describe()} after {_short(last.snap)} with no write between",
                )
        m.snaps.append(record)
        m.fenced_at = m.fenced_at or out.end

    def check_complete_snapshot(self, rollout: str, snap: _Snap, before: float, why: str) -> None:
        """``snap`` is trainable: everything acknowledged before ``before`` must be in it."""
        m = self.model[rollout]
        desc = lambda: f"{why}: trainable {_short(snap.snap)}"  # noqa: E731
        for ack in m.puts:
            if ack.end < before:
                self.stats.check(
                    snap.shas.get(ack.cid) == ack.key,
                    "acknowledged_put_in_trainable_snapshot",
                    lambda: f"{desc()} lacks acknowledged put {ack.cid} {ack.key[:8]}",
                )
        for cid, landed in m.landed.items():
            known = [sha for sha, t in landed.items() if t < before]
            self.stats.check(len(known) < 2, "conflict_masks", lambda: f"{desc()} although {cid} has payloads {known}")
        for ack in m.intents:
            if ack.end < before:
                self.stats.check(
                    ack.cid in snap.shas, "dangling_intent_masks", lambda: f"{desc()} lacks intended call {ack.cid}"
                )
        for ack in m.markers:
            if ack.end < before:
                self.stats.check(False, "marker_masks", lambda: f"{desc()} although {ack.cid} was marked incomplete")

    def op_drop(self, client: int, rollout: str, pick: int, delay: float = 0.0) -> tuple:
        m = self.model[rollout]
        store = self.clients[client]
        snap = m.snaps[-1 - pick % len(m.snaps)] if m.snaps else None
        sid, version = (snap.snap.snapshot_id, snap.snap.version) if snap else ("0" * 32, 0)

        async def go() -> Any:
            m.writes.append(time.monotonic())
            return await store.drop(rollout, sid, version)

        return (
            f"drop({rollout},v{version},{sid[:8]})",
            client,
            go,
            delay,
            lambda out: self.after_drop(rollout, snap, out),
        )

    def after_drop(self, rollout: str, snap: _Snap | None, out: Outcome) -> None:
        m = self.model[rollout]
        self.expect_error_types(out, ())
        if not out.ok:
            m.maybe_removed = True
            return
        if out.value is not True:
            return
        self.stats.check(snap is not None, "drop_needs_a_snapshot", lambda: out.describe())
        self.stats.check(
            m.retired_at is None or m.retired_at > out.start, "drop_of_retired_fails", lambda: out.describe()
        )
        assert snap is not None
        for later in m.snaps:
            if later.start > snap.start and later.end < out.start:
                self.stats.check(
                    (later.snap.version, later.snap.snapshot_id) == (snap.snap.version, snap.snap.snapshot_id),
                    "stale_drop_fails",
                    lambda: f"{out.describe()} although a later freeze saw {_short(later.snap)}",
                )
        m.dropped = snap
        m.drop_end = out.end
        m.retired_at = out.end
        m.retire_start = out.start

    @invariant()
    def dropped_snapshot_holds_every_acknowledged_write(self) -> None:
        """A drop returned True of a trainable snapshot: every write acknowledged in this
        generation (before or after it) is in that snapshot, and no marker was acknowledged."""
        for rollout, m in self.model.items():
            if m.dropped is not None and not m.dropped.snap.incomplete:
                self.check_complete_snapshot(rollout, m.dropped, float("inf"), "dropped")

    # ------------------------------------------------------------------ rules
    @rule(
        client=st.integers(0, CLIENTS - 1),
        rollout=st.sampled_from(ROLLOUTS),
        turn=st.integers(0, TURNS - 1),
        v=st.sampled_from((0, 0, 0, 0, 1, 2)),
    )
    def put(self, client: int, rollout: str, turn: int, v: int) -> None:
        var = self.variant(rollout, turn, v)
        self.do(self.op_put(client, rollout, var))

    @precondition(lambda self: any(m.attempted for m in self.model.values()))
    @rule(client=st.integers(0, CLIENTS - 1), data=st.data(), conflict=st.booleans(), other=st.integers(1, 2))
    def put_again(self, client: int, data: st.DataObject, conflict: bool, other: int) -> None:
        """An identical retry of a payload put before, or another payload for its call id."""
        if conflict:
            self.conflicting_put(client, data, other)
        else:
            self.retry_put(client, data)

    @rule(
        client=st.integers(0, CLIENTS - 1),
        rollout=st.sampled_from(ROLLOUTS),
        turn=st.integers(0, TURNS - 1),
        marker=st.sampled_from((False, False, True)),
    )
    def custody(self, client: int, rollout: str, turn: int, marker: bool) -> None:
        """A ``begin_call`` intent, or (less often: it masks the rest of the generation) a marker."""
        if marker:
            self.mark_incomplete(client, rollout, turn)
        else:
            self.begin_call(client, rollout, turn)

    @rule(
        client=st.integers(0, CLIENTS - 1),
        rollout=st.sampled_from(ROLLOUTS),
        delete=st.sampled_from((True, True, False)),
        both=st.sampled_from((False, False, True)),
    )
    def remove(self, client: int, rollout: str, delete: bool, both: bool) -> None:
        """``delete`` (a new generation of the id) or ``retire`` one rollout; with ``both``, a
        ``delete`` of every rollout in one call (a failed delete of several left the others'
        removals running, which then deleted a reused id's acknowledged entry: finding 30)."""
        if delete:
            self.delete(client, rollout, also=tuple(r for r in ROLLOUTS if r != rollout) if both else ())
        else:
            self.retire(client, rollout)

    def retry_put(self, client: int, data: st.DataObject) -> None:
        """An identical retry of a payload put before (acknowledged or not)."""
        choices = sorted((r, sha) for r, m in self.model.items() for shas in m.attempted.values() for sha in shas)
        if not choices:
            return
        rollout, sha = data.draw(st.sampled_from(choices))
        var = self.by_sha[sha]
        self.do(self.op_put(client, rollout, var))

    def conflicting_put(self, client: int, data: st.DataObject, other: int) -> None:
        """Another payload for a call id put before (a conflict)."""
        choices = sorted(
            (r, var.cid)
            for r, m in self.model.items()
            for shas in m.attempted.values()
            for var in (self.by_sha[s] for s in shas)
        )
        if not choices:
            return
        rollout, cid = data.draw(st.sampled_from(choices))
        turn = int(cid.rsplit("-", 1)[1])
        tried = {self.by_sha[s].sha for s in self.model[rollout].attempted[cid]}
        pick = next((v for v in ((other, 3 - other, 0)) if self.variant(rollout, turn, v).sha not in tried), other)
        self.do(self.op_put(client, rollout, self.variant(rollout, turn, pick)))

    def begin_call(self, client: int, rollout: str, turn: int) -> None:
        self.do(self.op_begin(client, rollout, turn))

    def mark_incomplete(self, client: int, rollout: str, turn: int) -> None:
        self.do(self.op_mark(client, rollout, turn))

    @rule(client=st.integers(0, CLIENTS - 1), rollout=st.sampled_from(ROLLOUTS), intent=st.booleans())
    def put_next(self, client: int, rollout: str, intent: bool) -> None:
        """The next call of the rollout's conversation (the first turn without a payload), as a
        harness serves it: optionally ``begin_call`` first, then ``put`` on the same client."""
        m = self.model[rollout]
        turn = next((t for t in range(TURNS) if not m.attempted.get(f"call-{t:03d}")), TURNS - 1)
        if intent and not self.do(self.op_begin(client, rollout, turn)).ok:
            return
        self.do(self.op_put(client, rollout, self.variant(rollout, turn, 0)))

    @rule(
        writer=st.integers(0, CLIENTS - 1),
        builder=st.integers(0, CLIENTS - 1),
        rollout=st.sampled_from(ROLLOUTS),
        intents=st.booleans(),
        turns=st.integers(1, TURNS),
        conflict=st.sampled_from((None, None, 0, 1, 2)),
        consume=st.sampled_from(("no", "drop", "drop+retry")),
        delay=st.sampled_from(RACE_DELAYS),
        mark=st.sampled_from((False, False, True)),
    )
    def lifecycle(
        self,
        writer: int,
        builder: int,
        rollout: str,
        intents: bool,
        turns: int,
        conflict: int | None,
        consume: str,
        delay: float,
        mark: bool = False,
    ) -> None:
        """A whole attempt: delete the id, serve ``turns`` calls in order (optionally one call again
        with another payload, or marked incomplete), resolve, freeze, and maybe drop, alone or
        racing an identical retry of the last put (a retry that may read the drop's tentative
        retired fence)."""
        self.delete(builder, rollout)
        for _ in range(turns):
            self.put_next(writer, rollout, intents)
        if mark:
            self.do(self.op_mark(writer, rollout, turns - 1))
        if conflict is not None:
            turn = min(conflict, turns - 1)
            self.do(self.op_put(builder, rollout, self.variant(rollout, turn, 2 if turn == conflict else 1)))
        self.resolve(builder, rollout, turns - 1, 0)
        self.do(self.op_freeze(builder, rollout))
        if consume == "drop":
            self.do(self.op_drop(builder, rollout, 0))
        elif consume == "drop+retry":
            last = self.variant(rollout, turns - 1, 0)
            self.race_ops([self.op_drop(builder, rollout, 0), self.op_put(writer, rollout, last, delay)])

    @rule(client=st.integers(0, CLIENTS - 1), data=st.data())
    def freeze(self, client: int, data: st.DataObject) -> None:
        """Freeze a rollout written since its last freeze (any rollout when there is none)."""
        fresh = [r for r, m in self.model.items() if m.writes and (not m.snaps or max(m.writes) > m.snaps[-1].start)]
        self.do(self.op_freeze(client, _pick(data, fresh or list(ROLLOUTS))))

    @rule(client=st.integers(0, CLIENTS - 1), data=st.data(), pick=st.sampled_from((0, 0, 0, 1, 2)))
    def drop(self, client: int, data: st.DataObject, pick: int) -> None:
        """Drop the latest snapshot (pick 0) or a stale one, of a rollout frozen in this generation."""
        frozen = [r for r, m in self.model.items() if m.snaps]
        self.do(self.op_drop(client, _pick(data, frozen or list(ROLLOUTS)), pick))

    def op_retire(self, client: int, rollout: str, delay: float = 0.0) -> tuple:
        m = self.model[rollout]
        store = self.clients[client]

        async def go() -> Any:
            m.writes.append(time.monotonic())
            return await store.retire([rollout])

        def after(out: Outcome) -> None:
            self.expect_error_types(out, ())
            if out.ok:
                m.retired_at = m.retired_at or out.end
                m.retire_start = out.start
            else:
                m.maybe_removed = True

        return (f"retire({rollout})", client, go, delay, after)

    def retire(self, client: int, rollout: str) -> None:
        self.do(self.op_retire(client, rollout))

    def delete(self, client: int, rollout: str, cancel_after: float | None = None, also: tuple[str, ...] = ()) -> None:
        ids = [rollout, *also]
        before = {r: self.model[r] for r in ids}
        store = self.clients[client]
        self.quiesce([store.layout.rollout(r) for r in ids])

        async def go() -> Any:
            for r in ids:
                before[r].writes.append(time.monotonic())
            return await store.delete(ids)

        out = self.run(f"delete({', '.join(ids)})", client, go, cancel_after=cancel_after)
        self.expect_error_types(out, ())
        # Through a listing that lags, a delete can miss what was written within the lag (its
        # listing comes before any write of its own): not judged, and the id's next generation may
        # hold leftovers (docs/reliability.md, "Listings that lag"). Client PROBED_CLIENT lists
        # behind a probe (``probe_listing``): judged as without the lag.
        lagged = self.lagging(client) and client != PROBED_CLIENT
        if out.ok and not lagged:
            for r in ids:
                left = self.raw_keys(store.layout.rollout(r))
                self.stats.check(not left, "delete_leaves_nothing", lambda: f"{out.describe()} left {left[:5]}")
        if isinstance(out.error, CallerCancelled):
            self.settle()  # the id is reused only once the cancelled delete's requests are over
        # A delete that raised has nothing still running (finding 30): the ids are reused at once.
        for r in ids:
            self.model[r] = _StoreRollout(gen=before[r].gen + 1, dirty=before[r].dirty or not out.ok or lagged)

    def chain_was_stored(self, rollout: str, var: _Variant, ack: _Ack) -> bool:
        """Whether the calls a delta payload continues were stored, one payload each, before it was
        put (always true for a full prompt). A delta put names its ancestors from the writer's map
        of keys and its cache, not from a GET (put is one round trip): when a parent's put failed
        in this attempt of a reused id, a writer that wrote the previous attempt names that
        attempt's deleted keys, the put is acknowledged, and its continuations resolve UNRESOLVED
        (a lineage cost, never a wrong RESOLVED: docs/design.md, race 8). The Ceph chaos run of
        2026-12-02 drew such a case: the parent's put had failed on a stale map of keys (two for
        its own parent, one of the deleted attempt), which put now lists again."""
        if not var.entry.prompt_is_delta:
            return True
        m = self.model[rollout]
        turn = int(var.cid.rsplit("-", 1)[1])
        for earlier in range(turn):
            ancestor = self.variant(rollout, earlier, 0)
            if m.attempted.get(ancestor.cid, set()) != {ancestor.sha}:
                return False
            if not any(b.key == ancestor.sha and b.end < ack.start for b in m.puts):
                return False
        return True

    @rule(
        client=st.integers(0, CLIENTS - 1),
        rollout=st.sampled_from(ROLLOUTS),
        turn=st.integers(0, TURNS - 1),
        v=st.sampled_from((0, 0, 1, 2)),
    )
    def resolve(self, client: int, rollout: str, turn: int, v: int, cancel_after: float | None = None) -> None:
        var = self.variant(rollout, turn, v)
        store = self.clients[client]
        out = self.run(
            f"resolve({rollout},after {var.cid} v{v})",
            client,
            lambda: store.resolve(rollout, var.request),
            cancel_after=cancel_after,
        )
        self.expect_error_types(out, ())
        if not out.ok:
            return
        m = self.model[rollout]
        res = out.value
        self.stats.check(res.status != ParentResolutionStatus.ROOT, "resolve_not_root", lambda: out.describe())
        same_output = {
            s: self.by_sha[s] for s in m.attempted.get(var.cid, set()) if self.by_sha[s].output_key == var.output_key
        }
        if res.status == ParentResolutionStatus.RESOLVED:
            match = res.match
            self.stats.check(
                match.model_call_id == var.cid,
                "resolve_right_parent",
                lambda: f"{out.describe()}: the request continues {var.cid}",
            )
            allowed = (
                same_output
                if not m.dirty
                else {s: w for s, w in self.by_sha.items() if w.cid == var.cid and w.output_key == var.output_key}
            )
            self.stats.check(
                any(
                    tuple(match.cumulative_token_ids) == w.cumulative and match.digest == w.digest
                    for w in allowed.values()
                ),
                "resolve_right_tokens",
                lambda: f"{out.describe()}: tokens {match.cumulative_token_ids} are no payload of {var.cid} continued",
            )
            landed = [
                s
                for s in same_output
                if s in m.landed.get(var.cid, {}) and m.landed[var.cid][s] < self.visible_before(out)
            ]
            if m.retired_at is None and not m.maybe_removed:
                self.stats.check(
                    len(landed) < 2,
                    "resolve_unresolved_on_conflict",
                    lambda: f"{out.describe()} although {var.cid} has payloads {landed} under this fingerprint",
                )
        elif (
            not m.dirty
            and not m.maybe_removed
            and m.retired_at is None
            and set(same_output) == {var.sha}
            and any(
                a.key == var.sha and a.end < self.visible_before(out) and self.chain_was_stored(rollout, var, a)
                for a in m.puts
            )
        ):
            self.stats.check(
                False,
                "resolve_finds_acknowledged_parent",
                lambda: f"{out.describe()} although {var.cid} {var.sha[:8]} was acknowledged",
            )

    @rule(
        a=st.integers(0, CLIENTS - 1),
        b=st.integers(0, CLIENTS - 1),
        rollout=st.sampled_from(ROLLOUTS),
        kind=st.sampled_from(
            (
                "put+freeze",
                "put+drop",
                "retry+drop",
                "mark+drop",
                "begin+freeze",
                "put+put",
                "freeze+freeze",
                "put+retire",
                "retry+freeze",
            )
        ),
        turn=st.integers(0, TURNS - 1),
        v=st.sampled_from((0, 0, 1)),
        da=st.sampled_from(RACE_DELAYS),
        db=st.sampled_from(RACE_DELAYS),
    )
    def race(self, a: int, b: int, rollout: str, kind: str, turn: int, v: int, da: float, db: float) -> None:
        """Two operations at once on two clients, with small start delays."""
        var = self.variant(rollout, turn, v)
        first, second = kind.split("+")
        ops: list[tuple] = []
        for who, what, delay in ((a, first, da), (b, second, db)):
            if what == "put":
                ops.append(
                    self.op_put(who, rollout, var if not ops else self.variant(rollout, (turn + 1) % TURNS, 0), delay)
                )
            elif what == "retry":  # an identical retry of a payload put before, when there is one
                tried = sorted(sha for shas in self.model[rollout].attempted.values() for sha in shas)
                again = self.by_sha[tried[turn % len(tried)]] if tried else var
                ops.append(self.op_put(who, rollout, again, delay))
            elif what == "freeze":
                ops.append(self.op_freeze(who, rollout, delay))
            elif what == "drop":
                ops.append(self.op_drop(who, rollout, 0, delay))
            elif what == "mark":
                ops.append(self.op_mark(who, rollout, turn, delay))
            elif what == "begin":
                ops.append(self.op_begin(who, rollout, turn, delay))
            elif what == "retire":
                ops.append(self.op_retire(who, rollout, delay))
        self.race_ops(ops)

    @rule(
        client=st.integers(0, CLIENTS - 1),
        rollout=st.sampled_from(ROLLOUTS),
        kind=st.sampled_from(("put", "put", "retry", "begin", "mark", "freeze", "drop", "retire", "delete", "resolve")),
        turn=st.integers(0, TURNS - 1),
        v=st.sampled_from((0, 0, 1)),
        after=st.sampled_from(CANCEL_AFTER),
    )
    def cancelled(self, client: int, rollout: str, kind: str, turn: int, v: int, after: float) -> None:
        """One operation whose caller cancels its task after ``after`` seconds (a deadline, a
        cancelled request handler): not acknowledged, it may land up to ``SETTLE`` seconds later,
        and the same client goes on being used."""
        m = self.model[rollout]
        if kind == "delete":
            self.delete(client, rollout, cancel_after=after)
            return
        if kind == "resolve":
            self.resolve(client, rollout, turn, v, cancel_after=after)
            return
        if kind == "retry":
            tried = sorted(sha for shas in m.attempted.values() for sha in shas)
            op = self.op_put(
                client, rollout, self.by_sha[tried[turn % len(tried)]] if tried else self.variant(rollout, turn, v)
            )
        elif kind == "put":
            op = self.op_put(client, rollout, self.variant(rollout, turn, v))
        elif kind == "begin":
            op = self.op_begin(client, rollout, turn)
        elif kind == "mark":
            op = self.op_mark(client, rollout, turn)
        elif kind == "freeze":
            op = self.op_freeze(client, rollout)
        elif kind == "drop":
            op = self.op_drop(client, rollout, 0)
        else:
            op = self.op_retire(client, rollout)
        out = self.run(op[0], op[1], op[2], cancel_after=after)
        if isinstance(out.error, CallerCancelled):
            # Its requests may still be applied: it counts as a write until then (a freeze in that
            # window need not be idempotent), and a cancelled freeze may still rewrite the fence.
            m.writes.append(out.end + SETTLE)
            if kind == "freeze":
                m.broken_freezes.append(out.end + SETTLE)
        op[4](out)
        if isinstance(out.error, CallerCancelled) and kind in ("drop", "retire"):
            self.settle()  # the next lifecycle may delete and reuse the id


# --------------------------------------------------------------------------- ledger model
@dataclass
class _LedgerRollout:
    gen: int = 0
    dirty: bool = False
    rows: list[tuple[str, int, float]] = field(default_factory=list)  # acknowledged (cid, variant, end)
    landed: dict[str, dict[int, float]] = field(default_factory=lambda: collections.defaultdict(dict))
    attempted: dict[str, set[int]] = field(default_factory=lambda: collections.defaultdict(set))
    failures: list[tuple[str, str, float]] = field(default_factory=list)  # acknowledged
    failure_attempted: set[str] = field(default_factory=set)
    intents: list[tuple[str, float]] = field(default_factory=list)
    retired_at: float | None = None
    maybe_removed: bool = False


class _Commit:
    """Variant 0: the conversation's commit; 1: the same call rebuilt (admitted_at differs, a
    conflict under the same fingerprint); 2: another response (another fingerprint)."""

    def __init__(self, rollout: str, turn: int, variant: int) -> None:
        conv = build_conversation(rollout, TURNS)
        parent = _Commit(rollout, turn - 1, 0).commit if turn else None
        t = conv[turn]
        response = assistant_output(f"other answer {turn} of {rollout}") if variant == 2 else t.output_items
        request = list(t.request_items) if not turn else list(_Commit(rollout, turn - 1, 0).continuation)
        self.commit = make_commit(rollout, t.call_id, request, response, parent=parent)
        if variant == 1:
            self.commit["record"]["admitted_at"] = 1700000001.0
        self.cid = t.call_id
        self.variant = variant
        self.continuation = [*request, *response, user(f"after {turn}")]
        self.response_key = repr(response)


class LedgerMachine(_Machine):
    """Several ``S3CaptureLedger`` clients on one bucket, with faults (docs/reliability.md)."""

    def make_client(self, endpoint: str, session: Any, config: Any) -> Any:
        from s3capture.ledger import S3CaptureLedger

        probe = len(self.clients) == PROBED_CLIENT  # the clients are made in order: this is client i
        return S3CaptureLedger(
            self.url, endpoint_url=endpoint, session=session, botocore_config=config, probe_listing=probe
        )

    def __init__(self) -> None:
        super().__init__()
        self.model = {r: _LedgerRollout() for r in ROLLOUTS}
        self.commits: dict[tuple[str, int, int], _Commit] = {}

    def commit(self, rollout: str, turn: int, v: int) -> _Commit:
        key = (rollout, turn, v)
        if key not in self.commits:
            self.commits[key] = _Commit(rollout, turn, v)
        return self.commits[key]

    def op_record(self, client: int, rollout: str, c: _Commit, delay: float = 0.0) -> tuple:
        ledger = self.clients[client]
        self.model[rollout].attempted[c.cid].add(c.variant)
        return (
            f"record({rollout},{c.cid},v{c.variant})",
            client,
            lambda: ledger.record(c.commit),
            delay,
            lambda out: self.after_record(rollout, c, out),
        )

    def after_record(self, rollout: str, c: _Commit, out: Outcome) -> None:
        from s3capture.ledger import LedgerConflictError

        self.expect_error_types(out, (LedgerConflictError,))
        m = self.model[rollout]
        if out.ok:
            m.rows.append((c.cid, c.variant, out.end))
        if out.ok or isinstance(out.error, LedgerConflictError):
            m.landed[c.cid].setdefault(c.variant, out.end)

    def op_manifest(self, client: int, rollout: str, delay: float = 0.0) -> tuple:
        ledger = self.clients[client]
        return (
            f"manifest({rollout})",
            client,
            lambda: ledger.manifest(rollout),
            delay,
            lambda out: self.after_manifest(rollout, out),
        )

    def after_manifest(self, rollout: str, out: Outcome) -> None:
        from s3capture.ledger_records import (
            LEDGER_CONFLICTING_ROWS_REASON as CONFLICT,
            UNCOMMITTED_CALL_REASON as UNCOMMITTED,
        )

        self.expect_error_types(out, (RolloutRetiredError,))
        m = self.model[rollout]
        if m.retired_at is not None and m.retired_at < out.start:
            self.stats.check(
                isinstance(out.error, (RolloutRetiredError, StoreError, CallerCancelled)),
                "manifest_after_retire_raises",
                lambda: out.describe(),
            )
        if not out.ok:
            return
        man = out.value
        records = {r["model_call_id"]: r for r in man["records"]}
        failures = {(f["model_call_id"], f["reason"]) for f in man["failures"]}
        failed = {cid for cid, _ in failures}
        desc = lambda: out.describe()  # noqa: E731
        # Through a listing that lags (the ``lag`` fault) the manifest answers for the ledger as
        # it stood LAG_MS earlier, as ``resolve`` does: docs/reliability.md, "Listings that lag".
        # Client PROBED_CLIENT's manifests prove their listing fresh (``probe_listing``): judged
        # against the state at the call, lagging listing or not.
        before = out.start if out.client == PROBED_CLIENT else self.visible_before(out)
        self.stats.check(len(records) == len(man["records"]), "one_row_per_call", desc)
        for cid, rec in records.items():
            known = [c for (r, _, _), c in self.commits.items() if r == rollout and c.cid == cid]
            self.stats.check(
                any(_same_record(rec, c.commit["record"]) for c in known),
                "no_phantom_rows",
                lambda: f"{desc()}: row of {cid} was never recorded",
            )
        for cid, landed in m.landed.items():
            known = [v for v, t in landed.items() if t < before]
            if len(known) >= 2:
                self.stats.check(
                    (cid, CONFLICT) in failures and cid not in records,
                    "conflict_in_failures",
                    lambda: f"{desc()}: {cid} has rows {known}",
                )
        for cid, v, end in m.rows:
            if end >= before:
                continue
            mine = self.commit(rollout, int(cid.rsplit("-", 1)[1]), v).commit["record"]
            if m.attempted[cid] == {v} and not m.dirty:  # (a failed delete may have left other rows)
                self.stats.check(
                    cid in records and _same_record(records[cid], mine),
                    "acknowledged_row_in_manifest",
                    lambda: f"{desc()}: lacks acknowledged row {cid} v{v}",
                )
            else:
                self.stats.check(
                    cid in records or (cid, CONFLICT) in failures,
                    "acknowledged_row_in_manifest",
                    lambda: f"{desc()}: lacks acknowledged row {cid} v{v} (nor a conflict)",
                )
        for cid, reason, end in m.failures:
            if end < before:
                self.stats.check(
                    (cid, reason) in failures,
                    "acknowledged_failure_in_manifest",
                    lambda: f"{desc()}: lacks failure {cid} {reason}",
                )
        for cid, end in m.intents:
            if end < before and cid not in m.attempted and cid not in m.failure_attempted and not m.dirty:
                self.stats.check(
                    (cid, UNCOMMITTED) in failures,
                    "intent_without_row_in_failures",
                    lambda: f"{desc()}: intent {cid} has no row",
                )
            elif end < before:
                self.stats.check(
                    cid in records or cid in failed,
                    "intent_without_row_in_failures",
                    lambda: f"{desc()}: intent {cid} is neither a row nor a failure",
                )
        if not failures:
            for cid, rec in records.items():
                self.stats.check(
                    rec["parent_call_id"] is None or rec["parent_call_id"] in records,
                    "no_missing_parent_in_trainable",
                    lambda: f"{desc()}: {cid}'s parent {rec['parent_call_id']} has no row",
                )

    def op_retire(self, client: int, rollout: str, delay: float = 0.0) -> tuple:
        ledger = self.clients[client]
        return (
            f"retire({rollout})",
            client,
            lambda: ledger.retire([rollout]),
            delay,
            lambda out: self.after_retire(rollout, out),
        )

    def after_retire(self, rollout: str, out: Outcome) -> None:
        self.expect_error_types(out, ())
        m = self.model[rollout]
        if out.ok:
            m.retired_at = m.retired_at or out.end
        else:
            m.maybe_removed = True

    # ------------------------------------------------------------------ rules
    @rule(
        client=st.integers(0, CLIENTS - 1),
        rollout=st.sampled_from(ROLLOUTS),
        turn=st.integers(0, TURNS - 1),
        v=st.sampled_from((0, 0, 0, 0, 1, 2)),
    )
    def record(self, client: int, rollout: str, turn: int, v: int) -> None:
        c = self.commit(rollout, turn, v)
        self.do(self.op_record(client, rollout, c))

    @precondition(lambda self: any(m.attempted for m in self.model.values()))
    @rule(client=st.integers(0, CLIENTS - 1), data=st.data(), conflict=st.booleans(), other=st.integers(1, 2))
    def record_again(self, client: int, data: st.DataObject, conflict: bool, other: int) -> None:
        """An identical retry of a commit recorded before, or another commit for its call id."""
        if conflict:
            self.conflicting_record(client, data, other)
        else:
            self.retry_record(client, data)

    @rule(client=st.integers(0, CLIENTS - 1), rollout=st.sampled_from(ROLLOUTS), delete=st.booleans())
    def remove(self, client: int, rollout: str, delete: bool) -> None:
        """``retire`` or ``delete`` one rollout (the token-store machine also deletes both in one
        call; the removal code is the same)."""
        if delete:
            self.delete(client, rollout)
        else:
            self.retire(client, rollout)

    def retry_record(self, client: int, data: st.DataObject) -> None:
        """An identical retry of a commit recorded before (acknowledged or not)."""
        choices = sorted((r, cid, v) for r, m in self.model.items() for cid, vs in m.attempted.items() for v in vs)
        if not choices:
            return
        rollout, cid, v = data.draw(st.sampled_from(choices))
        c = self.commit(rollout, int(cid.rsplit("-", 1)[1]), v)
        self.do(self.op_record(client, rollout, c))

    def conflicting_record(self, client: int, data: st.DataObject, other: int) -> None:
        """Another commit for a call id recorded before (a conflict)."""
        choices = sorted((r, cid) for r, m in self.model.items() for cid in m.attempted)
        if not choices:
            return
        rollout, cid = data.draw(st.sampled_from(choices))
        turn = int(cid.rsplit("-", 1)[1])
        tried = self.model[rollout].attempted[cid]
        pick = next((v for v in (other, 3 - other, 0) if v not in tried), other)
        self.do(self.op_record(client, rollout, self.commit(rollout, turn, pick)))

    @rule(
        client=st.integers(0, CLIENTS - 1),
        rollout=st.sampled_from(ROLLOUTS),
        turn=st.integers(0, TURNS - 1),
        reason=st.sampled_from(("unresolved_parent", "timeout")),
    )
    def record_failure(self, client: int, rollout: str, turn: int, reason: str) -> None:
        ledger = self.clients[client]
        m = self.model[rollout]
        cid = build_conversation(rollout, TURNS)[turn].call_id
        m.failure_attempted.add(cid)
        out = self.run(
            f"record_failure({rollout},{cid},{reason})", client, lambda: ledger.record_failure(rollout, cid, reason)
        )
        self.expect_error_types(out, ())
        if out.ok:
            m.failures.append((cid, reason, out.end))

    @rule(client=st.integers(0, CLIENTS - 1), rollout=st.sampled_from(ROLLOUTS), turn=st.integers(0, TURNS - 1))
    def begin_call(self, client: int, rollout: str, turn: int, cancel_after: float | None = None) -> None:
        ledger = self.clients[client]
        m = self.model[rollout]
        cid = build_conversation(rollout, TURNS)[turn].call_id
        out = self.run(
            f"begin_call({rollout},{cid})", client, lambda: ledger.begin_call(rollout, cid), cancel_after=cancel_after
        )
        self.expect_error_types(out, ())
        if out.ok:
            m.intents.append((cid, out.end))

    @rule(
        writer=st.integers(0, CLIENTS - 1),
        builder=st.integers(0, CLIENTS - 1),
        rollout=st.sampled_from(ROLLOUTS),
        intents=st.booleans(),
        turns=st.integers(1, TURNS),
        conflict=st.sampled_from((None, None, 0, 1, 2)),
        retire=st.booleans(),
    )
    def lifecycle(
        self, writer: int, builder: int, rollout: str, intents: bool, turns: int, conflict: int | None, retire: bool
    ) -> None:
        """A whole attempt: delete the id, record ``turns`` calls in order (optionally one call again
        with another commit), resolve, read the manifest, maybe retire."""
        self.delete(builder, rollout)
        for _ in range(turns):
            self.record_next(writer, rollout, intents)
        if conflict is not None:
            turn = min(conflict, turns - 1)
            self.do(self.op_record(builder, rollout, self.commit(rollout, turn, 2 if turn == conflict else 1)))
        self.resolve(builder, rollout, turns - 1, 0)
        self.do(self.op_manifest(builder, rollout))
        if retire:
            self.do(self.op_retire(builder, rollout))

    @rule(client=st.integers(0, CLIENTS - 1), rollout=st.sampled_from(ROLLOUTS), intent=st.booleans())
    def record_next(self, client: int, rollout: str, intent: bool) -> None:
        """The next call of the conversation (first turn without a row), optionally after its intent."""
        m = self.model[rollout]
        turn = next((t for t in range(TURNS) if not m.attempted.get(f"call-{t:03d}")), TURNS - 1)
        if intent:
            self.begin_call(client, rollout, turn)
        self.do(self.op_record(client, rollout, self.commit(rollout, turn, 0)))

    @rule(client=st.integers(0, CLIENTS - 1), rollout=st.sampled_from(ROLLOUTS))
    def manifest(self, client: int, rollout: str) -> None:
        # has_rows rides on this rule rather than drawing its own: a new rule would change every
        # derandomized CI run's draws (and which checks those few runs reach).
        self.has_rows(client, rollout)
        self.do(self.op_manifest(client, rollout))

    def has_rows(self, client: int, rollout: str) -> None:
        """Gym's sink admits an unresolved continuation of a rollout without rows as a fresh root:
        False for a ledger with an acknowledged row is a wrong admission (reliability.md, finding 36)."""
        ledger = self.clients[client]
        out = self.run(f"has_rows({rollout})", client, lambda: ledger.has_rows(rollout))
        self.expect_error_types(out, (RolloutRetiredError,))
        m = self.model[rollout]
        if m.retired_at is not None and m.retired_at < out.start:
            self.stats.check(
                isinstance(out.error, (RolloutRetiredError, StoreError, CallerCancelled)),
                "has_rows_after_retire_raises",
                lambda: out.describe(),
            )
        if not out.ok:
            return
        if out.value:
            self.stats.check(
                bool(m.attempted or m.failure_attempted or m.dirty),
                "has_rows_no_phantom",
                lambda: f"{out.describe()}: no row or failure row was ever attempted",
            )
        # Judged like manifest: a probed client against the state at the call, another one
        # through a lagging listing against the state LAG_MS earlier.
        before = out.start if out.client == PROBED_CLIENT else self.visible_before(out)
        acked = [cid for cid, _, end in m.rows if end < before] + [c for c, _, e in m.failures if e < before]
        if acked and m.retired_at is None and not m.maybe_removed:
            self.stats.check(out.value, "has_rows_sees_acknowledged_rows", lambda: f"{out.describe()}: {acked}")

    def retire(self, client: int, rollout: str) -> None:
        self.do(self.op_retire(client, rollout))

    def delete(self, client: int, rollout: str, cancel_after: float | None = None, also: tuple[str, ...] = ()) -> None:
        ledger = self.clients[client]
        ids = [rollout, *also]
        before = {r: self.model[r] for r in ids}
        self.quiesce([ledger.layout.rollout(r) for r in ids])
        out = self.run(f"delete({', '.join(ids)})", client, lambda: ledger.delete(ids), cancel_after=cancel_after)
        self.expect_error_types(out, ())
        # Through a listing that lags, a delete can miss what was written within the lag (its
        # listing comes before any write of its own): not judged, and the id's next generation may
        # hold leftovers (docs/reliability.md, "Listings that lag"). Client PROBED_CLIENT lists
        # behind a probe (``probe_listing``): judged as without the lag.
        lagged = self.lagging(client) and client != PROBED_CLIENT
        if out.ok and not lagged:
            for r in ids:
                left = self.raw_keys(ledger.layout.rollout(r))
                self.stats.check(not left, "delete_leaves_nothing", lambda: f"{out.describe()} left {left[:5]}")
        if isinstance(out.error, CallerCancelled):
            self.settle()  # the id is reused only once the cancelled delete's requests are over
        # A delete that raised has nothing still running (finding 30): the ids are reused at once.
        for r in ids:
            self.model[r] = _LedgerRollout(gen=before[r].gen + 1, dirty=before[r].dirty or not out.ok or lagged)

    @rule(
        client=st.integers(0, CLIENTS - 1),
        rollout=st.sampled_from(ROLLOUTS),
        turn=st.integers(0, TURNS - 1),
        v=st.sampled_from((0, 0, 1, 2)),
    )
    def resolve(self, client: int, rollout: str, turn: int, v: int, cancel_after: float | None = None) -> None:
        c = self.commit(rollout, turn, v)
        ledger = self.clients[client]
        out = self.run(
            f"resolve({rollout},after {c.cid} v{v})",
            client,
            lambda: ledger.resolve(rollout, c.continuation),
            cancel_after=cancel_after,
        )
        self.expect_error_types(out, ())
        if not out.ok:
            return
        m = self.model[rollout]
        res = out.value
        self.stats.check(res.status != ParentResolutionStatus.ROOT, "resolve_not_root", lambda: out.describe())
        if res.status == ParentResolutionStatus.RESOLVED:
            match = res.match
            rec = c.commit["record"]
            self.stats.check(
                match.model_call_id == c.cid
                and match.prev_len == rec["cum_len"]
                and list(match.staging_chain) == c.commit["staging_chain"]
                and match.digest == rec["cumulative_hash"],
                "resolve_right_parent",
                lambda: f"{out.describe()}: the request continues {c.cid} (cum_len {rec['cum_len']})",
            )
            self.stats.check(
                m.retired_at is None or m.retired_at > out.start,
                "resolve_unresolved_after_retire",
                lambda: out.describe(),
            )
            landed = [w for w, t in m.landed.get(c.cid, {}).items() if t < self.visible_before(out)]
            if m.retired_at is None and not m.maybe_removed:
                self.stats.check(
                    len(landed) < 2,
                    "resolve_unresolved_on_conflict",
                    lambda: f"{out.describe()} although {c.cid} has rows {landed}",
                )
        elif (
            not m.dirty
            and not m.maybe_removed
            and m.retired_at is None
            and m.attempted.get(c.cid) == {v}
            # a call with a failure row is never a parent (UNRESOLVED failed_candidate, ledger.resolve)
            and c.cid not in m.failure_attempted
            and any(cid == c.cid and w == v and end < self.visible_before(out) for cid, w, end in m.rows)
        ):
            self.stats.check(
                False,
                "resolve_finds_acknowledged_parent",
                lambda: f"{out.describe()} although {c.cid} v{v} was acknowledged",
            )

    @rule(
        a=st.integers(0, CLIENTS - 1),
        b=st.integers(0, CLIENTS - 1),
        rollout=st.sampled_from(ROLLOUTS),
        kind=st.sampled_from(("record+manifest", "record+retire", "record+record", "manifest+retire")),
        turn=st.integers(0, TURNS - 1),
        v=st.sampled_from((0, 0, 1)),
        da=st.sampled_from(RACE_DELAYS[:4]),
        db=st.sampled_from(RACE_DELAYS[:4]),
    )
    def race(self, a: int, b: int, rollout: str, kind: str, turn: int, v: int, da: float, db: float) -> None:
        first, second = kind.split("+")
        ops: list[tuple] = []
        for who, what, delay in ((a, first, da), (b, second, db)):
            if what == "record":
                c = self.commit(rollout, turn, v) if not ops else self.commit(rollout, turn, 0)
                ops.append(self.op_record(who, rollout, c, delay))
            elif what == "manifest":
                ops.append(self.op_manifest(who, rollout, delay))
            elif what == "retire":
                ops.append(self.op_retire(who, rollout, delay))
        self.race_ops(ops)

    @rule(
        client=st.integers(0, CLIENTS - 1),
        rollout=st.sampled_from(ROLLOUTS),
        kind=st.sampled_from(("record", "record", "begin", "manifest", "retire", "delete", "resolve")),
        turn=st.integers(0, TURNS - 1),
        v=st.sampled_from((0, 0, 1)),
        after=st.sampled_from(CANCEL_AFTER),
    )
    def cancelled(self, client: int, rollout: str, kind: str, turn: int, v: int, after: float) -> None:
        """One operation whose caller cancels its task after ``after`` seconds: not acknowledged,
        it may land up to ``SETTLE`` seconds later, and the same client goes on being used."""
        if kind == "delete":
            self.delete(client, rollout, cancel_after=after)
        elif kind == "resolve":
            self.resolve(client, rollout, turn, v, cancel_after=after)
        elif kind == "begin":
            self.begin_call(client, rollout, turn, cancel_after=after)
        else:
            if kind == "record":
                op = self.op_record(client, rollout, self.commit(rollout, turn, v))
            elif kind == "manifest":
                op = self.op_manifest(client, rollout)
            else:
                op = self.op_retire(client, rollout)
            out = self.run(op[0], op[1], op[2], cancel_after=after)
            op[4](out)
            if isinstance(out.error, CallerCancelled) and kind == "retire":
                self.settle()  # the next lifecycle may delete and reuse the id


def _same_record(stored: dict, mine: dict) -> bool:
    return all(stored.get(k) == v for k, v in mine.items())


# --------------------------------------------------------------------------- factories
def _aimed_at(kinds: tuple[str, ...]) -> dict[str, Any]:
    """Rules of a machine aimed at ``kinds``: client 1 starts with the first of them on all its
    requests, and the ``fault`` rule draws from ``kinds`` only."""
    unknown = set(kinds) - set(ALL_FAULT_KINDS)
    if not kinds or unknown:
        raise ValueError(f"unknown fault kinds {sorted(unknown)}" if unknown else "no fault kinds")

    @initialize()
    def first_fault(self: _Machine) -> None:
        _Machine.fault(self, 1, kinds[0], "ALL")

    @rule(
        client=st.integers(1, CLIENTS - 1),
        kind=st.sampled_from((None, *kinds)),
        scope=st.sampled_from(FAULT_SCOPES),
    )
    def fault(self: _Machine, client: int, kind: str | None, scope: str) -> None:
        _Machine.fault(self, client, kind, scope)

    return {"first_fault": first_fault, "fault": fault}


def store_machine(server: Any, stats: Stats, faults: tuple[str, ...] | None = None) -> type[TokenStoreMachine]:
    """A ``TokenStoreMachine`` bound to a running ``LocalS3Server`` and a ``Stats``; ``faults``
    aims it at those kinds (``_aimed_at``; default: every kind of ``FAULT_KINDS``, drawn)."""
    extra = {} if faults is None else _aimed_at(faults)
    return type("TokenStoreModel", (TokenStoreMachine,), {"server": server, "stats": stats, **extra})


def ledger_machine(server: Any, stats: Stats, faults: tuple[str, ...] | None = None) -> type[LedgerMachine]:
    """A ``LedgerMachine`` bound to a running ``LocalS3Server`` and a ``Stats`` (``faults``: as
    for ``store_machine``)."""
    extra = {} if faults is None else _aimed_at(faults)
    return type("LedgerModel", (LedgerMachine,), {"server": server, "stats": stats, **extra})
