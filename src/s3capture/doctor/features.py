"""The request-feature probes of ``s3capture doctor``: Content-MD5 and checksum verification,
botocore's default checksums, MD5 ETags, DeleteObjects, conditional writes, and the measurements
taken along the way (clock skew from ``Date`` headers, latency percentiles)."""

from __future__ import annotations

import base64
import hashlib
import zlib
from typing import Any

from s3capture.doctor.framework import Probe, _code, _DoctorBase, _percentile, _status
from s3capture.transport import gather_settled

SKEW_NOTE = 2.0
"""Seconds of clock skew (server ``Date`` against this machine) above which the skew is noted."""


class _FeatureProbes(_DoctorBase):
    """The probes of request features s3capture uses or deliberately avoids, and the clock-skew
    and latency reports."""

    async def content_md5(self) -> Probe:
        key = self.k("md5/wrong")
        body = b"content-md5 probe"
        wrong = base64.b64encode(hashlib.md5(b"other bytes", usedforsecurity=False).digest()).decode()
        try:
            await self.raw("put_object", Key=key, Body=body, ContentMD5=wrong)
        except Exception as error:  # noqa: BLE001
            code = _code(error)
            if code in ("BadDigest", "InvalidDigest", "400"):
                return Probe(
                    "content-md5",
                    "ok",
                    f"a PUT with a wrong Content-MD5 is refused ({code})",
                    "",
                    {"verified": True, "code": code},
                )
            return Probe(
                "content-md5",
                "note",
                f"a PUT with a wrong Content-MD5 failed with {code or type(error).__name__}",
                "nothing to change: s3capture sends Content-MD5 only with DeleteObjects",
                {"verified": None, "code": code},
            )
        return Probe(
            "content-md5",
            "note",
            "a PUT with a wrong Content-MD5 is accepted (not verified)",
            "nothing to change: s3capture does not rely on it; readers check every entry's SHA-256 (in its "
            "key) and GET bodies against MD5 ETags",
            {"verified": False},
        )

    async def checksum_headers(self) -> Probe:
        key = self.k("crc/wrong")
        body = b"checksum probe"
        right = zlib.crc32(body)
        wrong = base64.b64encode(((right ^ 0xFFFFFFFF) & 0xFFFFFFFF).to_bytes(4, "big")).decode()
        try:
            await self.raw("put_object", Key=key, Body=body, ChecksumCRC32=wrong)
        except Exception as error:  # noqa: BLE001
            code = _code(error)
            if code in ("BadDigest", "InvalidDigest", "InvalidRequest", "XAmzContentChecksumMismatch", "400"):
                return Probe(
                    "checksum-headers",
                    "ok",
                    f"a PUT with a wrong x-amz-checksum-crc32 is refused ({code})",
                    "",
                    {"verified": True, "code": code},
                )
            return Probe(
                "checksum-headers",
                "note",
                f"a PUT with a wrong x-amz-checksum-crc32 failed with {code or type(error).__name__}",
                "nothing to change: s3capture sends no x-amz-checksum-* headers",
                {"verified": None, "code": code},
            )
        return Probe(
            "checksum-headers",
            "note",
            "a PUT with a wrong x-amz-checksum-crc32 is accepted (header ignored)",
            "nothing to change: s3capture sends no x-amz-checksum-* headers (request_checksum_calculation="
            "'when_required') and checks bodies itself",
            {"verified": False},
        )

    async def default_checksums(self) -> Probe:
        key = self.k("crc/default")
        body = b"default checksum probe" * 10
        try:
            async with self.extra_client() as client:
                await client.put_object(Bucket=self.bucket, Key=key, Body=body)
                got = await client.get_object(Bucket=self.bucket, Key=key)
                async with got["Body"] as stream:
                    data = await stream.read()
        except Exception as error:  # noqa: BLE001
            code = _code(error) or type(error).__name__
            return Probe(
                "default-checksums",
                "note",
                f"a PUT or GET with botocore's default flexible checksums (request_checksum_calculation='when_supported') fails: {code}",
                "keep request_checksum_calculation='when_required' and response_checksum_validation="
                "'when_required' (s3capture's default_botocore_config); a botocore_config of your own must "
                "set them too",
                {"accepted": False, "code": code},
            )
        if data != body:
            return Probe(
                "default-checksums",
                "note",
                "an object PUT with botocore's default flexible checksums reads back with other bytes "
                "(e.g. the aws-chunked framing was stored)",
                "keep request_checksum_calculation='when_required' (s3capture's default_botocore_config); "
                "a botocore_config of your own must set it too",
                {"accepted": True, "intact": False},
            )
        return Probe(
            "default-checksums",
            "ok",
            "botocore's default flexible checksums (request_checksum_calculation='when_supported': a CRC32 with each PUT, checked on GET) are accepted",
            "",
            {"accepted": True, "intact": True},
        )

    async def etag_md5(self) -> Probe:
        key = self.k("etag/x")
        body = b"etag probe " * 7
        response = await self.raw("put_object", Key=key, Body=body)
        etag = str(response.get("ETag", "")).strip('"').lower()
        md5 = hashlib.md5(body, usedforsecurity=False).hexdigest()
        head = await self.raw("head_object", Key=key)
        etag_head = str(head.get("ETag", "")).strip('"').lower()
        data = {"etag": etag, "md5": md5, "head_etag": etag_head}
        if etag == md5 and etag_head == md5:
            return Probe("etag-md5", "ok", "a single-part object's ETag is the MD5 of its bytes", "", data)
        if len(etag_head) == 32 and all(c in "0123456789abcdef" for c in etag_head):
            return Probe(
                "etag-md5",
                "note",
                f"ETag {etag_head} looks like an MD5 but is not the MD5 of the bytes",
                "every GET is read twice before its bytes are trusted (the transport re-reads a body that "
                "does not match an MD5-shaped ETag); disable SSE-KMS/SSE-C or any ETag rewriting if you can",
                data,
            )
        return Probe(
            "etag-md5",
            "note",
            f"ETag {etag_head!r} is not an MD5",
            "nothing to change: GET bodies are then checked by length only (entries still by SHA-256)",
            data,
        )

    async def delete_objects(self) -> Probe:
        from botocore.exceptions import ClientError

        base = self.k("del/")
        keys = [f"{base}{i}" for i in range(3)]
        await gather_settled(self.t.put(k, b"d") for k in keys)
        data: dict[str, Any] = {}
        try:
            response = await self.raw(
                "delete_objects",
                # Not quiet, as s3capture sends it: a key the answer does not confirm deleted goes
                # out again as a single DELETE (a doctor breaker found a quiet probe failing a store
                # whose DeleteObjects answers 200 without deleting, where s3capture works).
                Delete={"Objects": [{"Key": k} for k in keys] + [{"Key": base + "never"}], "Quiet": False},
            )
        except ClientError as error:
            code = _code(error)
            data = {"supported": False, "code": code}
            await self.t.delete(keys)  # the transport's own fallback
            fallback = "s3capture falls back to one DELETE per key (retire, delete and drop send more requests)"
            advice = (
                f"{fallback}; to keep the batches, grant s3:DeleteObject on the bucket's ARN too "
                "(arn:aws:s3:::BUCKET: the Ceph gateway checks DeleteObjects against it; docs/permissions.md)"
                if code == "AccessDenied"
                else f"nothing to change: {fallback}"
            )
            return Probe("delete-objects", "note", f"DeleteObjects is refused ({code})", advice, data)
        errors = list(response.get("Errors", ()) or ())
        confirmed = {item.get("Key") for item in response.get("Deleted", ()) or ()}

        async def still_there() -> tuple[list[str], list[str]]:
            left = [k for k in await self.raw_list(base) if k in keys]
            readable = []
            for k in keys:
                try:
                    await self.raw("head_object", Key=k)
                except ClientError as error:
                    if _status(error) == 404 or _code(error) in ("404", "NoSuchKey", "NotFound"):
                        continue
                    raise
                readable.append(k)
            return left, readable

        left, readable = await still_there()
        lied = sorted(set(keys) & confirmed & (set(left) | set(readable)))  # said deleted, still there
        data = {
            "supported": True,
            "errors": [dict(e) for e in errors],
            "confirmed": len(confirmed & set(keys)),
            "listed_after": len(left),
            "readable_after": len(readable),
        }
        if lied:
            return Probe(
                "delete-objects",
                "fail",
                f"DeleteObjects confirmed {len(lied)} keys deleted that were still there after it",
                "s3capture trusts a DeleteObjects answer's Deleted list (a retire and a delete must leave "
                "nothing under a rollout): use a store whose DeleteObjects deletes what it confirms",
                data,
            )
        if left or readable or errors:
            # What s3capture does with keys the answer did not confirm: one DELETE each.
            await self.t.delete(keys)
            left, readable = await still_there()
            data["after_fallback"] = {"listed": len(left), "readable": len(readable)}
            if left or readable:
                return Probe(
                    "delete-objects",
                    "fail",
                    f"neither DeleteObjects nor single DELETEs removed {len(set(left) | set(readable))} keys",
                    "s3capture's delete and retire must leave nothing under a rollout: use a store whose "
                    "deletes delete (a missing key is not an error)",
                    data,
                )
            return Probe(
                "delete-objects",
                "note",
                f"DeleteObjects left {len(keys) - data['confirmed']} of {len(keys)} keys unconfirmed "
                f"({len(errors)} errors in its answer); one DELETE each removed them",
                "nothing to change: s3capture sends the keys a DeleteObjects answer does not confirm again "
                "as single DELETEs (retire, delete and drop send more requests)",
                data,
            )
        return Probe(
            "delete-objects",
            "ok",
            "DeleteObjects (with Content-MD5) deletes every key at once; a missing key is no error; the "
            "keys are gone from the next LIST and GET",
            "",
            data,
        )

    async def conditional_write(self) -> Probe:
        key = self.k("cond/x")
        try:
            await self.raw("put_object", Key=key, Body=b"first", IfNoneMatch="*")
        except Exception as error:  # noqa: BLE001
            code = _code(error) or type(error).__name__
            return Probe(
                "conditional-write",
                "note",
                f"a PUT with If-None-Match: * on a new key is refused ({code})",
                "nothing to change: s3capture never uses conditional writes",
                {"supported": False, "code": code},
            )
        try:
            await self.raw("put_object", Key=key, Body=b"second", IfNoneMatch="*")
        except Exception as error:  # noqa: BLE001
            code = _code(error) or type(error).__name__
            if _status(error) == 412 or code == "PreconditionFailed":
                return Probe(
                    "conditional-write",
                    "ok",
                    "If-None-Match: * on PUT is honoured (412 on an existing key); s3capture does not use it",
                    "",
                    {"supported": True, "code": code},
                )
            return Probe(
                "conditional-write",
                "note",
                f"a second PUT with If-None-Match: * failed with {code}, not 412",
                "nothing to change: s3capture never uses conditional writes",
                {"supported": None, "code": code},
            )
        return Probe(
            "conditional-write",
            "note",
            "If-None-Match: * on PUT is ignored (a second PUT overwrote the object)",
            "nothing to change: s3capture never uses conditional writes (no compare-and-swap is assumed)",
            {"supported": False},
        )

    def clock_skew(self) -> Probe:
        if not self.dates:
            return Probe(
                "clock-skew",
                "note",
                "the store sent no Date header",
                "nothing to change for capture; s3capture export --min-age compares object LastModified "
                "with this machine's clock",
                {"samples": 0},
            )
        # The server's time at its answer is in [Date, Date + 1) (1 s resolution), ours in [t0, t1].
        low = max(date - t1 for t0, t1, date in self.dates)
        high = min(date + 1.0 - t0 for t0, t1, date in self.dates)
        if low > high:  # inconsistent samples (a server rounding its Date): the median, to the second
            mids = sorted(date + 0.5 - (t0 + t1) / 2 for t0, t1, date in self.dates)
            low, high = mids[len(mids) // 2] - 0.5, mids[len(mids) // 2] + 0.5
        skew = (low + high) / 2
        bound = (high - low) / 2
        data = {"skew_seconds": round(skew, 3), "uncertainty_seconds": round(bound, 3), "samples": len(self.dates)}
        detail = f"server Date {skew:+.1f} s (±{bound:.1f} s) from this machine's clock, over {len(self.dates)} answers"
        if abs(skew) - bound > SKEW_NOTE:
            return Probe(
                "clock-skew",
                "note",
                detail,
                "capture never compares two clocks; s3capture export --min-age compares object LastModified "
                "(server clock) with this machine's clock: sync the clocks (NTP) or raise --min-age well "
                "above the skew. SigV4 refuses requests beyond 15 minutes of skew",
                data,
            )
        return Probe("clock-skew", "ok", detail, "", data)

    def latency_probe(self) -> Probe:
        data: dict[str, Any] = {}
        parts = []
        for what, values in self.latency.items():
            p = {f"p{q}": round(_percentile(values, q / 100) * 1000, 2) for q in (50, 90, 99)}
            data[what] = {**p, "samples": len(values)}
            parts.append(f"{what} p50 {p['p50']:.1f} / p90 {p['p90']:.1f} / p99 {p['p99']:.1f} ms")
        data["transport"] = self.t.name
        detail = "; ".join(parts) + f" (n={self.samples}, sequential, small objects, {self.t.name} transport)"
        return Probe("latency", "ok", detail, "", data)
