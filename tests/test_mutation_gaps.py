"""Tests written for mutants of ``tools/mutation.py`` that survived every other test.

Each test names the mutant it kills; ``docs/mutation.md`` records the run that found the gap.
"""

from __future__ import annotations

from typing import Any

from faultproxy import ListEmpty, once
from test_faults import outcome
from helpers import assistant_output, list_keys, make_commit, simple_entry, split_bucket_url, system, user
from s3capture.errors import StoreError

GRACE = 0.3
REQ = [system("Be brief."), user("Name a colour.")]


def lists(rollout: str) -> Any:
    return lambda r: r.is_list and f"/rollouts/{rollout}/" in r.params.get("prefix", "")


def always(predicate: Any, action: Any) -> Any:
    async def rule(request: Any) -> Any:
        return action if predicate(request) else None

    return rule


async def test_empty_200_list_is_a_store_error_for_readers_that_require_no_key(
    fresh,
    ledgers,
    proxy,
    s3_client,
    bucket_url,
):
    """Kills ``list-empty-200-is-no-objects``. freeze and drop's decisive LIST require a key they
    have just written, so an empty listing fails them even without the empty-body check; the
    ledger's manifest, retire and delete require nothing, so only ``_verify_page`` stands between an
    empty 200 body and "no objects": an empty manifest, a retire that removes nothing and says
    "absent"."""
    ledger = ledgers()
    await ledger.record(make_commit("q", "call-1", REQ, assistant_output("red")))
    direct = fresh(fence_grace=GRACE)
    await direct.put(simple_entry("r", "c1"))
    via_ledger = ledgers(endpoint_url=proxy.endpoint)
    via = fresh(endpoint_url=proxy.endpoint, fence_grace=GRACE)

    # One empty answer is retried and the result is the real one.
    proxy.rule = once(lists("q"), ListEmpty())
    manifest = await outcome(via_ledger.manifest("q"))
    assert not isinstance(manifest, BaseException), manifest
    assert [r["model_call_id"] for r in manifest["records"]] == ["call-1"], manifest

    # An empty answer every time is a StoreError, never an empty manifest.
    proxy.rule = always(lists("q"), ListEmpty())
    result = await outcome(via_ledger.manifest("q"))
    assert isinstance(result, StoreError), f"an always-empty LIST gave the manifest {result!r}"
    assert "LIST" in str(result)

    # ... and never a retire that removes nothing.
    proxy.rule = always(lists("r"), ListEmpty())
    result = await outcome(via.retire(["r"]))
    assert isinstance(result, StoreError), f"retire on an always-empty LIST returned {result!r}"
    proxy.rule = None
    bucket, root = split_bucket_url(bucket_url)
    assert any("/log/e/" in k for k in list_keys(s3_client, bucket, root + "rollouts/r/")), "the entry of r vanished"
