"""Operations on a capture root: ``ls``, ``status`` and ``gc`` (library API and ``s3capture`` commands).

Everything here starts from one streaming listing of ``<root>/rollouts/``
(``S3TokenStore.rollouts_listed``), so memory stays bounded by one LIST page and one rollout's keys
whatever the number of rollouts::

    store = S3TokenStore("s3://bucket/capture")
    async for info in store.rollouts("open"):                # what `s3capture ls` prints
        ...
    report = await status(store)                              # StoreStatus: counts, masked reasons, leftovers
    plan = await gc(store, older_than=7 * 86400)              # GcReport of a dry run: nothing is deleted
    done = await gc(store, older_than=7 * 86400, dry_run=False)

What ``gc`` removes, and why it cannot lose an acknowledged entry (``docs/operations.md``):

* A retired rollout keeps its fence (``fence``, ``{"state": "retired"}``) and its retire tombstone
  (``retired``) forever, plus, rarely, objects of stragglers that landed after the retire (never
  acknowledged as captured). ``gc`` handles a retired rollout only when **every** key under its
  prefix, fence and tombstone included, is older than ``older_than`` (the store's LastModified
  against ``store_time``: the earlier of the store's clock, read from the ``Date`` of its LIST
  answers, and this machine's), as the streaming listing *and* a second listing of the rollout
  taken right before any write or delete both show, unchanged (same keys, ETags, sizes, times).
* A rollout holding nothing but its fence and tombstone loses them: the tombstone first, then the
  fence (a crash in between leaves a fence alone, which the next run removes: see below). Only
  those two keys are deleted, never a key the second listing did not show, so a write landing
  meanwhile stays where it landed (it re-opens the id, see "id reuse" in the docs).
* A retired rollout that still holds other objects is *retired again*: the tombstone and the
  retired fence are rewritten, then exactly the listed objects are deleted, the fence staying in
  place. Rewriting refreshes their LastModified, so the fence outlives every deleted object by at
  least ``older_than``: a straggler retrying one of those keys reads "retired" for that long and is
  never acknowledged. A later run removes the fence and tombstone.
* A key alone at a rollout prefix that is exactly ``fence`` (a delete or gc that crashed between
  its two deletes), older than ``older_than``, is deleted.
* A rollout prefix whose every key is a leftover listing probe (``ledger/.probe/<32 hex>`` of a
  ``probe_listing`` client, whose PUT the store applied after the call deleted it), which
  ``rollouts`` shows as no rollout at all, loses those keys when all are older than
  ``older_than`` and a listing right before the delete shows the same keys. A prefix holding
  anything else is left to ``retire`` and ``delete``.
* Open rollouts quiet for longer than ``abandoned_after`` are *reported*, never deleted; frozen
  rollouts are never touched (their consumer drops them).

One gc per root at a time; do not ``retire`` or ``delete`` a rollout while a gc may be removing
its fence. Ages are taken at ``store_time``, the earlier of the store's clock (the ``Date`` of its newest
LIST answer) and this machine's, so a clock running ahead never makes a key look older; ``older_than`` must exceed the
longest a ``put`` can stay in flight (retries included); ``MIN_SAFE_AGE`` (1 hour) is the least the
command line takes without a warning; tests use 0.

Modules: ``common`` (the clock ages are taken at and other shared helpers), ``status_report``
(``status``, ``StoreStatus``), ``gc_run`` (``gc``, ``GcAction``, ``GcReport``, ``MIN_SAFE_AGE``),
``formatting`` (``ls`` rows, ``format_status``, ``format_action``, ``format_gc``), ``roots``
(``roots_below``, ``roots_beside``, ``roots_hint``, ``roots_near``) and ``commands`` (``register``
and the subcommands). Everything is importable from ``s3capture.ops`` itself; patch a name in the
module that holds it.
"""

from s3capture.clocks import store_time as store_time
from s3capture.ops.commands import (
    _close_after as _close_after,
    _empty_listing_hint as _empty_listing_hint,
    _gc_command as _gc_command,
    _given_states as _given_states,
    _ls_command as _ls_command,
    _open_store as _open_store,
    _print_hint as _print_hint,
    _state_list as _state_list,
    _status_command as _status_command,
    register as register,
)
from s3capture.ops.common import (
    _age as _age,
    _clock as _clock,
    _newest as _newest,
    _progress as _progress,
    _rollout_prefix as _rollout_prefix,
    _when as _when,
)
from s3capture.ops.formatting import (
    _LS_WIDTHS as _LS_WIDTHS,
    LS_HEADER as LS_HEADER,
    _ago as _ago,
    _counted as _counted,
    _duration as _duration,
    _human_bytes as _human_bytes,
    _stamp as _stamp,
    format_action as format_action,
    format_gc as format_gc,
    format_rollout_row as format_rollout_row,
    format_status as format_status,
)
from s3capture.ops.gc_run import (
    MIN_SAFE_AGE as MIN_SAFE_AGE,
    GcAction as GcAction,
    GcReport as GcReport,
    _collect_one as _collect_one,
    _same_listing as _same_listing,
    gc as gc,
)
from s3capture.ops.roots import (
    _roots_under as _roots_under,
    roots_below as roots_below,
    roots_beside as roots_beside,
    roots_hint as roots_hint,
    roots_near as roots_near,
)
from s3capture.ops.status_report import (
    _MANIFEST_CONCURRENCY as _MANIFEST_CONCURRENCY,
    _MANIFEST_LIMIT as _MANIFEST_LIMIT,
    OldestOpen as OldestOpen,
    StateCounts as StateCounts,
    StoreStatus as StoreStatus,
    _ManifestHead as _ManifestHead,
    _reason_code as _reason_code,
    status as status,
)

__all__ = [
    "MIN_SAFE_AGE",
    "StateCounts",
    "OldestOpen",
    "StoreStatus",
    "GcAction",
    "GcReport",
    "status",
    "gc",
    "format_status",
    "format_gc",
    "format_rollout_row",
    "format_action",
    "roots_below",
    "roots_beside",
    "roots_hint",
    "roots_near",
    "register",
    "LS_HEADER",
]
