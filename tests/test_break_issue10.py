"""Adversarial review of issue 10 (ops gc/ls/status, the s3:// export claim, doctor, serve, the
Gym registry, ``--masked skip`` supersedes, obstore settle). Each test shows one defect."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from s3capture.errors import StoreError

MOTO = pytest.mark.parametrize("s3_server", ["moto"], indirect=True)


@MOTO
async def test_a_renewal_that_lands_after_a_takeover_does_not_resurrect_the_claim(
    fresh: Any, bucket_url: str, s3_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An export paused between its renewal's GET (claim still there) and its PUT for longer than
    the lease is taken over: the next export sees the claim stale, deletes it and proceeds. The
    paused export then resumes, its PUT re-creates the deleted claim and resets ``_renewed``, so
    ``check_held`` passes and both exports hold the prefix (and drop) at once. ``_renew`` never
    asks whether the time since its previous renewal already exceeded ``CLAIM_HOLD``. Found by
    reading ``_S3Destination._renew`` (GET, then an unconditional PUT); a process pause (SIGSTOP,
    a VM pause, a put stuck in retries) between the two is enough. Fix: after the PUT, treat the
    claim as lost when ``time.monotonic() - self._renewed`` (the previous renewal) exceeds
    ``CLAIM_HOLD``."""
    import s3capture.export as export_module

    monkeypatch.setattr(export_module, "CLAIM_RENEW", 0.05)
    monkeypatch.setattr(export_module, "CLAIM_HOLD", 0.5)
    monkeypatch.setattr(export_module, "CLAIM_LEASE", 1.0)
    bucket = bucket_url[len("s3://"):].split("/")[0]
    dest = f"s3://{bucket}/exports-claim"
    first = export_module._S3Destination(dest, endpoint_url=None, transport=None)
    second = export_module._S3Destination(dest, endpoint_url=None, transport=None)
    taken_over = asyncio.Event()
    paused = asyncio.Event()
    real_put = first.transport.put

    async def put_after_pause(key: str, body: bytes, *args: Any, **kwargs: Any) -> Any:
        if key == getattr(first, "_claim", None) and not taken_over.is_set():
            paused.set()  # the renewal's GET found the claim; the process stalls before its PUT
            await taken_over.wait()
        return await real_put(key, body, *args, **kwargs)

    try:
        await first.lock()
        first.transport.put = put_after_pause  # type: ignore[method-assign]
        await asyncio.wait_for(paused.wait(), 10)
        await asyncio.sleep(2.2)  # longer than the lease by the store's clock (1 s LastModified resolution)
        await second.lock()  # the first's claim is stale: taken over (and deleted)
        taken_over.set()
        for _ in range(40):  # the paused renewal resumes and lands its PUT
            await asyncio.sleep(0.05)
        with pytest.raises(StoreError, match="no longer hold"):
            first.check_held()  # two exports must never both hold one prefix
    finally:
        await first.close()
        await second.close()
