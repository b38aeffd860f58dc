"""NeMo Gym's YAML route to s3capture, and one install registry shared with Gym.

The ``token_id_capture`` blocks are read from README.md (``<!-- example:gym-yaml -->`` and
``<!-- example:gym-yaml-ledger -->``), so the documented class paths and kwargs are the ones tested:
Gym's own ``token_id_capture_config(...).build_sink()`` / ``build_lineage_store()`` build the stores,
which then put, resolve, freeze and record against a real local S3 server. The registry tests need
no server; the no-Gym case runs in a subprocess with ``nemo_gym`` hidden.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from gymcompat import require_gym
from helpers import (
    assistant_output,
    build_conversation,
    continuation,
    gym_entry,
    make_commit,
    next_request,
    system,
    turn_entry,
    user,
)

REPO = Path(__file__).resolve().parents[1]
README_URL = "s3://my-bucket/capture/run-42"


def readme_block(name: str, bucket_url: str) -> dict:
    """The README's YAML block ``name`` as Gym's global config dict, pointed at ``bucket_url``."""
    import yaml

    text = (REPO / "README.md").read_text()
    match = re.search(rf"<!-- example:{name} -->\n```yaml\n(.*?)```", text, re.S)
    assert match, f"README.md has no YAML example {name!r}"
    assert README_URL in match.group(1)
    return yaml.safe_load(match.group(1).replace(README_URL, bucket_url))


def _rid() -> str:
    return f"yaml-{uuid.uuid4().hex[:8]}"


# --------------------------------------------------------------------------------- YAML, on S3
async def test_readme_yaml_block_builds_working_token_stores_through_gym(s3_env, bucket_url):
    require_gym()
    from nemo_gym.token_id_capture import LineageResolver, TokenSink, TokenSource
    from nemo_gym.token_id_capture.config import token_id_capture_config

    from s3capture.protocols import TokenCaptureFrozenError
    from s3capture.store import S3TokenStore

    config = token_id_capture_config(readme_block("gym-yaml", bucket_url))
    assert config.enabled and config.token_id_capture.delta_records
    sink = config.build_sink()
    lineage = config.build_lineage_store()
    source = S3TokenStore(bucket_url, entry_type="gym")  # the consumer builds its own, as Gym's docs say
    try:
        assert type(sink) is S3TokenStore and type(lineage) is S3TokenStore and sink is not lineage
        assert sink.url == lineage.url == bucket_url
        assert isinstance(sink, TokenSink) and isinstance(lineage, LineageResolver) and isinstance(source, TokenSource)
        assert lineage.is_process_shared()

        rid = _rid()
        turns = build_conversation(rid, 3)
        await sink.put(gym_entry(turn_entry(rid, turns[0])))
        # The lineage store (another client) sees the sink's entry as soon as put returned.
        resolution = await lineage.resolve(rid, next_request(turns[0]))
        assert resolution.status.value == "resolved"
        assert resolution.match.model_call_id == turns[0].call_id
        assert list(resolution.match.cumulative_token_ids) == turns[0].cumulative
        for before, turn in zip(turns, turns[1:]):  # delta_records: prompts stored after the parent's tokens
            await sink.put(gym_entry(turn_entry(rid, turn, delta=True, parent_cumulative=before.cumulative)))
        snapshot = await source.freeze(rid)
        assert not snapshot.incomplete
        by_id = {entry.model_call_id: entry for entry in snapshot.entries}
        assert sorted(by_id) == [turn.call_id for turn in turns]
        for parent, turn in zip([None, *turns], turns):
            entry = by_id[turn.call_id]
            assert type(entry).__module__ == "nemo_gym.token_id_capture.records"
            assert entry.prompt_is_delta is (parent is not None)  # stored and handed back as Gym's delta
            head = parent.cumulative if parent is not None else []
            assert head + list(entry.prompt_token_ids) == turn.prompt
        # A write after the freeze is refused, as the protocol asks (late records are dropped).
        late = build_conversation(rid, 4)[3]
        with pytest.raises(TokenCaptureFrozenError):
            await sink.put(gym_entry(turn_entry(rid, late, delta=True, parent_cumulative=turns[2].cumulative)))
    finally:
        for store in (sink, lineage, source):
            await store.close()


async def test_readme_ledger_block_builds_a_working_capture_ledger_through_gym(s3_env, bucket_url):
    require_gym()
    from nemo_gym.token_id_capture import CaptureLedger
    from nemo_gym.token_id_capture.config import token_id_capture_config

    from s3capture.ledger import S3CaptureLedger

    config = token_id_capture_config(readme_block("gym-yaml-ledger", bucket_url))
    assert config.token_id_capture.external_staging and config.build_sink() is None
    ledger = config.build_lineage_store()
    reader = S3CaptureLedger(bucket_url)
    try:
        assert type(ledger) is S3CaptureLedger and isinstance(ledger, CaptureLedger)
        rid = _rid()
        request = [system("terse"), user("2+2?")]
        first = make_commit(rid, "call-1", request, assistant_output("4"))
        await ledger.record(first)
        second = make_commit(rid, "call-2", continuation(first), assistant_output("8"), parent=first)
        resolution = await reader.resolve(rid, continuation(first))
        assert resolution.status.value == "resolved" and resolution.match.model_call_id == "call-1"
        await ledger.record(second)
        manifest = await reader.manifest(rid)
        assert sorted(row["model_call_id"] for row in manifest["records"]) == ["call-1", "call-2"]
        assert not manifest["failures"]
        assert await reader.has_rows(rid)
    finally:
        await ledger.close()
        await reader.close()


async def test_gyms_external_staging_admits_calls_on_the_ledgers_own_answers(s3_env, bucket_url):
    """``S3CaptureLedger.resolve`` answers with s3capture's types (docs/gym.md): Gym's
    ``resolve_parent`` with external staging turns them into its ``CaptureAdmission`` (``token_in``
    after the proven parent, ``text`` for a root) without a warning, and an unresolvable
    continuation of a rollout that has rows into a failure row, not an admission."""
    import warnings

    require_gym()
    from nemo_gym.token_id_capture.config import token_id_capture_config
    from nemo_gym.token_id_capture.sink import CaptureContext, reset_token_sink, resolve_parent, set_token_sink

    ledger = token_id_capture_config(readme_block("gym-yaml-ledger", bucket_url)).build_lineage_store()
    rid = _rid()
    first = make_commit(rid, "call-1", [system("terse"), user("2+2?")], assistant_output("4"))

    async def admit(call_id: str, request: list[dict]) -> Any:
        context = CaptureContext(rollout_id=rid, model_call_id=call_id, token_sink=None, external_staging=True)
        context.lineage_store = ledger
        token = set_token_sink(context)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                await resolve_parent(request)
        finally:
            reset_token_sink(token)
        return context.capture_admission

    try:
        root = await admit("call-1", [system("terse"), user("2+2?")])
        assert (root.mode, root.parent_call_id) == ("text", None)
        await ledger.record(first)
        child = await admit("call-2", continuation(first))
        assert (child.mode, child.parent_call_id) == ("token_in", "call-1")
        assert child.prev_len == first["record"]["cum_len"] and child.staging_chain == first["staging_chain"]
        assert await admit("call-3", [system("terse"), user("2+2?"), *assistant_output("5"), user("?")]) is None
        manifest = await ledger.manifest(rid)
        assert [f["model_call_id"] for f in manifest["failures"]] == ["call-3"]
    finally:
        await ledger.close()


# --------------------------------------------------------------------------------- no server
def test_gym_names_a_wrong_sink_kwarg():
    require_gym()
    from nemo_gym.token_id_capture.config import token_id_capture_config

    block = readme_block("gym-yaml", "s3://b/p")
    block["token_id_capture"]["sink_kwargs"]["bucket"] = "b"
    with pytest.raises(ValueError, match="could not construct token_id_capture.sink.*bucket"):
        token_id_capture_config(block).build_sink()


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = dict(os.environ, PYTHONPATH=str(REPO / "src"), **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=environ)


_BUILD = """
from nemo_gym.token_id_capture.config import token_id_capture_config
cfg = {"token_id_capture": {"enabled": True, "sink": "s3capture.store:S3TokenStore",
       "sink_kwargs": {"url": "s3://b/p"}, "lineage_store": "s3capture.store:S3TokenStore",
       "lineage_store_kwargs": {"url": "s3://b/p"}}}
config = token_id_capture_config(cfg)
def build():
    try:
        return f"{type(config.build_sink()).__name__} {type(config.build_lineage_store()).__name__}"
    except Exception as error:
        return f"{type(error).__name__} {error}"
print(build())  # S3CAPTURE_NO_PROTOCOL_SHIM=1: importing s3capture left typing alone
from s3capture import gym_compat
assert gym_compat.install_protocol_attrs_shim()
print(build())
"""


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="typing has __protocol_attrs__ from Python 3.12")
def test_gym_build_sink_needs_the_shim_on_python_311():
    require_gym()
    done = _run(_BUILD, S3CAPTURE_NO_PROTOCOL_SHIM="1")
    assert done.returncode == 0, done.stderr[-2000:]
    without, shimmed = done.stdout.splitlines()
    assert without.startswith("AttributeError") and "__protocol_attrs__" in without
    assert shimmed == "S3TokenStore S3TokenStore"


def test_shim_matches_the_members_python_checks():
    require_gym()
    import typing

    from nemo_gym.token_id_capture import CaptureLedger, LineageResolver, TokenSink, TokenSource

    import s3capture  # noqa: F401 - applies the shim on 3.11

    assert TokenSink.__protocol_attrs__ == {"put", "mark_incomplete", "close"}
    assert TokenSource.__protocol_attrs__ == {"freeze", "drop", "close"}
    assert LineageResolver.__protocol_attrs__ == {"resolve", "is_process_shared", "close"}
    assert CaptureLedger.__protocol_attrs__ >= {"record", "record_failure", "manifest", "has_rows", "resolve"}
    assert not hasattr(int, "__protocol_attrs__")  # only protocol classes have it, as on 3.12

    class Local(typing.Protocol):
        def only(self) -> None: ...

    assert Local.__protocol_attrs__ == {"only"}


# --------------------------------------------------------------------------------- one registry
class _Sink:
    async def put(self, entry): ...

    async def mark_incomplete(self, rollout_id, model_call_id=""): ...

    async def close(self): ...


@pytest.fixture
def restore_registry():
    import s3capture

    saved = (s3capture.installed_token_sink(), s3capture.installed_token_source(), s3capture.installed_lineage_store())
    yield
    s3capture.install_token_sink(saved[0])
    s3capture.install_token_source(saved[1])
    s3capture.install_lineage_store(saved[2])


def test_installing_through_s3capture_installs_into_gym(restore_registry):
    gym = require_gym()
    import s3capture

    sink, source, lineage = _Sink(), object(), object()
    s3capture.install_token_sink(sink)
    s3capture.install_token_source(source)  # type: ignore[arg-type]
    s3capture.install_lineage_store(lineage)  # type: ignore[arg-type]
    assert gym.installed_token_sink() is sink
    assert gym.installed_token_source() is source
    assert gym.installed_lineage_store() is lineage
    s3capture.install_token_sink(None)
    assert gym.installed_token_sink() is None and s3capture.installed_token_sink() is None


def test_installing_through_gym_is_what_s3capture_sees(restore_registry):
    gym = require_gym()
    import s3capture

    sink, source, lineage = _Sink(), object(), object()
    gym.install_token_sink(sink)
    gym.install_token_source(source)
    gym.install_lineage_store(lineage)
    assert s3capture.installed_token_sink() is sink
    assert s3capture.installed_token_source() is source
    assert s3capture.installed_lineage_store() is lineage
    gym.install_lineage_store(None)
    assert s3capture.installed_lineage_store() is None


def test_a_refused_sink_leaves_gym_registry_unchanged(restore_registry):
    gym = require_gym()
    import s3capture

    sink = _Sink()
    s3capture.install_token_sink(sink)
    with pytest.raises(TypeError, match="mark_incomplete"):
        s3capture.install_token_sink(type("NoMark", (), {"put": _Sink.put, "close": _Sink.close})())
    assert gym.installed_token_sink() is sink


_NO_GYM = """
import sys
sys.modules["nemo_gym"] = None  # `import nemo_gym...` raises ImportError: Gym is hidden
import typing
import s3capture
from s3capture import protocols
class Sink:
    async def put(self, entry): ...
    async def mark_incomplete(self, rollout_id, model_call_id=""): ...
    async def close(self): ...
sink, source, lineage = Sink(), object(), object()
s3capture.install_token_sink(sink); s3capture.install_token_source(source); s3capture.install_lineage_store(lineage)
assert protocols.gym_registry() is None
assert s3capture.installed_token_sink() is sink and protocols._INSTALLED_SINK is sink
assert s3capture.installed_token_source() is source and s3capture.installed_lineage_store() is lineage
try:
    s3capture.install_token_sink(object())
except TypeError:
    pass
else:
    raise SystemExit("an object without put was installed")
s3capture.install_token_sink(None)
assert s3capture.installed_token_sink() is None
assert not any(name == "nemo_gym" or name.startswith("nemo_gym.") for name in sys.modules if sys.modules[name] is not None)
print("ok")
# Gym appears later in the process: what s3capture's own registry held moves into Gym's.
s3capture.install_token_sink(sink)
del sys.modules["nemo_gym"]
import importlib.util
if importlib.util.find_spec("nemo_gym") is not None:
    from nemo_gym.token_id_capture import installed_token_sink as gym_installed
    assert s3capture.installed_token_sink() is sink and gym_installed() is sink
    assert protocols._INSTALLED_SINK is None and protocols.gym_registry() is not None
    print("moved")
"""


def test_without_gym_s3capture_keeps_its_own_registry():
    import importlib.util

    done = _run(_NO_GYM)
    assert done.returncode == 0, done.stderr[-2000:]
    # The second half (Gym appearing later) runs where Gym is installed.
    assert done.stdout.split() == (["ok", "moved"] if importlib.util.find_spec("nemo_gym") else ["ok"])
