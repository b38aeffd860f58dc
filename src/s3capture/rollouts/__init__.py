"""Rollout prefixes: the scan, version and snapshot-id derivation, fences, retire and delete.

``RolloutObjects`` is the base of ``S3TokenStore`` and ``S3CaptureLedger``: both keep a rollout's
objects under ``rollouts/<rid>/`` (``s3capture.layout``) and share its fence and removal rules.
It also owns the client-side pieces both need: the transport (``s3capture.transport``), the cache
(``s3capture.cache``) and the local spill (``s3capture.spill``).

Removal rules (``docs/design.md``): no *write* path ever deletes a key. Objects are deleted only
by ``retire``, ``delete`` and ``drop``, and only keys that a verified listing of the rollout's own
prefix returned.

``RolloutObjects.rollouts`` lists a root's rollouts (``RolloutInfo``: state, objects, bytes, and for
the token store the version and snapshot id a freeze would give) from one streaming listing of
``<root>/rollouts/``; it never writes (``docs/permissions.md``).

Its parts (a package since the 940-line module was split): ``urls`` (``parse_s3_url``), ``scan``
(``RolloutScan``, ``scan_listing``), ``listing`` (``RolloutInfo``, ``ROLLOUT_STATES``, the root
listing), ``client`` (the client plumbing and the spill) and ``fences`` (``RolloutObjects``, the
fences, ``retire`` and ``delete``). Every name stays importable from here.
"""

from __future__ import annotations

from s3capture.errors import StoreError
from s3capture.rollouts.fences import FENCE_FROZEN, FENCE_RETIRED, RolloutObjects
from s3capture.rollouts.listing import ROLLOUT_STATES, RolloutInfo
from s3capture.rollouts.listing import _segment_after as _segment_after  # s3capture.doctor and test_doctor use it
from s3capture.rollouts.scan import RolloutScan, scan_listing
from s3capture.rollouts.urls import parse_s3_url

__all__ = [
    "RolloutObjects",
    "RolloutInfo",
    "RolloutScan",
    "ROLLOUT_STATES",
    "parse_s3_url",
    "scan_listing",
    "FENCE_FROZEN",
    "FENCE_RETIRED",
]

__all__ += ["StoreError"]
