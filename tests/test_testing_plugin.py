"""The pytest plugin ``s3capture.testing``: its fixtures, its entry point and the README example.

Each scenario runs pytest in a subprocess in a temporary directory (no access to this repository's
conftest or pytest settings, so pytest-asyncio is in its default strict mode, as for most users).
The plugin is found through a ``pytest11`` entry point of a stand-in distribution put on
``PYTHONPATH`` (the same mechanism an installed s3capture uses), not through ``-p``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from conftest import skip_unless_selected
from s3capture import testing

ROOT = Path(__file__).resolve().parents[1]
SRC = str(ROOT / "src")


def _site_with_entry_point(tmp_path: Path) -> Path:
    """A directory holding a stand-in distribution that declares the plugin's entry point as
    pyproject.toml does."""
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["pytest11"]
    site = tmp_path / "site"
    info = site / "s3capture_plugin_standin-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: s3capture-plugin-standin\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[pytest11]\n" + "".join(f"{k} = {v}\n" for k, v in entry.items()))
    return site


def _run_pytest(tmp_path: Path, files: dict[str, str], *args: str, env: dict[str, str] | None = None):
    work = tmp_path / "user"
    work.mkdir()
    for name, text in files.items():
        (work / name).write_text(textwrap.dedent(text))
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PYTEST_", "S3CAPTURE_"))}
    run_env["PYTHONPATH"] = os.pathsep.join([SRC, str(_site_with_entry_point(tmp_path))])
    run_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
        cwd=work, capture_output=True, text=True, timeout=300, env=run_env, check=False,
    )  # fmt: skip


def _counts(output: str) -> dict[str, int]:
    last = output.strip().splitlines()[-1]
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", last)}


def test_pyproject_registers_the_plugin_for_pytest():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["pytest11"] == {"s3capture": "s3capture.testing"}
    assert any(req.startswith("moto") for req in project["optional-dependencies"]["local"])


FIXTURE_TESTS = """
import os

import boto3
import pytest

from s3capture import localserver
from s3capture.records import TokenEntry

seen = {}


def test_loading_the_plugin_starts_nothing():
    assert not localserver._live_servers


def test_env_and_a_fresh_bucket(s3capture_server, s3capture_endpoint, s3capture_env, s3capture_bucket, s3capture_url):
    assert s3capture_server.kind == "moto" and s3capture_server.running
    assert os.environ["AWS_ENDPOINT_URL"] == s3capture_endpoint == s3capture_env["AWS_ENDPOINT_URL"]
    assert "AWS_PROFILE" not in os.environ and "AWS_ENDPOINT_URL_S3" not in os.environ
    assert s3capture_url == f"s3://{s3capture_bucket}/test"
    client = boto3.client("s3", **s3capture_server.client_kwargs())
    assert client.list_objects_v2(Bucket=s3capture_bucket)["KeyCount"] == 0
    client.put_object(Bucket=s3capture_bucket, Key="test/x", Body=b"1")
    seen["bucket"], seen["server"] = s3capture_bucket, s3capture_server


@pytest.mark.asyncio
async def test_store(s3capture_store, s3capture_bucket, s3capture_server):
    assert s3capture_server is seen["server"]  # one server per session
    assert s3capture_bucket != seen["bucket"]  # a fresh bucket per test
    client = boto3.client("s3", **s3capture_server.client_kwargs())
    assert seen["bucket"] not in [b["Name"] for b in client.list_buckets()["Buckets"]]  # deleted after its test
    entry = TokenEntry(rollout_id="r", model_call_id="c", prompt_token_ids=[1], generation_token_ids=[2],
                       generation_log_probs=[-1.0])
    await s3capture_store.put(entry)
    assert (await s3capture_store.freeze("r")).entries[0].prompt_token_ids == [1]
    seen["store"] = s3capture_store


@pytest.mark.asyncio
async def test_ledger(s3capture_ledger, s3capture_url):
    assert seen["store"].transport.closed  # the previous test's store was closed after it
    await s3capture_ledger.begin_call("r", "c")
    assert [info.rollout_id async for info in s3capture_ledger.rollouts("open")] == ["r"]
"""


def _readme_example() -> str:
    readme = (ROOT / "README.md").read_text()
    example = re.search(r"<!-- s3capture-testing-example -->\n```python\n(.*?)```", readme, re.DOTALL)
    assert example, "README.md lost its s3capture-testing-example block"
    return example.group(1)


def test_fixtures_and_the_readme_example_in_a_user_session(tmp_path):
    # One pytest session (one server start): the README's example as is, and the fixtures' contract,
    # with a user's AWS_PROFILE and AWS_ENDPOINT_URL_S3 set (they must not reach any client).
    skip_unless_selected("moto")
    proc = _run_pytest(
        tmp_path,
        {"test_fixtures.py": FIXTURE_TESTS, "test_readme_example.py": _readme_example()},
        "-rA",
        env={"AWS_PROFILE": "nobody", "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9"},
    )
    assert _counts(proc.stdout) == {"passed": 5}, proc.stdout + proc.stderr
    assert "PASSED test_readme_example.py::test_put_then_freeze" in proc.stdout, proc.stdout


def test_missing_moto_skips_with_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "moto", None)  # importlib.util.find_spec("moto") is then None
    with pytest.raises(pytest.skip.Exception, match=re.escape("pip install 's3capture[local]'")):
        testing._start_server("moto")


def test_server_choice_option_env_and_typo(monkeypatch, request):
    monkeypatch.delenv(testing.ENV_VAR, raising=False)
    assert testing._chosen_kind(request.config) == "moto"
    monkeypatch.setenv(testing.ENV_VAR, " SeaweedFS ")
    assert testing._chosen_kind(request.config) == "seaweedfs"
    monkeypatch.setenv(testing.ENV_VAR, "minio")
    with pytest.raises(pytest.fail.Exception, match="S3CAPTURE_PYTEST_SERVER='minio': unknown server"):
        testing._chosen_kind(request.config)
