"""s3capture's conformance suite (``s3capture.conformance``): it passes, it can fail, and its CLI.

* The whole suite against ``S3TokenStore`` + ``S3CaptureLedger`` over HTTP on moto and SeaweedFS,
  with a fresh client per factory call; every check must pass and the report names each one.
* NeMo Gym 0.7.0's reference stores (``TokenCaptureStore``/``FileLineageStore`` on one directory,
  and ``InMemoryLineageStore`` as a ledger): the EXACT set of checks each fails, with the reason,
  is pinned here and in ``docs/conformance.md`` (a test compares the doc's table with the pins).
* Mutants of the real S3 implementation that each break one contract make the named check fail
  with a useful detail; a client raising an unexpected exception is a failed check, not a crash.
* ``s3capture conformance`` in a subprocess: embedded moto, ``--check``, an unknown ``--check``,
  and an explicit ``s3://`` URL with ``--endpoint``.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, NamedTuple

import pytest

from gymcompat import require_gym
from helpers import list_keys, split_bucket_url
from s3capture.conformance import CHECKS, CheckResult, format_report, run_conformance
from s3capture.ledger import LedgerConflictError, S3CaptureLedger
from s3capture.ledger_records import to_wire, validate_commit
from s3capture.protocols import TokenCaptureFrozenError
from s3capture.store import S3TokenStore

pytestmark = pytest.mark.all_transports  # every test runs on aioboto3 and obstore (tests/conftest.py)

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "conformance.md"
NAMES = [name for name, _, _ in CHECKS]
GYM_LEDGER_SKIPS = ("ledger_begin_call_custody",)  # an s3capture extension Gym's ledgers do not have
GYM_SUITE_NAMES = NAMES[:10]
LEDGER_CHECKS = [name for name, needs, _ in CHECKS if needs == "l"]


def test_check_names_are_unique_and_start_with_gyms_ten():
    assert len(NAMES) == len(set(NAMES)) == 25
    assert GYM_SUITE_NAMES == [
        "put_then_freeze_visibility",
        "idempotent_reput",
        "conflicting_reput",
        "mark_incomplete_durability",
        "freeze_idempotency",
        "post_freeze_write_safety",
        "conditional_retirement",
        "lineage_visibility",
        "fresh_client_lineage_visibility",
        "begin_call_custody",
    ]


# ---------------------------------------------------------------------------------------- s3capture
class _Clients:
    """Factories of fresh S3 clients on one bucket; every client made is closed at teardown.

    The clients share one ``aioboto3.Session`` (credentials and the service model, ~80 ms to
    build), but each has its own HTTP client and caches, so cross-client visibility is real.
    """

    def __init__(self, url: str) -> None:
        import aioboto3

        self.url = url
        self.session = aioboto3.Session()
        self.made: list[Any] = []
        self.touched: list[str] = []

    def make(self, cls: type = S3TokenStore, **kwargs: Any) -> Any:
        client = cls(self.url, session=self.session, **kwargs)
        self.made.append(client)
        for method in ("_put", "_delete_one"):  # every key a client writes or deletes (one each)
            setattr(client, method, self._recording(getattr(client, method)))
        delete_keys = client._delete_keys

        async def recorded_delete_keys(keys: list[str]) -> None:
            self.touched.extend(keys)
            await delete_keys(keys)

        client._delete_keys = recorded_delete_keys
        return client

    def _recording(self, method: Any) -> Any:
        async def recorded(key: str, *args: Any) -> Any:
            self.touched.append(key)
            return await method(key, *args)

        return recorded

    def store(self) -> S3TokenStore:
        return self.make(S3TokenStore)

    def ledger(self) -> S3CaptureLedger:
        return self.make(S3CaptureLedger)

    def factories(self, **overrides: Any) -> dict[str, Any]:
        """The four factories over the real implementation, some replaced by ``overrides``."""
        base = dict(
            sink_factory=self.store, source_factory=self.store, resolver_factory=self.store, ledger_factory=self.ledger
        )
        base.update(overrides)
        return base


@pytest.fixture
async def clients(s3_env, bucket_url):
    made = _Clients(bucket_url)
    yield made
    for client in made.made:
        await client.close()


async def test_s3capture_passes_every_check(clients, s3_client, s3_server):
    seen: list[CheckResult] = []
    report = await run_conformance(**clients.factories(), progress=seen.append)
    details = {r.name: r.detail for r in report.results if r.status != "passed"}
    assert report.passed == NAMES, f"{s3_server.kind}: not passed: {details}"
    assert report.failed == [] and report.skipped == [] and report.ok
    assert [r.name for r in seen] == NAMES, "progress must see every result, in suite order"
    text = format_report(report, where=s3_server.kind)
    for name in NAMES:
        assert re.search(rf"^  PASS  {name}\s+\d+\.\d\d s$", text, re.M), f"{name} is not reported as PASS:\n{text}"
    assert text.splitlines()[-1] == "25 passed, 0 failed, 0 skipped"
    # A fresh client per factory call (distinct instances), closed by the suite.
    assert len(clients.made) > 60 and len({id(c) for c in clients.made}) == len(clients.made)
    # The suite wrote and deleted only under <prefix>/rollouts/conformance-*, and left nothing behind.
    bucket, prefix = split_bucket_url(clients.url)
    assert len(clients.touched) > 200
    stray = [key for key in clients.touched if not key.startswith(f"{prefix}rollouts/conformance-")]
    assert stray == []
    left = list_keys(s3_client, bucket)
    assert left == [], f"the suite left {len(left)} objects behind: {left[:5]}"


# ---------------------------------------------------------------------------------------- NeMo Gym
class Expected(NamedTuple):
    reason: str  # why the Gym store cannot pass (the doc repeats it)
    detail: str  # a fragment of the failure detail the suite reports


GYM_FILE_STORE_FAILURES = {
    "frozen_error_on_late_put": Expected(
        "a put after freeze raises a plain RuntimeError: Gym 0.7.0 has no TokenCaptureFrozenError",
        "raised RuntimeError: Token capture for rollout",
    ),
    "source_retire_fences_late_put": Expected(
        "TokenCaptureStore has no retire() (only drop(), and a sync single-id delete())",
        "'TokenCaptureStore' object has no attribute 'retire'",
    ),
    "source_retire_idempotent": Expected(
        "TokenCaptureStore has no retire()", "'TokenCaptureStore' object has no attribute 'retire'"
    ),
    "mark_incomplete_after_retire": Expected(
        "TokenCaptureStore has no retire()", "'TokenCaptureStore' object has no attribute 'retire'"
    ),
    "source_delete_reuse": Expected(
        "TokenCaptureStore has no retire() and no batch async delete() returning a RolloutRemoval",
        "'TokenCaptureStore' object has no attribute 'retire'",
    ),
    "ledger_retire": Expected(
        "FileLineageStore has no retire() (no fence, no RolloutRetiredError)",
        "'FileLineageStore' object has no attribute 'retire'",
    ),
    "ledger_delete_reuse": Expected(
        "FileLineageStore has no retire() or delete()", "'FileLineageStore' object has no attribute 'retire'"
    ),
    "protocol_shapes_and_install": Expected(
        "without retire()/delete() neither store satisfies TokenSource or CaptureLedger (runtime isinstance)",
        "TokenCaptureStore lacks methods of TokenSource",
    ),
}
"""Checks Gym 0.7.0's TokenCaptureStore + FileLineageStore fail: they predate retire/delete/the errors."""

GYM_IN_MEMORY_LEDGER_FAILURES = {
    "ledger_retire": Expected(
        "InMemoryLineageStore has no retire()", "'InMemoryLineageStore' object has no attribute 'retire'"
    ),
    "ledger_delete_reuse": Expected(
        "InMemoryLineageStore has no retire() or delete()", "'InMemoryLineageStore' object has no attribute 'retire'"
    ),
    "protocol_shapes_and_install": Expected(
        "without retire()/delete() it is not a CaptureLedger (runtime isinstance)",
        "InMemoryLineageStore lacks methods of CaptureLedger",
    ),
}
"""Ledger checks Gym 0.7.0's InMemoryLineageStore fails (it is the ledger only: the others are skipped)."""


def _assert_failures(report: Any, expected: dict[str, Expected], ran: list[str]) -> None:
    failed = {r.name: r.detail for r in report.results if r.status == "failed"}
    assert set(failed) == set(expected), f"failed {sorted(failed)}; details: {failed}"
    for name, pin in expected.items():
        assert pin.detail in failed[name], f"{name}: {failed[name]!r} lacks {pin.detail!r}"
    assert report.passed == [n for n in ran if n not in expected]


@pytest.mark.all_transports
@pytest.mark.parametrize("where", ["check", "cleanup"])
async def test_an_interrupted_run_still_removes_what_its_checks_wrote(clients, s3_client, where):
    """A Ctrl-C (the run's task cancelled) while a check runs, or while its cleanup deletes, left
    the check's rollouts in the bucket (2026-12-03, both transports; on obstore a cancelled PUT
    also landed after the delete). The cleanup now runs to its end before the cancellation ends
    the run, after the check's clients have closed (which waits for their writes)."""
    run: asyncio.Future[Any] | None = None
    calls = {"put": 0, "delete": 0}

    def interrupting(cls: type) -> Callable[[], Any]:
        def make() -> Any:
            client = clients.make(cls)
            for method in ("put", "delete"):
                original = getattr(client, method)

                async def wrapped(*args: Any, _original: Any = original, _method: str = method, **kwargs: Any) -> Any:
                    calls[_method] += 1
                    if (_method, calls[_method]) in {("put", 7), ("delete", 3)} and _method == {
                        "check": "put",
                        "cleanup": "delete",
                    }[where]:
                        assert run is not None
                        run.cancel()  # lands at this call's next await
                    return await _original(*args, **kwargs)

                setattr(client, method, wrapped)
            return client

        return make

    store, ledger = interrupting(S3TokenStore), interrupting(S3CaptureLedger)
    run = asyncio.ensure_future(
        run_conformance(sink_factory=store, source_factory=store, resolver_factory=store, ledger_factory=ledger)
    )
    with pytest.raises(asyncio.CancelledError):
        await run
    bucket, _ = split_bucket_url(clients.url)
    assert clients.touched, "the run wrote nothing before it was interrupted"
    left = list_keys(s3_client, bucket)
    assert left == [], f"an interrupted run left {len(left)} objects behind: {left[:5]}"


async def test_gym_file_stores(tmp_path):
    require_gym()
    from nemo_gym.token_id_capture.lineage import FileLineageStore
    from nemo_gym.token_id_capture.store import TokenCaptureStore

    made: list[Any] = []

    def make(cls: type) -> Callable[[], Any]:
        def factory() -> Any:
            made.append(cls(tmp_path))  # a fresh instance per call, all over the same directory
            return made[-1]

        return factory

    report = await run_conformance(
        sink_factory=make(TokenCaptureStore),
        source_factory=make(TokenCaptureStore),
        resolver_factory=make(FileLineageStore),
        ledger_factory=make(FileLineageStore),
        entry_type="gym",
    )
    # Gym's ledgers have no begin_call extension (s3capture's S3CaptureLedger does).
    assert report.skipped == list(GYM_LEDGER_SKIPS)
    _assert_failures(report, GYM_FILE_STORE_FAILURES, [n for n in NAMES if n not in GYM_LEDGER_SKIPS])
    assert set(GYM_SUITE_NAMES) <= set(report.passed), "Gym's stores pass Gym's own ten checks"
    assert len({id(c) for c in made}) == len(made) > 40


async def test_gym_in_memory_ledger():
    require_gym()
    from nemo_gym.token_id_capture.lineage import InMemoryLineageStore

    # Process-local by design (is_process_shared() is False): "another client" of it in this process
    # is the same instance. Its close() clears it; the suite closes clients only after each check's
    # work and every check uses its own rollout ids, so that wipes the store BETWEEN checks only.
    shared = InMemoryLineageStore()
    report = await run_conformance(ledger_factory=lambda: shared, entry_type="gym")
    ran = [n for n in LEDGER_CHECKS if n not in GYM_LEDGER_SKIPS] + ["protocol_shapes_and_install"]
    assert report.skipped == [n for n in NAMES if n not in ran]
    _assert_failures(report, GYM_IN_MEMORY_LEDGER_FAILURES, ran)
    assert shared._ledgers == {}, "the suite's close() after each check cleared the shared store"


async def test_gym_in_memory_ledger_per_client_is_not_shared():
    """A fresh InMemoryLineageStore per factory call is a non-shared ledger: the suite notices."""
    require_gym()
    from nemo_gym.token_id_capture.lineage import InMemoryLineageStore

    report = await run_conformance(ledger_factory=InMemoryLineageStore, entry_type="gym", only=LEDGER_CHECKS[:3])
    failed = {r.name: r.detail for r in report.results if r.status == "failed"}
    assert failed == {
        "ledger_record_visibility": "has_rows is not True after record returned",
        "ledger_idempotent_record": "a repeated identical record gave 0 rows",
        "ledger_conflicting_record": "call-1: a conflicting record neither raised nor shows as a conflict",
    }


# ---------------------------------------------------------------------------------------- mutants
# Each breaks ONE contract of the real S3 implementation; the named checks must fail, the rest pass.
class LeaksTokens(S3CaptureLedger):
    async def manifest(self, rollout_id: str) -> dict:
        manifest = await super().manifest(rollout_id)
        for row in manifest["records"]:
            row["cumulative_token_ids"] = [1, 2, 3]
        return manifest


class RetireDeletes(S3CaptureLedger):
    async def retire(self, rollout_ids: Any) -> Any:
        return await self.delete(rollout_ids)  # removes the rows but keeps no fence


class RetireMiscounts(S3TokenStore):
    async def retire(self, rollout_ids: Any) -> Any:
        await super().retire(rollout_ids)
        return {"removed": list(rollout_ids), "absent": []}  # "removed" again on a repeated retire


class SwallowsFrozen(S3TokenStore):
    async def put(self, entry: Any) -> None:
        try:
            await super().put(entry)
        except TokenCaptureFrozenError:  # TokenCaptureRetiredError included
            pass


class FirstCandidateWins(S3TokenStore):
    async def _list(self, prefix: str) -> list:
        items = await super()._list(prefix)
        if "/log/e/" not in prefix:  # resolve's fingerprint listing only
            return items
        first: dict[str, Any] = {}
        for item in items:  # keep the first stored payload of each call id: conflicts vanish
            first.setdefault(item.key.rsplit("/", 1)[0], item)
        return list(first.values())


class ForgetsIncomplete(S3TokenStore):
    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        return None


class DropIgnoresVersion(S3TokenStore):
    async def drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        return bool(await self.retire([rollout_id]))


class FreezeCrashes(S3TokenStore):
    async def freeze(self, rollout_id: str) -> Any:
        raise KeyError("backend exploded")


def accepts_conflicts(clients: _Clients) -> Callable[[], Any]:
    """A ledger that swallows the conflict and then reports the second payload as the row."""
    accepted: dict[tuple[str, str], dict] = {}  # shared by every client, like a backend would be

    class AcceptsConflicts(S3CaptureLedger):
        async def record(self, commit: Any) -> None:
            try:
                await super().record(commit)
            except LedgerConflictError:
                c = validate_commit(commit)
                accepted[(c.rollout_id, c.record.model_call_id)] = to_wire(c.record)

        async def manifest(self, rollout_id: str) -> dict:
            manifest = await super().manifest(rollout_id)
            for (rid, cid), row in accepted.items():
                if rid == rollout_id:
                    manifest["failures"] = [f for f in manifest["failures"] if f["model_call_id"] != cid]
                    manifest["records"] = [r for r in manifest["records"] if r["model_call_id"] != cid] + [row]
            return manifest

    return lambda: clients.make(AcceptsConflicts)


def _broken_factory() -> Any:
    raise ConnectionRefusedError("cannot reach the store")


class Mutant(NamedTuple):
    overrides: Callable[[_Clients], dict[str, Any]]
    only: list[str]
    failed: dict[str, str]  # check name -> fragment of its detail


MUTANTS = {
    "manifest_leaks_tokens": Mutant(
        lambda c: {"ledger_factory": lambda: c.make(LeaksTokens)},
        ["ledger_record_visibility", "ledger_unused_rollout", "ledger_retire"],
        {"ledger_record_visibility": "the manifest carries token data at $.records[0].cumulative_token_ids"},
    ),
    "ledger_accepts_conflict": Mutant(
        lambda c: {"ledger_factory": accepts_conflicts(c)},
        ["ledger_idempotent_record", "ledger_conflicting_record"],
        {"ledger_conflicting_record": "the conflicting second payload became the manifest row"},
    ),
    "ledger_retire_is_delete": Mutant(
        lambda c: {"ledger_factory": lambda: c.make(RetireDeletes)},
        ["ledger_record_visibility", "ledger_retire", "ledger_delete_reuse"],
        {
            "ledger_retire": "manifest of a retired rollout returned instead of raising RolloutRetiredError",
            # "retire" already deleted everything, so the delete that follows finds nothing to remove.
            "ledger_delete_reuse": "expected removed=['conformance-ledger-delete-reuse-used-",
        },
    ),
    "source_retire_miscounts": Mutant(
        lambda c: {"source_factory": lambda: c.make(RetireMiscounts)},
        ["source_retire_fences_late_put", "source_retire_idempotent", "mark_incomplete_after_retire"],
        {
            # The first retire already reports the never-written id as removed.
            "source_retire_idempotent": "expected removed=['conformance-source-retire-idempotent-used-",
        },
    ),
    "sink_swallows_frozen": Mutant(
        lambda c: {"sink_factory": lambda: c.make(SwallowsFrozen)},
        [
            "post_freeze_write_safety",
            "frozen_error_on_late_put",
            "source_retire_fences_late_put",
            "mark_incomplete_after_retire",
        ],
        {
            "frozen_error_on_late_put": "a put issued after freeze returned succeeded",
            "source_retire_fences_late_put": "a put after retire succeeded",
            "mark_incomplete_after_retire": "after mark_incomplete on a retired rollout, a put succeeded",
        },
    ),
    "resolver_ignores_conflicts": Mutant(
        lambda c: {"resolver_factory": lambda: c.make(FirstCandidateWins)},
        ["lineage_visibility", "resolver_conflict_zero_candidates"],
        {"resolver_conflict_zero_candidates": "two committed payloads for one call id resolved to 'call-1'"},
    ),
    "sink_forgets_incomplete": Mutant(
        lambda c: {"sink_factory": lambda: c.make(ForgetsIncomplete)},
        ["idempotent_reput", "mark_incomplete_durability"],
        {"mark_incomplete_durability": "a fresh source does not see the incomplete marker"},
    ),
    "drop_ignores_version": Mutant(
        lambda c: {"source_factory": lambda: c.make(DropIgnoresVersion)},
        ["freeze_idempotency", "conditional_retirement"],
        {"conditional_retirement": "a stale-version drop succeeded"},
    ),
    "freeze_raises_unexpectedly": Mutant(
        lambda c: {"source_factory": lambda: c.make(FreezeCrashes)},
        ["put_then_freeze_visibility", "lineage_visibility", "frozen_error_on_late_put"],
        {
            "put_then_freeze_visibility": "unexpected KeyError: 'backend exploded'",
            "frozen_error_on_late_put": "unexpected KeyError: 'backend exploded'",
        },
    ),
    "factory_raises": Mutant(
        lambda c: {"ledger_factory": _broken_factory},
        ["lineage_visibility", "ledger_unused_rollout"],
        {"ledger_unused_rollout": "unexpected ConnectionRefusedError: cannot reach the store"},
    ),
}


# One transport: a mutant changes the client's behaviour above the transport, and whether the named
# check catches it is the suite's property, not the transport's (test_s3capture_passes_every_check
# runs every check on each transport and server).
@pytest.mark.parametrize("transport_kind", ["aioboto3"], indirect=True)
@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
@pytest.mark.parametrize("mutant", list(MUTANTS))
async def test_mutant_fails_the_named_check(mutant, clients):
    spec = MUTANTS[mutant]
    report = await run_conformance(**clients.factories(**spec.overrides(clients)), only=spec.only)
    assert [r.name for r in report.results] == spec.only, "every selected check reports, in order"
    failed = {r.name: r.detail for r in report.results if r.status == "failed"}
    assert set(failed) == set(spec.failed), f"{mutant}: failed {failed}"
    for name, fragment in spec.failed.items():
        assert fragment in failed[name], f"{mutant}/{name}: {failed[name]!r} lacks {fragment!r}"
    assert report.passed == [n for n in spec.only if n not in spec.failed]
    assert not report.ok
    assert "NOT CONFORMANT" in format_report(report)


async def test_unknown_check_and_entry_type_are_value_errors():
    with pytest.raises(ValueError, match="unknown conformance checks"):
        await run_conformance(only=["no_such_check"])
    with pytest.raises(ValueError, match="entry_type"):
        await run_conformance(entry_type="pydantic")
    report = await run_conformance()  # no factories: everything that needs a part is skipped
    assert report.passed == ["protocol_shapes_and_install"] and len(report.skipped) == len(NAMES) - 1
    report = await run_conformance(only=["put_then_freeze_visibility"])
    assert report.skipped == ["put_then_freeze_visibility"] and not report.ok, "nothing ran: not ok"


# ---------------------------------------------------------------------------------------- CLI
def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    base["PYTHONPATH"] = str(REPO / "src") + os.pathsep + base.get("PYTHONPATH", "")
    # No ~/.aws files either: only what the test passes (or the embedded server sets) counts.
    base["AWS_CONFIG_FILE"] = base["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
    return subprocess.run(
        [sys.executable, "-m", "s3capture.cli", "conformance", *args],
        cwd=REPO,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _marks(stdout: str) -> dict[str, str]:
    return dict((name, mark) for mark, name in re.findall(r"^  (PASS|FAIL|SKIP)  (\S+)\s", stdout, re.M))


def test_cli_embedded_moto_runs_every_check():
    done = _cli()
    assert done.returncode == 0, done.stdout + done.stderr
    assert _marks(done.stdout) == {name: "PASS" for name in NAMES}, done.stdout
    assert done.stdout.splitlines()[-1] == "25 passed, 0 failed, 0 skipped"
    assert "embedded moto" in done.stderr


# One transport: --check selection is the CLI's (the embedded every-check run covers both transports).
@pytest.mark.parametrize("transport_kind", ["aioboto3"], indirect=True)
def test_cli_check_runs_only_that_check():
    done = _cli("--check", "ledger_unused_rollout", "--check", "put_then_freeze_visibility")
    assert done.returncode == 0, done.stdout + done.stderr
    assert _marks(done.stdout) == {"put_then_freeze_visibility": "PASS", "ledger_unused_rollout": "PASS"}
    assert done.stdout.splitlines()[-1] == "2 passed, 0 failed, 0 skipped"


# One transport: the CLI rejects the argument before it builds any client.
@pytest.mark.parametrize("transport_kind", ["aioboto3"], indirect=True)
def test_cli_unknown_check_exits_2_with_one_line():
    done = _cli("--check", "put_then_freeze_visibility", "--check", "no_such_check")
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("s3capture conformance: error: unknown check no_such_check;")


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
def test_cli_explicit_url_and_endpoint(s3_server, bucket_url, s3_client):
    env = {k: v for k, v in s3_server.env().items() if k != "AWS_ENDPOINT_URL"}  # --endpoint must be used
    checks = ["lineage_visibility", "ledger_record_visibility"]
    done = _cli(
        f"{bucket_url}/cli",
        "--endpoint",
        s3_server.endpoint_url,
        *[arg for name in checks for arg in ("--check", name)],
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == f"s3capture conformance against {bucket_url}/cli on {s3_server.endpoint_url}"
    assert _marks(done.stdout) == {name: "PASS" for name in checks}
    bucket, prefix = split_bucket_url(bucket_url)
    assert list_keys(s3_client, bucket) == [], "the CLI deletes what it wrote"


# aioboto3 only: on the obstore transport an interrupt that lands while the main thread is inside
# object_store's code can skip the running check's clean-up, Ctrl-C and SIGTERM alike (reliability.md).
@pytest.mark.parametrize("transport_kind", ["aioboto3"], indirect=True)
@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
def test_cli_sigterm_cleans_up_as_ctrl_c_does(s3_server, bucket_url, s3_client):
    """A SIGTERM (``timeout``, ``kill``, a pod stop) killed ``conformance`` at once and left a live
    rollout in the user's root (a doctor breaker, 2026-12-03); Ctrl-C cleaned up. SIGTERM now takes
    the Ctrl-C path: every object the run wrote is deleted, exit 143."""
    import signal
    import time

    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3_server.env(), PYTHONPATH=str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", ""))
    bucket, _ = split_bucket_url(bucket_url)
    proc = subprocess.Popen(
        [sys.executable, "-m", "s3capture.cli", "conformance", f"{bucket_url}/term"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not list_keys(s3_client, bucket):  # its first objects: the checks are running
            assert proc.poll() is None and time.monotonic() < deadline, "conformance wrote nothing"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 143, out + err
    assert "s3capture conformance: interrupted by SIGTERM" in err and "Traceback" not in err, err
    assert list_keys(s3_client, bucket) == [], "a SIGTERM left the run's objects behind"


# ---------------------------------------------------------------------------------------- the doc
def _doc_results() -> dict[str, list[str]]:
    text = DOC.read_text()
    table = text.split("<!-- results:begin -->", 1)[1].split("<!-- results:end -->", 1)[0]
    rows = {}
    for line in table.strip().splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        rows[cells[0].strip("`")] = [cell.split()[0] for cell in cells[1:]]
    return rows


def test_doc_results_table_matches_the_pins():
    """docs/conformance.md's results table: every check, s3capture passing, Gym as pinned above."""
    rows = _doc_results()
    assert list(rows) == NAMES
    text = DOC.read_text()
    for name in NAMES:
        assert f"| `{name}` |" in text.split("<!-- results:begin -->")[0], f"{name} missing from the checks table"
    for name, (moto, seaweedfs, gym_file, gym_memory) in rows.items():
        assert moto == seaweedfs == "pass", name
        if name in GYM_LEDGER_SKIPS:
            assert gym_file == gym_memory == "skip", name
            continue
        assert gym_file == ("FAIL" if name in GYM_FILE_STORE_FAILURES else "pass"), name
        if name in GYM_IN_MEMORY_LEDGER_FAILURES:
            assert gym_memory == "FAIL", name
        else:
            assert gym_memory == ("pass" if name in LEDGER_CHECKS else "skip"), name


def test_the_suite_imports_without_aioboto3_botocore_or_gym():
    """A framework can run the suite against its own transport without s3capture's S3 stack."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('aioboto3', 'aiobotocore', 'botocore', 'boto3', 'nemo_gym'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import s3capture.conformance as c, s3capture.ledger_records, s3capture.staging\n"
        "print(len(c.CHECKS))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(REPO / "src")),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(len(NAMES))
