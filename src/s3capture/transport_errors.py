"""How the transports read a failed request: the S3 error codes they retry, refresh
credentials after or treat as "absent" or "not implemented", the library errors of a cut body or of
an endpoint that cannot be reached, the warning while such a request is retried, and the retry
delays.

Part of the transport seam (``s3capture.transport`` re-exports these names; the ``Transport`` base
maps every failure to ``StoreError`` with them). ``warn_connect_retry`` reads ``_CONNECT_WARNED``
and ``time.monotonic`` here: a test that resets or patches them patches this module.
"""

from __future__ import annotations

import functools
import logging
import random
import time

from botocore.retries.standard import ExponentialBackoff, RetryContext

_CONNECT_WARNED: dict[str, float] = {}
connect_log = logging.getLogger("s3capture.connect")
"""The logger of ``warn_connect_retry`` (a start-up probe that reports its own error quiets it)."""
_CONNECT_WARN_EVERY = 5.0
"""Seconds between two ``warn_connect_retry`` warnings for one endpoint: a retry sequence of a
wrong endpoint takes 8-14 s, so the user sees it go on (a warning a minute left that silent), and
many requests failing together still make one line per 5 s."""


def _cannot_connect(error: BaseException) -> bool:
    """Whether ``error`` is a failure to connect at all (refused, unresolvable, connect timeout):
    botocore's ``ConnectionError`` family, or aiohttp's ``ClientConnectorError`` (the obstore
    transport's LIST). Not a connection reset or closed after it was made: aiobotocore raises
    ``EndpointConnectionError`` ("Could not connect") for those too, and the hint to check the
    endpoint then sent an operator after a right one."""
    from botocore.exceptions import ConnectionError as BotocoreConnectionError

    try:
        import aiohttp
    except ImportError:  # pragma: no cover - aiobotocore requires it
        return isinstance(error, BotocoreConnectionError)
    if isinstance(error, BotocoreConnectionError):
        return not _lost_after_connecting(error)
    # aiohttp's own (the obstore transport's LIST and deletes): refused, DNS, or a connect timeout
    connect_timeout = getattr(aiohttp, "ConnectionTimeoutError", aiohttp.ClientConnectorError)
    return isinstance(error, (aiohttp.ClientConnectorError, connect_timeout))


def _lost_after_connecting(error: BaseException) -> BaseException | None:
    """The aiohttp error inside a botocore ``ConnectionError`` when it is one of a connection
    that was made and then lost (reset, broken pipe), else ``None``."""
    import aiohttp

    inner = getattr(error, "kwargs", {}).get("error")
    if isinstance(inner, aiohttp.ClientConnectionError) and not isinstance(
        inner, (aiohttp.ClientConnectorError, aiohttp.ServerTimeoutError)
    ):
        return inner
    return None


def warn_connect_retry(
    endpoint: str | None, error: BaseException, attempt: int, attempts: int, *, no_answer: bool = False
) -> None:
    """Log (at most once every 5 s per endpoint) that a request could not connect and is retried.

    Retries of connection errors are right for a store that blips, but with a wrong endpoint they
    take up to a quarter of a minute before the error; this warning says at once what is
    happening, and again while it goes on. ``attempt`` is the attempt that failed (1-based) of ``attempts``. ``no_answer``: the
    request was sent on a connection but no answer came within the read timeout (an endpoint that
    accepts connections and never answers took minutes of silence).
    """
    where = endpoint or "the AWS S3 endpoint"
    now = time.monotonic()
    if now - _CONNECT_WARNED.get(where, -_CONNECT_WARN_EVERY) < _CONNECT_WARN_EVERY:
        return
    _CONNECT_WARNED[where] = now
    reason = str(error).strip() or type(error).__name__
    # The longest the remaining retries' backoff can take (store_retry_delay's bound per retry):
    # a user waiting on a wrong endpoint learns how long the silence after this line may last.
    wait = sum(min(20, 2 ** (retry - 1)) for retry in range(attempt, attempts))
    what = (
        "no answer from %s within the read timeout (%s); retrying, attempt %d of %d, backing off up to %d s "
        "(an endpoint that accepts connections but does not answer, or an overloaded store)"
        if no_answer
        else "cannot connect to %s (%s); retrying, attempt %d of %d, backing off up to %d s (check the endpoint: "
        "--endpoint, AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL)"
    )
    connect_log.warning(what, where, reason, attempt + 1, attempts, wait)


_NOT_FOUND = frozenset({"NoSuchKey", "404", "NotFound"})
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
"""HTTP statuses every transport retries (up to its attempts, with backoff): throttling (429 is
what GCS's XML API answers for a rate limit, 503 SlowDown S3's) and server errors."""
RETRY_CODES = frozenset(
    {
        "SlowDown",
        "RequestTimeout",  # S3's 400 for a request body it waited too long for
        "InternalError",
        "ServiceUnavailable",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
    }
)
"""S3 error codes every transport retries, whatever the status. Not ``RequestTimeTooSkewed``:
every retry is signed by the same clock."""
_NOT_IMPLEMENTED = frozenset(
    {
        "NotImplemented",
        "MethodNotAllowed",
        "501",
        "405",
        "MalformedXML",
        "MissingContentMD5",
        "InvalidDigest",
        "BadDigest",
        "400",  # a 400 without an error code (Ceph's answer to a key XML 1.0 cannot carry)
        # The Ceph gateway checks s3:DeleteObject of a DeleteObjects request against the bucket's
        # ARN, so a role granted it on its keys only (docs/permissions.md) is refused the batch
        # but not the single DELETEs (a Ceph breaker, 2026-12-03).
        "AccessDenied",
    }
)
_CREDENTIAL_ERRORS = frozenset(
    {
        "ExpiredToken",
        "ExpiredTokenException",
        "InvalidToken",
        "TokenRefreshRequired",
        "RequestExpired",
        "InvalidAccessKeyId",
    }
)
"""Answers after which the credentials are resolved again and the request retried once."""


@functools.cache
def _payload_errors() -> tuple[type[BaseException], ...]:
    """Exceptions of an answer whose body was cut while it was read (not a failed connection,
    which botocore's own retries have already been through). Found on first use: importing
    aiohttp costs a quarter second that the obstore transport never needs."""
    from botocore.exceptions import IncompleteReadError, ResponseStreamingError

    errors: list[type[BaseException]] = [IncompleteReadError, ResponseStreamingError]
    try:
        import aiohttp

        errors.append(aiohttp.ClientPayloadError)
    except ImportError:  # pragma: no cover - aiobotocore always brings aiohttp
        pass
    return tuple(errors)


def _code(error: BaseException) -> str:
    response = getattr(error, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


_STANDARD_BACKOFF = ExponentialBackoff()


def store_retry_delay(attempt: int) -> float:
    """Seconds to wait before retry ``attempt`` (1 for the first retry) of a request the store
    answered with ``RETRY_STATUS`` or ``RETRY_CODES``: botocore's standard-mode backoff
    (``botocore.retries.standard.ExponentialBackoff``: full jitter over 2**(attempt-1) s, at most
    20 s), so requests s3capture retries itself wait as botocore's own retries do, on either
    transport."""
    return float(_STANDARD_BACKOFF.delay_amount(RetryContext(attempt_number=attempt)))


def _backoff(attempt: int) -> float:
    """Seconds before retry ``attempt`` (1, 2, ...): exponential from 50 ms with full jitter."""
    return random.uniform(0.5, 1.0) * 0.05 * (2 ** (attempt - 1))
