"""Sanity checks of the local S3 servers used by the rest of the test suite."""

from __future__ import annotations

import os
import socket
import uuid

import pytest

from s3capture.localserver import LocalS3Server, start_moto, start_seaweedfs


def skip_unless_selected(kind: str) -> None:
    selected = os.environ.get("S3CAPTURE_TEST_SERVERS", "").strip()
    if selected and kind not in {p.strip().lower() for p in selected.split(",")}:
        pytest.skip(f"{kind} server not selected (S3CAPTURE_TEST_SERVERS={selected!r})")


def make_boto3_client(server: LocalS3Server):
    import boto3
    from botocore.config import Config

    config = Config(s3={"addressing_style": "path"}, retries={"mode": "standard"})
    return boto3.session.Session().client("s3", config=config, **server.client_kwargs())


def test_bucket_put_get_list(s3_server: LocalS3Server, s3_client) -> None:
    bucket = f"s3capture-sanity-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=bucket)
    try:
        s3_client.put_object(Bucket=bucket, Key="dir/hello.txt", Body=b"hello world")
        got = s3_client.get_object(Bucket=bucket, Key="dir/hello.txt")
        assert got["Body"].read() == b"hello world"
        listed = s3_client.list_objects_v2(Bucket=bucket, Prefix="dir/")
        assert [(o["Key"], o["Size"]) for o in listed["Contents"]] == [("dir/hello.txt", 11)]
        assert bucket in {b["Name"] for b in s3_client.list_buckets()["Buckets"]}
    finally:
        s3_client.delete_object(Bucket=bucket, Key="dir/hello.txt")
        s3_client.delete_bucket(Bucket=bucket)


def test_fixtures_point_sdk_at_server(s3_env: LocalS3Server, bucket_url: str) -> None:
    import boto3
    from botocore.config import Config

    assert os.environ["AWS_ENDPOINT_URL"] == s3_env.endpoint_url
    assert bucket_url.startswith("s3://") and bucket_url.endswith("/t")
    bucket = bucket_url[len("s3://") :].split("/", 1)[0]
    # No explicit endpoint or credentials: everything comes from the environment.
    client = boto3.session.Session().client("s3", config=Config(s3={"addressing_style": "path"}))
    try:
        client.put_object(Bucket=bucket, Key="t/x", Body=b"1")
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="t/")["Contents"]]
        assert keys == ["t/x"]
    finally:
        client.close()


def test_env_shape(s3_server: LocalS3Server) -> None:
    env = s3_server.env()
    assert env == {
        "AWS_ENDPOINT_URL": s3_server.endpoint_url,
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    assert s3_server.endpoint_url.startswith("http://127.0.0.1:")
    assert s3_server.kind in ("moto", "seaweedfs")


def _port_closed(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return False
    except OSError:
        return True


@pytest.mark.parametrize("kind", ["moto", "seaweedfs"])
def test_stop_is_idempotent_and_closes_port(kind: str) -> None:
    skip_unless_selected(kind)
    start = start_moto if kind == "moto" else start_seaweedfs
    with start() as server:
        assert server.running
        assert not _port_closed(server.port)
        data_dir = server.data_dir
        server.stop()
        server.stop()  # idempotent
        assert not server.running
        assert _port_closed(server.port)
        if kind == "seaweedfs":
            assert data_dir and not os.path.exists(data_dir)
    server.stop()  # also after __exit__


def test_moto_reset_wipes_state() -> None:
    skip_unless_selected("moto")
    with start_moto() as server:
        client = make_boto3_client(server)
        try:
            client.create_bucket(Bucket="s3capture-reset")
            server.reset()
            assert client.list_buckets()["Buckets"] == []
        finally:
            client.close()
    with pytest.raises(RuntimeError):
        server.reset()  # stopped


def test_missing_weed_binary_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="SeaweedFS binary .* does not exist"):
        start_seaweedfs(timeout=5, weed=str(tmp_path / "no-such-weed"))
