"""Running ``s3capture doctor``: ``_Doctor`` (the probes of every theme), ``diagnose`` (the probes
in report order, then the clean-up), the pre-flight request and the ``doctor`` subcommand
(``register``)."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from s3capture.doctor.consistency import ORDER_KEYS, _ConsistencyProbes
from s3capture.doctor.features import _FeatureProbes
from s3capture.doctor.framework import DoctorReport, Probe, format_report
from s3capture.doctor.keys import _KeyProbes
from s3capture.errors import StoreError, install_hint
from s3capture.layout import Layout
from s3capture.rollouts import parse_s3_url
from s3capture.transport import TRANSPORT_ENV, TRANSPORTS, Transport, make_transport


class _Doctor(_ConsistencyProbes, _KeyProbes, _FeatureProbes):
    """One run: the state and plumbing of ``_DoctorBase`` and the probes of every theme."""


async def diagnose(
    url: str,
    *,
    endpoint_url: str | None = None,
    session: Any = None,
    samples: int = 20,
    transport: str | None = None,
) -> DoctorReport:
    """Probe the store of ``url`` (``s3://bucket[/prefix]``) and return a ``DoctorReport``.

    Writes small throwaway objects under ``<prefix>/_s3capture-doctor-<uuid>/`` only, and deletes
    them all before returning (the ``cleanup`` probe fails, and ``left_behind`` names them, when a
    final listing still shows some). ``samples`` (1 to 1,000) is the number of PUT/GET/LIST
    requests timed for the latency percentiles (the whole run sends about 4 x ``samples`` + 120
    requests). ``endpoint_url``: the S3 endpoint (``None``: AWS S3, or ``AWS_ENDPOINT_URL``);
    ``session``: an ``aioboto3.Session`` (``None``: the standard credential chain).
    ``transport``: the transport probed, ``"aioboto3"`` or ``"obstore"`` (``None``:
    ``S3CAPTURE_TRANSPORT``, else ``"aioboto3"``): the timed PUT/GET/LIST/DELETE and the
    ``transport-keys`` probe go through it, raw requests through an aioboto3 transport's client.

    Raises ``ValueError`` for a bad URL (one inside a root's ``rollouts/`` included), sample count
    or transport name, ``ImportError`` (with the
    install command) for ``"obstore"`` without obstore, and ``StoreError`` (one line) when the store
    cannot be used at all: a missing bucket, refused credentials, an unreachable endpoint, or a
    refused PUT (no write permission).
    """
    bucket, prefix = parse_s3_url(url)
    if "rollouts" in prefix.split("/"):
        # Its probe objects would be foreign objects of a live rollout (masking a freeze that
        # lists them, failing a drop) or of a root nested in another's rollouts.
        raise ValueError(
            f"{url} lies inside a root's rollouts (a 'rollouts' path segment): probe the root itself, "
            "or a prefix beside it"
        )
    Layout(prefix)  # ValueError for a prefix no store accepts ('//', '.' or '..' segments, ...), as every command
    if not isinstance(samples, int) or not 1 <= samples <= 1000:
        raise ValueError(f"samples must be an integer from 1 to 1000, got {samples!r}")
    root = f"{prefix}/" if prefix else ""
    probe_root = f"{root}_s3capture-doctor-{uuid.uuid4().hex[:12]}/"
    if session is None:
        import aioboto3

        session = aioboto3.Session()
    probed = make_transport(transport, bucket, endpoint_url=endpoint_url, session=session, max_concurrency=16)
    if probed.name == "aioboto3":
        raw = probed
    else:
        raw = make_transport("aioboto3", bucket, endpoint_url=endpoint_url, session=session, max_concurrency=16)

    def extra_client(attempts: int = 2, connect_timeout: float = 5) -> Any:
        """A separate aiobotocore client with botocore's default (flexible) checksums."""
        from botocore.config import Config

        settings: dict[str, Any] = {
            "retries": {"mode": "standard", "max_attempts": attempts},
            "connect_timeout": connect_timeout,
            "read_timeout": 30,
            "request_checksum_calculation": "when_supported",  # botocore's own default, not s3capture's
            "response_checksum_validation": "when_supported",
        }
        if endpoint_url:
            settings["s3"] = {"addressing_style": "path"}
        return session.client("s3", endpoint_url=endpoint_url, config=Config(**settings))

    doctor = _Doctor(probed, raw, probe_root, samples, extra_client)
    probes: list[Probe] = []
    left: list[str] = []
    reached = False
    try:
        await _preflight(raw, extra_client, probe_root)  # a missing bucket, refused credentials: StoreError
        reached = True
        doctor.client = await raw.client()
        await probed.put(probe_root + "hello", b"s3capture doctor")  # no write permission: StoreError

        async def run(name: str, job: Callable[[], Awaitable[Probe]]) -> Probe:
            try:
                probe = await job()
            except StoreError as error:
                if "refused" in str(error) or "does not exist" in str(error):
                    raise
                probe = Probe(
                    name,
                    "fail",
                    f"the probe failed: {error}",
                    "see the error; the store may be unreachable or overloaded",
                )
            except Exception as error:  # noqa: BLE001 - one broken probe must not hide the others
                probe = Probe(
                    name,
                    "fail",
                    f"the probe failed: {type(error).__name__}: {error}",
                    "see the error; the store answered something unexpected",
                )
            probes.append(probe)
            return probe

        await run("read-after-write", doctor.read_after_write)
        await run("list-after-write", doctor.list_after_write)
        listed: list[str] = []

        async def order() -> Probe:
            probe, got = await doctor.listing_order()
            listed.extend(got)
            return probe

        await run("listing-order", order)
        await run("prefix", doctor.prefix)
        await run("pagination", lambda: doctor.pagination(listed or list(ORDER_KEYS)))
        await run("double-slash", doctor.double_slash)
        await run("dot-segments", doctor.dot_segments)
        await run("transport-keys", doctor.transport_keys)
        await run("content-md5", doctor.content_md5)
        await run("checksum-headers", doctor.checksum_headers)
        await run("default-checksums", doctor.default_checksums)
        await run("etag-md5", doctor.etag_md5)
        await run("delete-objects", doctor.delete_objects)
        await run("conditional-write", doctor.conditional_write)
        probes.append(doctor.clock_skew())
        probes.append(doctor.latency_probe())
    finally:
        try:
            if reached:  # nothing was written before the store answered
                left = await _clean(doctor, probe_root)
        finally:
            try:
                await probed.close()
            finally:
                if raw is not probed:
                    await raw.close()
    if probes:
        if left:
            probes.append(
                Probe(
                    "cleanup",
                    "fail",
                    f"{len(left)} objects left under {probe_root} after deleting everything listed there "
                    f"(first: {left[0]!r})",
                    "delete them by hand; the store's DELETE or listing does not behave",
                    {"left": left[:100]},
                )
            )
        else:
            probes.append(
                Probe(
                    "cleanup",
                    "ok",
                    f"every object under {probe_root} deleted; a final LIST shows none",
                    "",
                    {"left": []},
                )
            )
    return DoctorReport(
        url=url,
        endpoint=endpoint_url,
        transport=probed.name,
        probe_prefix=probe_root,
        probes=probes,
        left_behind=left,
    )


async def _preflight(transport: Transport, extra_client: Callable[..., Any], probe_root: str) -> None:
    """One LIST of the probe prefix with at most two attempts and short timeouts, so a missing
    bucket, refused credentials or an unreachable endpoint is one line within seconds (the
    transport's own retries would take half a minute for an endpoint nobody listens on).
    Raises ``StoreError``."""
    from botocore.exceptions import BotoCoreError, ClientError

    async with extra_client(attempts=2, connect_timeout=3) as client:
        try:
            await client.list_objects_v2(Bucket=transport.bucket, Prefix=probe_root, MaxKeys=1)
        except ClientError as error:
            raise transport._wrap(error, "LIST", probe_root) from None
        except BotoCoreError as error:
            if type(error).__name__ == "NoCredentialsError":  # the same line as every other command's
                raise transport._wrap(error, "LIST", probe_root) from None
            where = transport.endpoint_url or "AWS S3"
            raise StoreError(f"cannot reach {where}: {error}", operation="LIST", key=probe_root) from None


async def _clean(doctor: _Doctor, probe_root: str) -> list[str]:
    """Delete everything under ``probe_root`` (through the raw transport: a key the probed
    transport changed in transit is deleted as listed); return what a final listing still shows."""
    if doctor.client is None:
        try:
            doctor.client = await doctor.raw_t.client()
        except Exception:  # noqa: BLE001 - nothing was written without a client
            return []
    left: list[str] = []
    for attempt in range(4):
        try:
            # Only keys under the probe prefix: a store that ignores or widens a LIST's Prefix (the
            # prefix probe notes it) answers with the bucket's other objects, which a doctor
            # breaker (2026-12-03) saw deleted here, every one.
            keys = [key for key in await doctor.raw_list(probe_root) if key.startswith(probe_root)]
        except Exception:  # noqa: BLE001 - a bucket that does not exist holds nothing of ours
            return left
        if not keys:
            return []
        left = keys
        if attempt == 3:
            break
        try:
            await doctor.raw_t.delete(keys)
        except StoreError:
            for key in keys:
                try:
                    await doctor.raw_t.delete_one(key)
                except StoreError:
                    pass
        await asyncio.sleep(0.05 * attempt)
    return left


def register(sub: Any) -> Any:
    """Add the ``doctor`` subcommand to an ``argparse`` subparsers object; returns its parser."""
    from s3capture.cli import _argument, _int_in, check_endpoint, check_s3_url

    doctor = sub.add_parser(
        "doctor",
        help="probe a store for the properties s3capture relies on (consistency, listing order, paging, ...)",
        description="Write small throwaway objects under URL/_s3capture-doctor-<uuid>/, probe read-after-write, "
        "list-after-write, listing order, prefix semantics, pagination, '//' and dot-segment keys, Content-MD5 and "
        "checksum verification, whether the transport (--transport) carries s3capture's keys unchanged, ETags, "
        "DeleteObjects, conditional writes, clock skew and latency, delete everything again and print a verdict "
        "per property (ok, note, fail) with what to change. Exit status 0 when nothing s3capture relies on is "
        "missing, 1 when something is, 2 for a usage error or a store that cannot be used at all (missing bucket, "
        "refused credentials, unreachable endpoint, --transport obstore without obstore). See docs/doctor.md.",
    )
    doctor.add_argument("url", type=_argument(check_s3_url), help="s3://bucket[/prefix] to probe under")
    doctor.add_argument(
        "--endpoint",
        type=_argument(check_endpoint),
        help="S3 endpoint URL (default: AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, else AWS S3)",
    )
    doctor.add_argument(
        "--samples",
        type=_int_in(1, 1000),
        default=20,
        help="PUT/GET/LIST requests timed for the latency percentiles, 1 to 1000 (default 20)",
    )
    doctor.add_argument(
        "--transport",
        choices=TRANSPORTS,
        help="the transport to probe, the one capture runs on (default: S3CAPTURE_TRANSPORT, else aioboto3)",
    )
    doctor.add_argument("--json", action="store_true", help="print the report as one JSON object")
    doctor.set_defaults(func=_command)
    return doctor


async def _until_signal(work: Any) -> Any:
    """Run ``work``; SIGTERM cancels it as Ctrl-C does, so its clean-up (``finally``) still
    deletes every probe object (``timeout``, a cancelled CI job or a stopped pod send SIGTERM)."""
    import signal

    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
    except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
        return await task
    try:
        return await task
    except asyncio.CancelledError:
        raise KeyboardInterrupt from None  # the command line's exit status 130, as after Ctrl-C
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def _command(args: Any) -> int:
    import sys

    endpoint = args.endpoint
    if endpoint is None:
        for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
            if os.environ.get(name):
                endpoint = os.environ[name]
                break
    transport = (args.transport or os.environ.get(TRANSPORT_ENV) or "aioboto3").strip().lower()
    source = "--transport" if args.transport else TRANSPORT_ENV
    if transport not in TRANSPORTS:
        raise ValueError(f"{source} must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    if transport == "obstore":
        try:
            import obstore  # noqa: F401
        except ImportError:
            raise ValueError(
                f"{source}=obstore needs obstore: {install_hint('obstore')} (or probe --transport aioboto3)"
            ) from None
    work = diagnose(args.url, endpoint_url=endpoint, samples=args.samples, transport=transport)
    report = asyncio.run(_until_signal(work))
    if args.json:
        print(msgspec.json.encode(report.to_json()).decode())
    else:
        print(format_report(report))
    if sys.stdout is not None:  # None: started with stdout closed (`>&-`)
        sys.stdout.flush()
    return 0 if report.ok else 1
