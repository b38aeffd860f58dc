"""NeMo Gym 0.7.0's own conformance suite against s3capture over real S3 HTTP endpoints.

Every factory call builds a fresh ``S3TokenStore`` (a fresh HTTP client and empty caches), so the
suite's cross-client visibility checks are real. Under CI a missing ``nemo_gym`` fails the test.
"""

from __future__ import annotations

import uuid

from gymcompat import require_gym

import pytest

from s3capture.store import S3TokenStore

pytestmark = pytest.mark.all_transports  # every test runs on aioboto3 and obstore (tests/conftest.py)

GYM_CHECKS = {
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
}


async def test_gym_conformance_suite_passes_all_ten_checks(s3_env, bucket_url):
    require_gym()
    from nemo_gym.token_id_capture import LineageResolver, TokenSink, TokenSource
    from nemo_gym.token_id_capture.conformance import run_conformance

    made: list[S3TokenStore] = []

    def factory() -> S3TokenStore:
        store = S3TokenStore(bucket_url, entry_type="gym")
        made.append(store)
        return store

    passed = await run_conformance(factory, factory, factory, rollout_id=f"gym-{uuid.uuid4().hex[:8]}")
    assert set(passed) == GYM_CHECKS, f"missing checks: {GYM_CHECKS - set(passed)}"
    assert len(made) >= 15, "the suite must have been given a fresh client per factory call"
    assert len({id(store) for store in made}) == len(made)
    probe = made[0]
    assert isinstance(probe, TokenSink) and isinstance(probe, TokenSource) and isinstance(probe, LineageResolver)
