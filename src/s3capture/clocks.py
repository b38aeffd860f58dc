"""The clocks s3capture reads, and why each.

- :func:`awake_clock`: seconds on a clock that keeps counting while the machine is suspended
  (Linux ``CLOCK_BOOTTIME``; ``time.monotonic`` elsewhere). Every duration the fence protocol
  measures on one host uses it: a ``put`` timing itself against ``fence_grace``, ``drop``'s wait
  since it knew the fence existed, an ``s3://`` export's claim hold. ``CLOCK_MONOTONIC`` stops
  while a laptop or VM is suspended, so a request that reached the store after a suspend would
  look fast to it (``docs/design.md``, race 1).
- :func:`store_time`: "now" for ages against the store's ``LastModified`` (``gc``, ``export
  --min-age``, ``status``): the earlier of the store's clock (the ``Date`` of its newest LIST
  answer, carried forward on :func:`awake_clock`) and this machine's wall clock, so that a clock
  running ahead never makes a busy rollout look old.

No two machines' clocks are ever compared by the fence protocol; ages compare the store's clock
with itself, which assumes that the store's nodes agree (``docs/operations.md``, "Clocks").
"""

from __future__ import annotations

import time
from typing import Any

_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)


def awake_clock() -> float:
    """Seconds of a clock that counts suspended time too (``CLOCK_BOOTTIME`` on Linux, else
    ``time.monotonic``); only differences of two readings in one process mean anything."""
    if _BOOTTIME is not None:
        return time.clock_gettime(_BOOTTIME)
    return time.monotonic()


def store_time(store: Any) -> float:
    """The earlier of the store's clock (the ``Date`` of its newest LIST answer,
    ``Transport.store_now``) and this machine's, in seconds since the epoch: ages against the
    store's ``LastModified`` taken at this time are never overstated by a clock that runs ahead,
    this machine's or a ``Date`` header's (an age decides what ``gc`` deletes and what ``export
    --min-age`` reads as quiescent). ``store``: anything with a ``transport`` attribute (a token
    store or ledger), or ``None`` for this machine's clock alone."""
    transport = getattr(store, "transport", None)
    store_now = getattr(transport, "store_now", None)
    value = store_now() if store_now is not None else None
    local = time.time()
    return local if value is None else min(value, local)
