"""``s3capture doctor``: probe an S3-compatible store for the properties s3capture relies on.

``diagnose(url)`` writes a few dozen small throwaway objects under
``<prefix>/_s3capture-doctor-<uuid>/``, measures how the store behaves, deletes everything it wrote
(in ``finally``, checked by a last listing) and returns a ``DoctorReport``: one ``Probe`` per
property with a verdict

- ``"ok"``: the store behaves as s3capture wants;
- ``"note"``: it differs from AWS S3, and s3capture copes (the detail says how);
- ``"fail"``: a property s3capture relies on is missing (the advice says what to change).

What is graded as a failure follows docs/design.md: strong read-after-write (also of an
overwrite: the fence is rewritten in place), list-after-write and list-after-delete consistency,
listings whose rollout prefixes come in an order ``S3TokenStore.rollouts`` accepts (S3's byte
order, or SeaweedFS's directory order), string-prefix semantics of ``Prefix`` (``rollouts(prefix=)``
lists a prefix that is not a whole segment), working pagination, and nothing left behind.
A key the chosen transport does not carry to the server byte for byte (``transport-keys``: obstore's
``Path`` refuses empty and dot segments and could encode characters) fails too.
Everything else (``//`` and dot-segment handling, checksum and Content-MD5 verification,
DeleteObjects, conditional writes, clock skew, latency) is reported as ``ok`` or ``note``:
the layout never builds ``//`` or dot segments, s3capture checks bodies itself (SHA-256 in keys,
MD5 ETags on GET), falls back to one DELETE per key, never uses conditional writes and never
compares two machines' clocks (except ``s3capture export --min-age``, which the skew probe notes).

Requests go through the transport capture runs on (``transport=``: ``"aioboto3"`` or
``"obstore"``; ``None`` reads ``S3CAPTURE_TRANSPORT``, default ``"aioboto3"``) for the timed
PUT/GET/LIST/DELETE, and through an aioboto3 transport's aiobotocore client directly (the same
transport when it is the one probed) where a probe needs what the transport deliberately hides:
the raw listing (keys outside the prefix, the order, the keys as the server stored them), headers
(``Date``, ``ETag``), wrong ``Content-MD5`` or checksum headers, ``If-None-Match: *`` and raw
``//`` keys. The clean-up deletes through that client too, so a key the probed transport changed
in transit is still deleted as the server stored it.

Modules: ``framework`` (``Probe``, ``DoctorReport``, ``PROBES``, the plumbing every probe uses and
``format_report``), ``consistency`` (read-after-write, list-after-write, listing order, prefix,
pagination), ``keys`` (``//``, dot segments, ``transport-keys``), ``features`` (Content-MD5,
checksums, ETags, DeleteObjects, conditional writes, clock skew, latency) and ``run``
(``diagnose``, the clean-up and the ``doctor`` subcommand). Everything is importable from
``s3capture.doctor`` itself.
"""

from s3capture.doctor.consistency import (
    LIST_LAG_LIMIT as LIST_LAG_LIMIT,
    ORDER_KEYS as ORDER_KEYS,
    _byte_order as _byte_order,
    _segments_accepted as _segments_accepted,
    _tree_order as _tree_order,
    grade_order as grade_order,
)
from s3capture.doctor.features import SKEW_NOTE as SKEW_NOTE
from s3capture.doctor.framework import (
    PROBES as PROBES,
    VERDICTS as VERDICTS,
    DoctorReport as DoctorReport,
    Probe as Probe,
    _code as _code,
    _percentile as _percentile,
    _status as _status,
    format_report as format_report,
)
from s3capture.doctor.keys import (
    KEY_IDS as KEY_IDS,
    KEY_ROOTS as KEY_ROOTS,
    layout_keys as layout_keys,
)
from s3capture.doctor.run import (
    _clean as _clean,
    _command as _command,
    _Doctor as _Doctor,
    _preflight as _preflight,
    _until_signal as _until_signal,
    diagnose as diagnose,
    register as register,
)

__all__ = [
    "PROBES",
    "VERDICTS",
    "DoctorReport",
    "Probe",
    "diagnose",
    "format_report",
    "grade_order",
    "layout_keys",
]
