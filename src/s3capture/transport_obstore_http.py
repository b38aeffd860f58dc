"""The obstore transport's own requests, on the wire: what ``ObstoreTransport`` signs and parses
itself instead of leaving it to ``object_store`` (see ``s3capture.transport_obstore``).

- ``_S3HTTPError``: a non-2xx answer to a signed LIST, DeleteObjects or DELETE, shaped like
  botocore's ``ClientError``, and ``_XML_CODE``, the error code read out of an answer's body;
- SigV4 signing: ``_list_signer_class`` (botocore's ``S3SigV4Auth``, with the payload hash and the
  day's signing key worked out once) and ``_host_header`` (the Host header, derived once);
- DeleteObjects bodies: ``_delete_body`` builds the request, ``_delete_result`` reads the answer;
- ListObjectsV2 answers: ``_parse_list`` (a page in botocore's shape, or ``_Unverified``) and
  ``_url_decoded`` (``EncodingType=url`` keys).

Part of the obstore transport: ``s3capture.transport_obstore`` imports (and re-exports) these
names; the signed requests themselves (``ObstoreTransport._sign``, ``_signed_request``) are its.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import logging
import re
import xml.etree.ElementTree as ET
from typing import Any
from urllib.parse import unquote_plus
from xml.sax.saxutils import escape as xml_escape

from s3capture.transport_listing import _Unverified

log = logging.getLogger("s3capture")

_XML_CODE = re.compile(r"<Code>([A-Za-z0-9_.-]+)</Code>")


class _S3HTTPError(Exception):
    """A non-2xx answer to one of the obstore transport's own requests, shaped like botocore's ``ClientError``
    (``response["Error"]["Code"]``) so that ``Transport`` maps it the same way."""

    def __init__(self, operation: str, status: int, code: str, message: str) -> None:
        super().__init__(f"{operation} answered HTTP {status} {code}: {message[:200]}")
        self.response: dict[str, Any] = {
            "Error": {"Code": code or str(status), "Message": message},
            "ResponseMetadata": {"HTTPStatusCode": status},
        }


def _delete_body(keys: list[str]) -> bytes:
    """The XML body of a DeleteObjects of ``keys``, not quiet (the answer confirms each key). Keys
    are XML-escaped, carriage returns as character references: a raw ``\\r`` in element text is
    read back as ``\\n`` by every XML parser (end-of-line handling), which would name another key."""
    parts = ['<?xml version="1.0" encoding="UTF-8"?><Delete><Quiet>false</Quiet>']
    parts.extend(f"<Object><Key>{xml_escape(key, _XML_KEY_ENTITIES)}</Key></Object>" for key in keys)
    parts.append("</Delete>")
    return "".join(parts).encode("utf-8")


_XML_KEY_ENTITIES = {"\r": "&#13;"}


def _delete_result(body: bytes) -> tuple[list[dict], set[str]]:
    """The ``Error`` elements of a DeleteObjects answer as botocore shapes them (``Key``, ``Code``,
    ``Message``) and the keys of its ``Deleted`` elements. A body that is not a ``DeleteResult``
    (empty, an HTML page of a proxy) confirms nothing and reports nothing: ``Transport.delete``
    then deletes every key of the batch with single DELETEs."""
    try:
        root = ET.fromstring(body) if body.strip() else None
    except ET.ParseError:
        root = None
    ns = root.tag[: root.tag.index("}") + 1] if root is not None and root.tag.startswith("{") else ""
    if root is None or root.tag != ns + "DeleteResult":
        # Transport.delete warns once for the batch; the body, for whoever debugs the store.
        log.debug("DeleteObjects answered with a body that is not a DeleteResult: %r", body[:200])
        return [], set()
    errors = [
        {name: child.findtext(ns + name) or "" for name in ("Key", "Code", "Message")}
        for child in root.findall(ns + "Error")
    ]
    return errors, {child.findtext(ns + "Key") or "" for child in root.findall(ns + "Deleted")}


def _host_header(base: str) -> str | None:
    """The Host header botocore's signer derives from ``base`` (lowercase, no default port,
    IPv6 in brackets), worked out once instead of from every request's URL; ``None`` leaves it
    to the signer."""
    try:
        from botocore.auth import _host_from_url

        return str(_host_from_url(base))
    except Exception:  # noqa: BLE001 - a botocore without the helper: the signer derives it per request
        return None


_LIST_SIGNER: Any = None


def _list_signer_class() -> Any:
    """``_ListSigner``: botocore's ``S3SigV4Auth`` for the obstore transport's own requests (the LIST, and
    DeleteObjects and DELETE), made cheap where it may be. The canonical request, the string to
    sign and the signature are botocore's; two things are worked out once instead of per request:

    - the payload hash is SHA-256 of the request's bytes (of the empty body for a GET or a DELETE),
      so the signer never prepares the request to find its body;
    - the signing key (four HMACs over the secret key, the day, region and service, as
      ``SigV4Auth.signature`` derives it) is kept for the day it was derived for.

    One signer per frozen credentials (``ObstoreTransport._sign``); the Host header is given,
    so the signer does not parse it out of every URL.
    """
    global _LIST_SIGNER
    if _LIST_SIGNER is None:
        from botocore.auth import EMPTY_SHA256_HASH, S3SigV4Auth

        class _ListSigner(S3SigV4Auth):
            _key: tuple[str, bytes] | None = None

            def payload(self, request: Any) -> str:
                body = request.data
                return hashlib.sha256(body).hexdigest() if body else str(EMPTY_SHA256_HASH)

            def signature(self, string_to_sign: str, request: Any) -> str:
                day = request.context["timestamp"][0:8]
                key = self._key
                if key is None or key[0] != day:
                    k_date = self._sign(f"AWS4{self.credentials.secret_key}".encode(), day)
                    k_region = self._sign(k_date, self._region_name)
                    k_service = self._sign(k_region, self._service_name)
                    key = self._key = (day, self._sign(k_service, "aws4_request"))
                return str(self._sign(key[1], string_to_sign, hex=True))

        _LIST_SIGNER = _ListSigner
    return _LIST_SIGNER


def _url_decoded(key: str) -> str:
    """``unquote_plus(key)`` (botocore's decoding of ``EncodingType=url`` keys), cheaper for the
    common key whose only escapes are ``%2F``: each ``%2F`` in a string is a whole escape (no hex
    digit is ``%``), so it can be decoded first and the rest left to ``unquote_plus``."""
    key = key.replace("%2F", "/")
    if "%" in key or "+" in key:
        key = unquote_plus(key)
    return key


def _parse_list(body: bytes, prefix: str) -> dict:
    """A ListObjectsV2 body in botocore's shape (keys URL-decoded as botocore does), or
    ``_Unverified`` for a body that is not a listing. ``IsTruncated`` is present only when the
    body says it, so ``_verify_page`` can refuse a page without it."""
    try:
        root = ET.fromstring(body)
    except ET.ParseError as error:
        raise _Unverified(
            f"LIST {prefix!r} answered with an unparseable body: {error}", operation="LIST", key=prefix
        ) from None
    ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    if root.tag != ns + "ListBucketResult":
        raise _Unverified(
            f"LIST {prefix!r} answered with a {root.tag!r} document, not a listing", operation="LIST", key=prefix
        )
    # One pass over the children, as ``findtext`` reads them (the first child of a name; its text,
    # "" when it has none), without ElementPath's per-call path handling.
    contents_tag = ns + "Contents"
    first: dict[str, str] = {}
    items = []
    for child in root:
        if child.tag == contents_tag:
            items.append(child)
        elif child.tag not in first:
            first[child.tag] = child.text or ""
    page: dict[str, Any] = {}
    truncated = first.get(ns + "IsTruncated")
    if truncated is not None:
        page["IsTruncated"] = truncated.strip().lower() == "true"
    token = first.get(ns + "NextContinuationToken")
    if token:
        page["NextContinuationToken"] = token
    encoded = first.get(ns + "EncodingType", "").strip().lower() == "url"
    key_tag, size_tag, etag_tag, modified_tag = ns + "Key", ns + "Size", ns + "ETag", ns + "LastModified"
    contents = []
    for item in items:
        fields: dict[str, str] = {}
        for child in item:
            if child.tag not in fields:
                fields[child.tag] = child.text or ""
        key = fields.get(key_tag)
        if key is not None and encoded:
            key = _url_decoded(key)
        try:
            size = int(fields.get(size_tag) or 0)
        except ValueError:
            raise _Unverified(
                f"LIST {prefix!r} answered an object with a malformed Size", operation="LIST", key=prefix
            ) from None
        entry: dict[str, Any] = {"Key": key, "ETag": fields.get(etag_tag) or "", "Size": size}
        modified = fields.get(modified_tag)
        if modified:
            try:
                entry["LastModified"] = _dt.datetime.fromisoformat(modified.replace("Z", "+00:00"))
            except ValueError:
                pass
        contents.append(entry)
    if contents:
        page["Contents"] = contents
    return page
