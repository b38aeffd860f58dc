"""The read-only snapshot path: ``S3TokenStore.read_snapshot`` and read-only credentials.

``read_snapshot`` must give exactly what ``freeze`` gives (entries, version, snapshot id,
incomplete, reasons) for clean, delta, conflicting, dangling-intent and marked rollouts, with GET
and LIST requests only, and refuse (``SnapshotNotSealedError``) when asked for a sealed snapshot of
an open or changed rollout. The exporter's acceptance check runs on servers that enforce
permissions: SeaweedFS (its own server, started with a read-only identity) and the Ceph gateway (a
second user whose bucket policy grants only ``s3:GetObject`` and ``s3:ListBucket``). With those
credentials ``rollouts`` and ``read_snapshot`` work and every write is refused with ``StoreError``
(AccessDenied), leaving the bucket unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from typing import Any

import pytest

from conftest import delete_bucket_quietly, make_boto3_client, start_server
from helpers import (
    RequestRecorder,
    assistant_output,
    build_conversation,
    gym_entry,
    list_keys,
    make_commit,
    put_bytes,
    put_chain,
    require_gym,
    simple_entry,
    split_bucket_url,
    turn_entry,
    user,
)
from s3capture.errors import SnapshotNotSealedError, StoreError
from s3capture.layout import Layout
from s3capture.ledger import S3CaptureLedger
from s3capture.protocols import TokenCaptureFrozenError, TokenCaptureRetiredError
from s3capture.records import coerce_entry, encode_entry
from s3capture.store import S3TokenStore


def assert_same(got: Any, want: Any) -> None:
    """Field by field: the same rollout, version, snapshot id, incomplete flag, reasons and entries."""
    assert (got.rollout_id, got.version, got.snapshot_id, got.incomplete, got.reasons) == (
        want.rollout_id,
        want.version,
        want.snapshot_id,
        want.incomplete,
        want.reasons,
    )
    key = lambda e: e.model_call_id  # noqa: E731 - order carries no meaning
    assert [encode_entry(coerce_entry(e)) for e in sorted(got.entries, key=key)] == [
        encode_entry(coerce_entry(e)) for e in sorted(want.entries, key=key)
    ]


async def write_scenario(kind: str, writer: S3TokenStore, rid: str) -> None:
    if kind == "clean":
        for turn in build_conversation(rid, 3):
            await writer.put(turn_entry(rid, turn))
    elif kind == "delta":
        await put_chain(writer, rid, 4)
    elif kind == "conflicting":
        await writer.put(simple_entry(rid, "c1", text="one"))
        await writer.put(simple_entry(rid, "c1", text="two"))
        await writer.put(simple_entry(rid, "c2"))
    elif kind == "dangling_intent":
        await writer.put(simple_entry(rid, "c1"))
        await writer.begin_call(rid, "c2")
    elif kind == "marked":
        await writer.put(simple_entry(rid, "c1"))
        await writer.mark_incomplete(rid, "c2")
    else:  # pragma: no cover
        raise AssertionError(kind)


EXPECTED_REASONS = {
    "clean": (),
    "delta": (),
    "conflicting": ("conflicting_payloads:c1",),
    "dangling_intent": ("dangling_intent:c2",),
    "marked": ("marked_incomplete:c2",),
}


@pytest.mark.all_transports
@pytest.mark.parametrize("kind", list(EXPECTED_REASONS))
async def test_read_snapshot_equals_freeze(fresh: Any, kind: str) -> None:
    writer, builder = fresh(), fresh()
    await write_scenario(kind, writer, "r")
    frozen = await builder.freeze("r")
    assert frozen.reasons == EXPECTED_REASONS[kind]
    scan = await fresh()._scan("r")
    listed_entries = sum(1 for kind, _, _, _ in scan.parsed if kind == "e")
    reader = fresh()  # cold cache: every entry is read from the store
    recorder = await RequestRecorder.attach(reader)
    sealed = await reader.read_snapshot("r")
    assert_same(sealed, frozen)
    counts = recorder.counts()
    assert set(counts) == {"ListObjectsV2", "GetObject"}, counts
    assert counts["GetObject"] == listed_entries + 1  # each listed entry once, and the manifest
    assert_same(await reader.read_snapshot("r", sealed=False), frozen)  # warm: entries from the cache
    assert_same(await builder.read_snapshot("r"), frozen)  # the builder's own cache, lent entries
    assert set(recorder.counts()) == {"ListObjectsV2", "GetObject"}


async def test_read_snapshot_respects_entry_type_gym(fresh: Any) -> None:
    require_gym()
    writer = fresh()
    await write_scenario("clean", writer, "g")
    frozen = await fresh(entry_type="gym").freeze("g")
    got = await fresh(entry_type="gym").read_snapshot("g")
    assert type(got.entries[0]) is type(frozen.entries[0]) is type(gym_entry(simple_entry("x", "y")))
    assert sorted(e.model_dump_json() for e in got.entries) == sorted(e.model_dump_json() for e in frozen.entries)
    assert (got.version, got.snapshot_id, got.incomplete, got.reasons) == (
        frozen.version,
        frozen.snapshot_id,
        frozen.incomplete,
        frozen.reasons,
    )


async def test_open_and_changed_rollouts_are_not_sealed(fresh: Any, s3_client: Any, bucket_url: str) -> None:
    writer, builder, reader = fresh(), fresh(), fresh()
    # An id with nothing stored (a typo) is told apart from an open rollout (a new user's walkthrough).
    with pytest.raises(SnapshotNotSealedError, match="has no objects under .*never written, or deleted"):
        await reader.read_snapshot("r")
    await writer.put(simple_entry("r", "c1"))
    layout = Layout(split_bucket_url(bucket_url)[1].rstrip("/"))
    with pytest.raises(SnapshotNotSealedError, match="is open") as caught:
        await reader.read_snapshot("r")
    assert caught.value.state == "open" and caught.value.key.startswith(layout.rollout("r") + "snap/")
    unsealed = await reader.read_snapshot("r", sealed=False)  # the snapshot a freeze would give
    frozen = await builder.freeze("r")
    assert_same(unsealed, frozen)
    assert_same(await reader.read_snapshot("r"), frozen)

    # A write after the freeze: the sealed manifest no longer describes the rollout.
    with pytest.raises(TokenCaptureFrozenError):
        await writer.put(simple_entry("r", "c2"))
    with pytest.raises(SnapshotNotSealedError, match="changed since its freeze") as caught:
        await reader.read_snapshot("r")
    assert caught.value.state == "changed"
    assert isinstance(caught.value, StoreError)
    changed = await reader.read_snapshot("r", sealed=False)
    assert changed.version == frozen.version + 1 and len(changed.entries) == 2
    assert_same(changed, await builder.freeze("r"))  # a new freeze seals exactly that state
    assert_same(await reader.read_snapshot("r"), changed)

    # A fence without any manifest (a freeze that stopped after its fence PUT).
    bucket = split_bucket_url(bucket_url)[0]
    await writer.put(simple_entry("half", "c1"))
    put_bytes(s3_client, bucket, layout.rollout("half") + "fence", b'{"format":"s3capture.fence/1","state":"frozen"}')
    with pytest.raises(SnapshotNotSealedError, match="did not finish"):
        await reader.read_snapshot("half")


async def test_retired_rollouts_raise(fresh: Any) -> None:
    writer, builder, reader = fresh(), fresh(fence_grace=0.0), fresh()
    await writer.put(simple_entry("r", "c1"))
    snapshot = await builder.freeze("r")
    assert await builder.drop("r", snapshot.snapshot_id, snapshot.version)
    for sealed in (True, False):
        with pytest.raises(TokenCaptureRetiredError):
            await reader.read_snapshot("r", sealed=sealed)


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda m: b"not json", "not an s3capture manifest"),
        (lambda m: {**m, "format": "other/1"}, "format"),
        (lambda m: {**m, "rollout_id": "another"}, "names rollout 'another'"),
        (lambda m: {**m, "snapshot_id": "0" * 32}, "names version"),
        (lambda m: {**m, "objects": m["objects"][:-1]}, "object keys"),
    ],
    ids=["not-json", "format", "rollout", "snapshot", "objects"],
)
async def test_a_damaged_or_foreign_manifest_is_a_store_error(
    fresh: Any, s3_client: Any, bucket_url: str, damage: Any, problem: str
) -> None:
    writer, builder = fresh(), fresh()
    await writer.put(simple_entry("r", "c1"))
    await writer.put(simple_entry("r", "c2"))
    frozen = await builder.freeze("r")
    bucket, root = split_bucket_url(bucket_url)
    key = f"{Layout(root.rstrip('/')).rollout('r')}snap/{frozen.version:020d}-{frozen.snapshot_id}"
    manifest = json.loads(s3_client.get_object(Bucket=bucket, Key=key)["Body"].read())
    assert manifest["rollout_id"] == "r" and len(manifest["objects"]) == 2
    damaged = damage(manifest)
    put_bytes(s3_client, bucket, key, damaged if isinstance(damaged, bytes) else json.dumps(damaged).encode())
    with pytest.raises(StoreError, match=problem) as caught:
        await fresh().read_snapshot("r")
    assert not isinstance(caught.value, SnapshotNotSealedError)
    assert caught.value.key == key and key in str(caught.value)
    assert_same(await fresh().read_snapshot("r", sealed=False), frozen)  # the listing alone still reads
    if problem != "format":  # a damaged manifest (not one of another format): the remedy the error gives works
        assert "delete that object and freeze the rollout again" in str(caught.value)
        s3_client.delete_object(Bucket=bucket, Key=key)
        assert_same(await fresh().freeze("r"), frozen)
        assert_same(await fresh().read_snapshot("r"), frozen)


async def test_read_snapshot_leaves_freeze_bookkeeping_alone(fresh: Any) -> None:
    client = fresh()
    await client.put(simple_entry("w", "c1"))  # remembers the call's key
    await client.put(simple_entry("f", "c1"))
    frozen = await client.freeze("f")
    call_keys = client._call_keys.get(("w", "c1"))
    fence_seen = dict(client._fence_seen)
    assert call_keys and fence_seen["f"][1:] == (frozen.version, frozen.snapshot_id)
    await client.read_snapshot("w", sealed=False)
    await client.read_snapshot("f")
    assert client._call_keys.get(("w", "c1")) == call_keys
    assert dict(client._fence_seen) == fence_seen


# --------------------------------------------------------------------------- read-only credentials
READER_KEY = "s3capture-reader-access"
READER_SECRET = "s3capture-reader-secret"


def _ceph_user(s3_server: Any, uid: str, access: str, secret: str) -> None:
    """A second user of the test Ceph gateway (``radosgw-admin user create``)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CEPH_ARGS", "CEPH_CONF", "CEPH_KEYRING", "PYTHONHOME", "PYTHONPATH")
    }
    subprocess.run(
        ["radosgw-admin", "-c", os.path.join(s3_server.data_dir, "ceph.conf"), "user", "create", f"--uid={uid}",
         f"--display-name={uid}", f"--access-key={access}", f"--secret-key={secret}"],
        check=True, capture_output=True, env=env, cwd=s3_server.data_dir, timeout=60,
    )  # fmt: skip


@pytest.fixture
def read_only(s3_server: Any, s3_client: Any, bucket_url: str, s3_env: Any) -> Any:
    """``(endpoint, admin keys, reader keys, url)``: a bucket whose reader may only GET and LIST."""
    if s3_server.kind == "seaweedfs":
        # A server of its own: identities are server-wide, and the suite's server has none.
        bucket = f"s3capture-ro-{uuid.uuid4().hex[:16]}"
        reader = {
            "name": "reader",
            "credentials": [{"accessKey": READER_KEY, "secretKey": READER_SECRET}],
            "actions": [f"Read:{bucket}", f"List:{bucket}"],
        }
        server = start_server("seaweedfs", identities=[reader])
        client = make_boto3_client(server)
        try:
            client.create_bucket(Bucket=bucket)
            yield (
                server.endpoint_url,
                (server.access_key, server.secret_key),
                (READER_KEY, READER_SECRET),
                f"s3://{bucket}/t",
            )
        finally:
            delete_bucket_quietly(client, bucket)
            client.close()
            server.stop()
    elif s3_server.kind == "ceph":
        uid = f"reader-{uuid.uuid4().hex[:12]}"
        access = f"{READER_KEY}-{uid}"
        _ceph_user(s3_server, uid, access, READER_SECRET)
        bucket = split_bucket_url(bucket_url)[0]
        policy = {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Effect": "Allow",
                    "Principal": {"AWS": [f"arn:aws:iam:::user/{uid}"]},
                    "Action": ["s3:GetObject", "s3:ListBucket"],
                    "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"],
                }
            ],
        }
        s3_client.put_bucket_policy(Bucket=bucket, Policy=json.dumps(policy))
        yield s3_server.endpoint_url, (s3_server.access_key, s3_server.secret_key), (access, READER_SECRET), bucket_url
    else:
        pytest.skip(f"{s3_server.kind} does not enforce per-user permissions")


async def test_a_read_only_exporter_lists_and_reads_frozen_rollouts(read_only: Any) -> None:
    import aioboto3

    endpoint, admin_keys, reader_keys, url = read_only

    def session(keys: tuple[str, str]) -> Any:
        return aioboto3.Session(aws_access_key_id=keys[0], aws_secret_access_key=keys[1], region_name="us-east-1")

    writer = S3TokenStore(url, endpoint_url=endpoint, session=session(admin_keys))
    ledger = S3CaptureLedger(url, endpoint_url=endpoint, session=session(admin_keys))
    reader = S3TokenStore(url, endpoint_url=endpoint, session=session(reader_keys), fence_grace=0.0)
    reader_ledger = S3CaptureLedger(url, endpoint_url=endpoint, session=session(reader_keys))
    try:
        for turn in build_conversation("done", 3):
            await writer.put(turn_entry("done", turn))
        frozen = await writer.freeze("done")
        await writer.put(simple_entry("open", "c1"))
        await ledger.record(make_commit("led", "c1", [user("hi")], assistant_output("yo")))

        infos = {info.rollout_id: info async for info in reader.rollouts()}
        assert {rid: (i.state, i.sealed) for rid, i in infos.items() if rid != "led"} == {
            "done": ("frozen", True),
            "open": ("open", False),
        }
        assert (infos["done"].version, infos["done"].snapshot_id) == (frozen.version, frozen.snapshot_id)
        # The ledger counts its own objects; the token store's fenced rollout still shows its fence.
        by_ledger = {i.rollout_id: (i.state, i.objects) async for i in reader_ledger.rollouts()}
        assert by_ledger == {"done": ("frozen", 0), "led": ("open", 2)}
        assert_same(await reader.read_snapshot("done"), frozen)
        assert len((await reader.read_snapshot("open", sealed=False)).entries) == 1
        with pytest.raises(SnapshotNotSealedError):
            await reader.read_snapshot("open")

        bucket = url[len("s3://") :].split("/", 1)[0]
        keys_before = await writer._list("")
        refused = {
            "put": lambda: reader.put(simple_entry("open", "c2")),
            "begin_call": lambda: reader.begin_call("open", "c3"),
            "mark_incomplete": lambda: reader.mark_incomplete("open", "c4"),
            "freeze": lambda: reader.freeze("open"),
            "drop": lambda: reader.drop("done", frozen.snapshot_id, frozen.version),
            "retire": lambda: reader.retire(["done"]),
            "delete": lambda: reader.delete(["open"]),
            "ledger.record": lambda: reader_ledger.record(make_commit("led", "c2", [user("x")], assistant_output("z"))),
        }
        for name, operation in refused.items():
            with pytest.raises(StoreError, match="AccessDenied") as caught:
                await operation()
            assert caught.value.operation in ("PUT", "DELETE", "DeleteObjects"), (name, caught.value)
        assert await writer._list("") == keys_before, f"a refused write changed s3://{bucket}"
        assert_same(await reader.read_snapshot("done"), frozen)  # still sealed: nothing changed
    finally:
        for client in (writer, ledger, reader, reader_ledger):
            await client.close()


@pytest.mark.all_transports
async def test_the_documented_builder_role_drops_retires_and_deletes_on_the_ceph_gateway(
    s3_server: Any, s3_client: Any, bucket_url: str, transport_kind: str, caplog: Any
) -> None:
    """The Builders policy of docs/permissions.md, granted to a second Ceph user by a bucket policy
    as its Ceph section says (object actions on ``BUCKET/ROOT/*`` only). The gateway checks a
    DeleteObjects request against the bucket's ARN, so every drop, retire and delete of such a
    builder failed after writing its tombstone (a Ceph breaker, 2026-12-03); they now fall back to
    single DELETEs, which the gateway checks against each key."""
    if s3_server.kind != "ceph":
        pytest.skip("only the Ceph gateway enforces bucket policies among the test servers")
    import aioboto3

    uid = f"builder-{uuid.uuid4().hex[:12]}"
    access, secret = f"s3capture-builder-{uid}", "s3capture-builder-secret"
    _ceph_user(s3_server, uid, access, secret)
    bucket, root = split_bucket_url(bucket_url)
    root = root.strip("/")
    principal = {"AWS": [f"arn:aws:iam:::user/{uid}"]}
    policy = {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Principal": principal,
                "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
                "Resource": f"arn:aws:s3:::{bucket}/{root}/*",
            },
            {
                "Effect": "Allow",
                "Principal": principal,
                "Action": "s3:ListBucket",
                "Resource": f"arn:aws:s3:::{bucket}",
            },
        ],
    }
    s3_client.put_bucket_policy(Bucket=bucket, Policy=json.dumps(policy))
    session = aioboto3.Session(aws_access_key_id=access, aws_secret_access_key=secret, region_name="us-east-1")
    builder = S3TokenStore(bucket_url, endpoint_url=s3_server.endpoint_url, session=session)
    layout = Layout(root)
    try:
        for rid in ("dropped", "retired", "deleted"):
            for turn in build_conversation(rid, 2):
                await builder.put(turn_entry(rid, turn))
        frozen = await builder.freeze("dropped")
        with caplog.at_level("WARNING", logger="s3capture"):
            assert await builder.drop("dropped", frozen.snapshot_id, frozen.version)
        assert (await builder.retire(["retired"]))["removed"] == ["retired"]
        assert (await builder.delete(["deleted"]))["removed"] == ["deleted"]
        left = {
            rid: sorted(k.rsplit("/", 1)[-1] for k in list_keys(s3_client, bucket, layout.rollout(rid)))
            for rid in ("dropped", "retired", "deleted")
        }
        assert left == {"dropped": ["fence", "retired"], "retired": ["fence", "retired"], "deleted": []}
        assert any("AccessDenied" in m and "one DELETE per key" in m for m in caplog.messages)
    finally:
        await builder.close()
        s3_client.delete_bucket_policy(Bucket=bucket)
