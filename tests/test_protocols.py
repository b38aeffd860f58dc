"""Protocols, errors, install functions and Gym protocol compatibility (no S3 requests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gymcompat import INSTALL, require_gym

import s3capture
from s3capture.protocols import (
    CaptureLedger,
    LineageMatch,
    LineageResolution,
    LineageResolver,
    RolloutRetiredError,
    TokenCaptureFrozenError,
    TokenCaptureRetiredError,
    TokenCaptureSnapshot,
    TokenSink,
    TokenSource,
    install_lineage_store,
    install_token_sink,
    install_token_source,
    installed_lineage_store,
    installed_token_sink,
    installed_token_source,
)
from s3capture.records import ParentResolutionStatus

ROOT = Path(__file__).resolve().parent.parent
MATCH = LineageMatch(model_call_id="c1", cumulative_token_ids=(1, 2, 3), digest="d")


@pytest.fixture(autouse=True)
def _restore_installed():
    """Install functions keep process-wide state: put it back after every test."""
    saved = (installed_token_sink(), installed_token_source(), installed_lineage_store())
    yield
    # Through the install functions: with Gym importable the registry is Gym's, not these globals.
    install_token_sink(saved[0])
    install_token_source(saved[1])
    install_lineage_store(saved[2])


# ---------------------------------------------------------------------------------------------
# LineageResolution
# ---------------------------------------------------------------------------------------------


def test_resolved_requires_a_match() -> None:
    with pytest.raises(ValueError, match="match"):
        LineageResolution(ParentResolutionStatus.RESOLVED)
    with pytest.raises(ValueError):
        LineageResolution(ParentResolutionStatus.RESOLVED, None, "no parent")
    resolved = LineageResolution(ParentResolutionStatus.RESOLVED, MATCH, "ok")
    assert resolved.match is MATCH and resolved.reason == "ok"


@pytest.mark.parametrize("status", [ParentResolutionStatus.ROOT, ParentResolutionStatus.UNRESOLVED])
def test_root_and_unresolved_cannot_carry_a_match(status: ParentResolutionStatus) -> None:
    with pytest.raises(ValueError, match=status.value):
        LineageResolution(status, MATCH)
    plain = LineageResolution(status, reason="why")
    assert plain.match is None and plain.status is status


def test_lineage_resolution_accepts_plain_string_statuses() -> None:
    """Gym's StrEnum compares equal to its value; a plain string status is validated the same way."""
    with pytest.raises(ValueError):
        LineageResolution("resolved")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        LineageResolution("root", MATCH)  # type: ignore[arg-type]
    assert LineageResolution("resolved", MATCH).match is MATCH  # type: ignore[arg-type]


def test_lineage_resolution_and_snapshot_are_immutable() -> None:
    resolution = LineageResolution(ParentResolutionStatus.ROOT)
    with pytest.raises(AttributeError):
        resolution.match = MATCH  # type: ignore[misc]
    snapshot = TokenCaptureSnapshot("r", (), False, "s", 0)
    with pytest.raises(AttributeError):
        snapshot.version = 1  # type: ignore[misc]
    assert MATCH.staging_chain == () and MATCH.prev_len == 0 and MATCH.chain_hash == ""


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_error_hierarchy() -> None:
    assert issubclass(TokenCaptureFrozenError, RuntimeError)
    assert issubclass(TokenCaptureRetiredError, TokenCaptureFrozenError)
    assert issubclass(TokenCaptureRetiredError, RuntimeError)
    assert issubclass(RolloutRetiredError, LookupError)
    assert not issubclass(RolloutRetiredError, RuntimeError)
    assert not issubclass(TokenCaptureFrozenError, LookupError)
    # A caller that handles "frozen" handles "retired" exactly like it.
    with pytest.raises(TokenCaptureFrozenError):
        raise TokenCaptureRetiredError("late write after retire")
    assert s3capture.TokenCaptureRetiredError is TokenCaptureRetiredError
    assert s3capture.RolloutRetiredError is RolloutRetiredError


# ---------------------------------------------------------------------------------------------
# Install functions
# ---------------------------------------------------------------------------------------------


class _Sink:
    async def put(self, entry) -> None: ...

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None: ...

    async def close(self) -> None: ...


@pytest.mark.parametrize("missing", ["put", "mark_incomplete", "close"])
def test_install_token_sink_refuses_an_incomplete_sink(missing: str) -> None:
    methods = {name: (lambda self, *a: None) for name in ("put", "mark_incomplete", "close") if name != missing}
    partial = type("Partial", (), methods)()
    install_token_sink(None)
    with pytest.raises(TypeError, match=missing):
        install_token_sink(partial)
    assert installed_token_sink() is None  # nothing was installed


def test_install_token_sink_refuses_non_callable_attributes() -> None:
    class Attr:
        put = "not callable"
        mark_incomplete = close = staticmethod(lambda *a: None)

    with pytest.raises(TypeError, match="put"):
        install_token_sink(Attr())
    with pytest.raises(TypeError):
        install_token_sink(object())


def test_install_and_clear() -> None:
    sink, source, store = _Sink(), object(), object()
    install_token_sink(sink)
    install_token_source(source)  # type: ignore[arg-type]
    install_lineage_store(store)  # type: ignore[arg-type]
    assert installed_token_sink() is sink
    assert installed_token_source() is source
    assert installed_lineage_store() is store
    install_token_sink(None)
    install_token_source(None)
    install_lineage_store(None)
    assert installed_token_sink() is None and installed_token_source() is None and installed_lineage_store() is None


def test_protocols_check_method_presence() -> None:
    assert isinstance(_Sink(), TokenSink)
    assert not isinstance(object(), TokenSink)
    assert not isinstance(_Sink(), TokenSource)
    assert not isinstance(_Sink(), LineageResolver)


def test_protocols_module_does_not_import_the_s3_stack() -> None:
    code = (
        "import sys\n"
        "import s3capture.protocols, s3capture.records, s3capture.fingerprint, s3capture.layout\n"
        "import s3capture\n"
        "bad = [m for m in ('aioboto3', 'botocore', 'aiobotocore', 'boto3') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# ---------------------------------------------------------------------------------------------
# S3TokenStore without requests
# ---------------------------------------------------------------------------------------------


def _store(url: str = "s3://bucket/prefix"):
    from s3capture.store import S3TokenStore

    return S3TokenStore(url)


def test_s3_token_store_satisfies_s3capture_protocols_without_a_request() -> None:
    store = _store()
    assert isinstance(store, TokenSink)
    assert isinstance(store, TokenSource)
    assert isinstance(store, LineageResolver)
    assert store.bucket == "bucket"
    assert store.layout.rollout("r") == "prefix/rollouts/r/"
    assert not store.request_counts  # construction sent nothing
    assert store._client is None
    assert s3capture.S3TokenStore is type(store)  # lazy attribute of the package
    assert not isinstance(store, CaptureLedger)  # it does not claim the staged-ledger protocol


def test_s3_token_store_satisfies_gym_protocols_and_installs_with_gym() -> None:
    gym = require_gym()
    store = _store()
    assert isinstance(store, gym.TokenSink)
    assert isinstance(store, gym.TokenSource)
    assert isinstance(store, gym.LineageResolver)
    saved = gym.installed_token_sink(), gym.installed_token_source(), gym.installed_lineage_store()
    try:
        gym.install_token_sink(store)
        gym.install_token_source(store)
        gym.install_lineage_store(store)
        assert gym.installed_token_sink() is store
        assert gym.installed_token_source() is store
        assert gym.installed_lineage_store() is store
    finally:
        gym.install_token_sink(saved[0])
        gym.install_token_source(saved[1])
        gym.install_lineage_store(saved[2])
    assert not store.request_counts


def test_s3capture_install_accepts_the_store() -> None:
    store = _store()
    install_token_sink(store)
    assert installed_token_sink() is store


@pytest.mark.parametrize(
    "url",
    [
        "http://x",
        "https://bucket/prefix",
        "s3://",
        "s3:///prefix",
        "bucket/prefix",
        "",
        "s3://bucket/p?x=1",
        "s3://bucket/p#frag",
        "s3://bucket/a//b",
    ],
)
def test_s3_token_store_refuses_bad_urls(url: str) -> None:
    with pytest.raises(ValueError):
        _store(url)


def test_s3_token_store_accepts_bucket_only_and_nested_prefixes() -> None:
    assert _store("s3://bucket").layout.rollout("r") == "rollouts/r/"
    assert _store("s3://bucket/").layout.rollout("r") == "rollouts/r/"
    assert _store("s3://bucket/a/b/").layout.rollout("r") == "a/b/rollouts/r/"


# ---------------------------------------------------------------------------------------------
# gymcompat.require_gym itself
# ---------------------------------------------------------------------------------------------


def _hide_gym(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "nemo_gym" or m.startswith("nemo_gym.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "nemo_gym", None)  # makes `import nemo_gym...` raise ImportError


def test_require_gym_skips_without_gym_locally(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide_gym(monkeypatch)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception) as info:
        require_gym()
    assert "nemo-gym==0.7.0" in str(info.value)


@pytest.mark.parametrize("value", ["true", "1", "True"])
def test_require_gym_fails_without_gym_under_ci(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    _hide_gym(monkeypatch)
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.fail.Exception) as info:
        require_gym()
    assert INSTALL in str(info.value)
    assert "--no-deps --ignore-requires-python nemo-gym==0.7.0" in str(info.value)


@pytest.mark.parametrize("value", ["", "false", "0"])
def test_require_gym_treats_false_ci_values_as_local(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    _hide_gym(monkeypatch)
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.skip.Exception):
        require_gym()


def test_require_gym_returns_the_module_when_installed() -> None:
    gym = require_gym()
    assert gym.__name__ == "nemo_gym.token_id_capture"
    assert hasattr(gym, "TokenEntry") and hasattr(gym, "install_token_sink")
