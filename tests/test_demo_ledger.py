"""``s3capture demo --capture ledger``: tokens staged outside the store, token-free ledger rows.

The workload runs in this process (``run_workload(capture="ledger")``, worker processes spawned as
in the command) against the ``s3_server`` fixture on a slice of the Gym example rollouts read from
``../shared/data/gym-example-rollouts`` beside the checkout (never copied; missing, the tests skip, or fail
under ``CI``). Every manifest is also validated here with
NeMo Gym's pydantic ``RolloutManifest`` (``require_gym()``: skipped without Gym, failing under
``CI``). One test runs the installed command on the whole ``anyterminal_hermes.jsonl`` against an
embedded moto server, the acceptance run of the ledger mode.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from typing import Any

from gymcompat import require_gym
from test_demo import _times, example_file

from s3capture.demo import format_report, run_workload
from s3capture.replay import load_rollouts, synthetic_rollouts


def _anyterminal(n: int) -> list[Any]:
    return load_rollouts([example_file("anyterminal_hermes.jsonl")])[:n]


def _bucket(url: str) -> str:
    return url[len("s3://") :].split("/", 1)[0]


def _run(rollouts: list[Any], url: str, server: Any) -> tuple[Any, list[dict]]:
    manifests: list[dict] = []
    report = run_workload(
        rollouts,
        url,
        server.env(),
        workers=2,
        concurrency=8,
        parallel_rollouts=8,
        progress=False,
        capture="ledger",
        manifest_hook=manifests.append,
    )
    return report, manifests


def test_ledger_demo_resolves_every_continuation_and_rebuilds_every_call(s3_env, bucket_url, s3_client):
    gym = require_gym()
    rollouts = _anyterminal(3)
    calls = sum(len(r.calls) for r in rollouts)
    assert all(call.synthetic_tokens for r in rollouts for call in r.calls)  # as the token demo does
    report, manifests = _run(rollouts, bucket_url, s3_env)
    out = format_report(report, where=bucket_url)

    assert report.ok, out
    assert report.statuses["root"] == len(rollouts) and report.statuses["unresolved"] == 0, out
    assert report.faithful_resolved == report.faithful == calls - len(rollouts), out
    assert report.captured == report.calls_rebuilt == calls and not report.rebuild_problems, out
    assert report.manifests_valid == len(rollouts) and report.gym_manifests_valid == len(rollouts), out
    assert report.trainable == len(rollouts) and report.masked == 0 and not report.failures, out
    assert report.retired == len(rollouts) and report.staged_deleted == report.staged_objects == calls, out
    assert 0 < report.ledger_bytes and 0 < report.staged_bytes, out
    assert report.requests["staging:PutObject"] == calls, out
    # Every manifest validates as NeMo Gym's RolloutManifest, and its rows form each rollout's chain.
    by_id = {r.rollout_id: r for r in rollouts}
    assert sorted(m["rollout_id"] for m in manifests) == sorted(by_id)
    for manifest in manifests:
        gym_manifest = gym.staging.records.RolloutManifest.model_validate(manifest)
        assert gym_manifest.model_dump(mode="json") == manifest and not gym_manifest.failures
        rollout = by_id[manifest["rollout_id"]]
        rows = {row.model_call_id: row for row in gym_manifest.records}
        assert set(rows) == {c.model_call_id for c in rollout.calls}
        for call in rollout.calls:
            row = rows[call.model_call_id]
            parent = rollout.calls[call.index - 1] if call.index else None
            assert row.parent_call_id == (parent.model_call_id if parent else None)
            assert row.mode == ("token_in" if parent else "text")
            assert row.cum_len == len(call.prompt_token_ids) + len(call.generation_token_ids)
            assert row.prev_len == (rows[parent.model_call_id].cum_len if parent else 0)
            assert row.staging_key == f"{rollout.rollout_id}/{call.model_call_id}"
            assert row.response_id == f"resp-{call.model_call_id}" and row.output_fingerprint
    for label in (
        "manifests valid: 3/3",
        "rollouts trainable (no failures): 3/3",
        "retired: 3/3",
        f"faithful continuations RESOLVED to the right parent: {calls - 3}/{calls - 3}",
        "ledger bytes:",
        "staged bytes:",
        "result: OK",
    ):
        assert label in out, out
    # The builder retired and deleted the ledgers and deleted the staged deltas: nothing is left.
    assert s3_client.list_objects_v2(Bucket=_bucket(bucket_url)).get("KeyCount", 0) == 0


def test_ledger_demo_records_failure_rows_and_masks_those_rollouts(s3_env, bucket_url, s3_client):
    gym = require_gym()
    rollouts = synthetic_rollouts(3, 4, seed=5)
    # Rollout 0: call 1's prompt does not begin with call 0's tokens -> worker_capture_failed, and
    # call 2's parent (call 1) has no row -> unresolved_parent (so does call 3).
    bad = rollouts[0].calls[1]
    rollouts[0].calls[1] = dataclasses.replace(
        bad, prompt_token_ids=[bad.prompt_token_ids[0] + 1, *bad.prompt_token_ids[1:]]
    )
    # Rollout 1: call 2's request misquotes call 1's answer -> unresolved_parent (call 3 too).
    call = rollouts[1].calls[2]
    request = [dict(item) for item in call.request_items]
    last_assistant = max(i for i, item in enumerate(request) if item.get("role") == "assistant")
    request[last_assistant]["content"] = [{"type": "output_text", "text": "something else entirely"}]
    rollouts[1].calls[2] = dataclasses.replace(call, request_items=request)
    report, manifests = _run(rollouts, bucket_url, s3_env)
    out = format_report(report, where=bucket_url)

    assert not report.ok and "result: FAILED" in out, out
    assert not report.errors, out  # every call was still served
    assert report.failures == {"worker_capture_failed": 1, "unresolved_parent": 4}, out
    # The capture-failed call resolved its parent but its prompt does not extend it: not faithful either.
    assert report.statuses["unresolved"] == 4 and report.faithful_resolved == report.faithful - 5, out
    assert report.trainable == 1 and report.masked == 2, out
    assert report.manifests_valid == report.gym_manifests_valid == 3, out
    assert report.captured == report.calls_rebuilt == 12 - 5 and not report.rebuild_problems, out
    failures = {m["rollout_id"]: {(f["model_call_id"], f["reason"]) for f in m["failures"]} for m in manifests}
    for manifest in manifests:
        gym.staging.records.RolloutManifest.model_validate(manifest)
    r0, r1, r2 = (r.rollout_id for r in rollouts)
    assert failures[r0] == {
        (f"{r0}-c0001", "worker_capture_failed"),
        (f"{r0}-c0002", "unresolved_parent"),
        (f"{r0}-c0003", "unresolved_parent"),
    }
    assert failures[r1] == {(f"{r1}-c0002", "unresolved_parent"), (f"{r1}-c0003", "unresolved_parent")}
    assert failures[r2] == set()
    assert report.retired == 3 and report.staged_deleted == report.staged_objects == 7, out
    assert s3_client.list_objects_v2(Bucket=_bucket(bucket_url)).get("KeyCount", 0) == 0


def test_ledger_demo_command_on_anyterminal_hermes():
    """The acceptance run: the whole file, the installed command, an embedded moto server."""
    anyterminal = example_file("anyterminal_hermes.jsonl")
    require_gym()  # the command then also validates every manifest with Gym's RolloutManifest
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "s3capture.cli",
            "demo",
            "--capture",
            "ledger",
            "--no-progress",
            "--workers",
            "3",
            str(anyterminal),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{out}\n{proc.stderr[-4000:]}"
    assert "embedded moto" in out
    assert "faithful continuations RESOLVED to the right parent: 142/142" in out, out
    assert "ROOT 5, RESOLVED 142, UNRESOLVED 0" in out, out
    assert "manifests valid: 5/5 (NeMo Gym's pydantic RolloutManifest accepts 5/5)" in out, out
    assert "rollouts trainable (no failures): 5/5" in out and "retired: 5/5" in out, out
    assert re.search(r"calls rebuilt from staged deltas .*: 147/147; broken 0", out), out
    assert re.search(r"ledger bytes: [\d,]+ .* staged bytes: [\d,]+", out), out
    assert "result: OK" in out
    # A new user (2026-12-04) followed the closing hint to `demo --keep`, which the ledger refuses.
    assert "--keep" not in proc.stderr, proc.stderr[-2000:]
    _times(out)  # start-up, capture (committed calls) and the builder, each within the total wall time
