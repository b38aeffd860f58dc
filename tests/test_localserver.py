"""Sanity checks of the local S3 servers used by the rest of the test suite."""

from __future__ import annotations

import os
import socket
import uuid

import pytest

from s3capture.localserver import (
    CEPH_APT_PACKAGES,
    LocalS3Server,
    ServerUnavailable,
    start_ceph_rgw,
    start_moto,
    start_seaweedfs,
)


def skip_unless_selected(kind: str) -> None:
    selected = os.environ.get("S3CAPTURE_TEST_SERVERS", "").strip()
    if selected and kind not in {p.strip().lower() for p in selected.split(",")}:
        pytest.skip(f"{kind} server not selected (S3CAPTURE_TEST_SERVERS={selected!r})")


def make_boto3_client(server: LocalS3Server, *, secret_key: str | None = None):
    import boto3
    from botocore.config import Config

    config = Config(s3={"addressing_style": "path"}, retries={"mode": "standard"})
    kwargs = server.client_kwargs()
    if secret_key is not None:
        kwargs["aws_secret_access_key"] = secret_key
    return boto3.session.Session().client("s3", config=config, **kwargs)


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
    if s3_server.kind == "external":
        pytest.skip("checks the env() of the servers the suite starts")
    env = s3_server.env()
    assert env == {
        "AWS_ENDPOINT_URL": s3_server.endpoint_url,
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    assert s3_server.endpoint_url.startswith("http://127.0.0.1:")
    assert s3_server.kind in ("moto", "seaweedfs", "ceph")


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
    with pytest.raises(ServerUnavailable, match="SeaweedFS binary .* does not exist"):
        start_seaweedfs(timeout=5, weed=str(tmp_path / "no-such-weed"))


def test_missing_ceph_is_server_unavailable_with_the_install_command(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no Ceph binary on it
    with pytest.raises(ServerUnavailable) as caught:
        start_ceph_rgw(timeout=5)
    message = str(caught.value)
    assert message.startswith("ceph: radosgw, ") and "\n" not in message, message
    assert message.endswith("apt-get install " + " ".join(CEPH_APT_PACKAGES)), message
    assert isinstance(caught.value, RuntimeError)  # callers catching RuntimeError keep working


def _alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_ceph_rgw_starts_serves_and_stops_without_leftovers() -> None:
    """One cluster: a taken monitor port is retried on others; PUT/GET/LIST; stop leaves nothing."""
    skip_unless_selected("ceph")
    from conftest import start_server  # skips without the Debian packages, fails under CI

    with socket.socket() as taken:  # a listener on the monitor's v2 port: the first attempt must move on
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        server = start_server("ceph", ports=(_free_port(), busy, _free_port()))
    with server:
        assert server.kind == "ceph" and server.running
        base, pids = server.data_dir, server.pids
        assert base and os.path.isdir(base) and len(pids) == 3 and all(_alive(pid) for pid in pids)
        client = make_boto3_client(server)
        try:
            bucket = f"s3capture-ceph-{uuid.uuid4().hex[:12]}"
            client.create_bucket(Bucket=bucket)
            client.put_object(Bucket=bucket, Key="dir/a b+c.txt", Body=b"hello ceph")
            assert client.get_object(Bucket=bucket, Key="dir/a b+c.txt")["Body"].read() == b"hello ceph"
            listed = client.list_objects_v2(Bucket=bucket, Prefix="dir/")
            assert [(o["Key"], o["Size"]) for o in listed["Contents"]] == [("dir/a b+c.txt", 10)]
            wrong = make_boto3_client(server, secret_key="wrong")
            try:
                with pytest.raises(wrong.exceptions.ClientError, match="SignatureDoesNotMatch"):
                    wrong.list_buckets()  # a real gateway: signatures are checked
            finally:
                wrong.close()
            server.reset()
            assert client.list_buckets()["Buckets"] == []
        finally:
            client.close()
        server.stop()
        server.stop()  # idempotent
        assert not server.running
        assert _port_closed(server.port)
        assert not [pid for pid in pids if _alive(pid)], "a Ceph daemon survived stop()"
        assert not os.path.exists(base)
    assert server.log_tail() == ""  # the logs went with the base dir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dead_pid() -> int:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_only_old_server_folders_of_dead_processes_on_this_host_are_removed(tmp_path) -> None:
    """The sweep a server start runs: a folder goes only when its starting process is gone, it is
    named for this host and PID namespace, and nothing in it was written for a while."""
    import time

    from s3capture.leftovers import host_tag
    from s3capture.localserver import remove_dead_server_dirs

    def plant(
        pid: int, *, tag: str | None = None, kind: str = "weed", age: float = 3600.0, log_age: float | None = None
    ):
        folder = tmp_path / f"s3capture-{kind}-{tag or host_tag(short=True)}-{pid}-abc123"
        folder.mkdir()
        log = folder / "weed.log"
        log.write_text("log")
        (folder / "data").mkdir()
        (folder / "data" / "volume.dat").write_bytes(b"x" * 10)
        then = time.time() - age
        os.utime(folder, (then, then))
        os.utime(folder / "data", (then, then))
        log_then = time.time() - (age if log_age is None else log_age)
        os.utime(log, (log_then, log_then))
        return folder

    dead = [plant(_dead_pid()), plant(_dead_pid(), kind="ceph")]
    kept = [
        plant(os.getpid()),  # its process is alive
        plant(_dead_pid(), tag="0123456789"),  # another host or PID namespace
        plant(_dead_pid(), age=60.0),  # written a minute ago
        plant(_dead_pid(), log_age=5.0),  # its log written seconds ago
    ]
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / f"s3capture-weed-{host_tag(short=True)}-{_dead_pid()}-link"
    link.symlink_to(target, target_is_directory=True)  # never followed or removed
    plain = tmp_path / f"s3capture-weed-{host_tag(short=True)}-{_dead_pid()}-file"
    plain.write_text("a file, not a server folder")
    assert sorted(remove_dead_server_dirs(str(tmp_path))) == sorted(str(path) for path in dead)
    assert not any(path.exists() for path in dead)
    assert all(path.is_dir() for path in kept) and link.is_symlink() and target.is_dir() and plain.is_file()
    assert remove_dead_server_dirs(str(tmp_path / "no-such-folder")) == []


def test_a_killed_process_s_seaweedfs_folder_is_swept_by_the_next_start(tmp_path) -> None:
    """A process that started SeaweedFS and was killed with SIGKILL left the server's folder (data,
    log, sockets) in the temp folder; the server died with it, and the next sweep removes it."""
    import subprocess
    import sys
    import time

    from s3capture.localserver import remove_dead_server_dirs

    from s3capture.localserver import _find_weed

    skip_unless_selected("seaweedfs")
    try:
        _find_weed()
    except ServerUnavailable as exc:
        pytest.skip(str(exc))
    script = (
        "import os, signal, sys\n"
        "from s3capture.localserver import start_seaweedfs\n"
        "server = start_seaweedfs()\n"
        "print(server.data_dir, server._process.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr
    data_dir, weed_pid = done.stdout.split()
    assert os.path.isdir(data_dir) and os.path.dirname(data_dir) == str(tmp_path)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{weed_pid}") and time.monotonic() < deadline:
        time.sleep(0.1)  # the server dies with its parent (PR_SET_PDEATHSIG)
    assert remove_dead_server_dirs(str(tmp_path)) == []  # just written: kept
    assert remove_dead_server_dirs(str(tmp_path), stale_after=0.0) == [data_dir]
    assert not os.path.exists(data_dir)
