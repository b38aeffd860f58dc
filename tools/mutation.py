#!/usr/bin/env python3
"""Hand-written mutants of s3capture's core contracts, each run against the tests that must kill it.

Each mutant replaces one exact snippet of ``src/`` (occasionally two in the same file) so that one
documented contract breaks: an escape that collides, a freeze that misses a misfiled entry, a
resolve that guesses, a put that ignores the fence, a ledger that hides a conflict, ... For every
mutant the script copies ``src/``, ``tests/`` and ``pyproject.toml`` into a fresh temporary
directory (the working tree is never modified), applies the mutant there, and runs the mutant's
focused pytest selection with ``-x`` against moto, with ``PYTHONPATH`` pointing at the copy. A
mutant is *killed* when a test fails, *survived* when the selection passes.

Before the mutants, the union of all selections runs once unmutated (the baseline): a kill only
means something when the same tests pass on the real code. A snippet that no longer matches the
source (after a refactor) is reported as ``snippet not found`` (or ``ambiguous`` when it matches
more than once) and the other mutants still run; update the mutant's snippet then.

Dependency-free (standard library only); the Python that runs pytest needs the test dependencies.

Usage::

    python tools/mutation.py                        # every mutant, one at a time
    python tools/mutation.py --list                 # the mutants, their contracts and selections
    python tools/mutation.py --only freeze-misfiled-fingerprint escape-percent-2E-collides
    python tools/mutation.py --jobs 2 --markdown results.md
    python tools/mutation.py --python /path/to/venv/bin/python --servers moto
    python tools/mutation.py --only escape-percent-2E-collides --select "tests/test_layout.py -k near_collisions"

Exit status: 0 when every mutant was killed; 1 when any survived; 2 when none survived but a
mutant could not be applied or its run ended in an error or timeout, or the baseline failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COPIED = ("src", "tests", "pyproject.toml")
IGNORED = shutil.ignore_patterns("__pycache__", ".hypothesis", ".pytest_cache", "*.pyc")


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    """Path relative to the repository root."""
    edits: tuple[tuple[str, str], ...]
    """(exact old snippet, new snippet) pairs, applied in order; each old snippet must occur once."""
    contract: str
    tests: tuple[str, ...]
    """pytest arguments selecting the tests that must kill the mutant."""


def _m(
    name: str, file: str, old: str, new: str, contract: str, *tests: str, more: tuple[tuple[str, str], ...] = ()
) -> Mutant:
    return Mutant(name, file, ((old, new), *more), contract, tests)


LAYOUT = "src/s3capture/layout.py"
# s3capture.store is split by theme (its module docstrings say what each holds).
STORE_CORE = "src/s3capture/store_core.py"
STORE_WRITES = "src/s3capture/store_writes.py"
STORE_SNAPSHOTS = "src/s3capture/store_snapshots.py"
STORE_LIFECYCLE = "src/s3capture/store_lifecycle.py"
STORE_LINEAGE = "src/s3capture/store_lineage.py"
ROLLOUTS_FENCES = "src/s3capture/rollouts/fences.py"
ROLLOUTS_SCAN = "src/s3capture/rollouts/scan.py"
TRANSPORT = "src/s3capture/transport.py"
LISTING = "src/s3capture/transport_listing.py"
TRANSPORT_DELETE = "src/s3capture/transport_delete.py"
SPILL = "src/s3capture/spill.py"
LEDGER = "src/s3capture/ledger.py"
LEDGER_MANIFEST = "src/s3capture/ledger_manifest.py"
LEDGER_ROWS = "src/s3capture/ledger_rows.py"
RECORDS = "src/s3capture/records.py"
EXPORT_SHARD = "src/s3capture/export/shard.py"
EXPORT_DRIVER = "src/s3capture/export/driver.py"
OPS_GC = "src/s3capture/ops/gc_run.py"
TRANSPORT_OBSTORE = "src/s3capture/transport_obstore.py"
EXPORT_WRITERS = "src/s3capture/export/writers.py"
EXPORT_DESTINATION_S3 = "src/s3capture/export/destination_s3.py"

MUTANTS: list[Mutant] = [
    # ------------------------------------------------------------------ layout
    _m(
        "escape-percent-2E-collides",
        LAYOUT,
        'return value.encode("utf-8", errors="surrogatepass").decode("latin-1").translate(_ESCAPE_TABLE)',
        'return value.replace("%2E", ".").encode("utf-8", errors="surrogatepass").decode("latin-1").translate(_ESCAPE_TABLE)',
        "escape_id is injective: the ids '%2E' and '.' get different segments",
        "tests/test_layout.py",
    ),
    _m(
        "escape-dot-is-safe",
        LAYOUT,
        '_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")',
        '_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-.")',
        "escape_id escapes '.' (its escape character): '%' and '.25' must not share a segment, no '..'",
        "tests/test_layout.py",
    ),
    _m(
        "escape-tilde-is-empty",
        LAYOUT,
        'if value == "":\n        return "~"',
        'if value in ("", "~"):\n        return "~"',
        "escape_id is injective: the empty id and '~' get different segments",
        "tests/test_layout.py",
    ),
    _m(
        "root-may-nest-in-rollouts",
        LAYOUT,
        'if "rollouts" in root.split("/"):',
        "if False:",
        "a root with a 'rollouts' segment is refused (it could nest inside another root's rollout)",
        "tests/test_adversarial_input.py",
        "-k",
        "root",
    ),
    _m(
        "scan-list-prefix-without-slash",
        ROLLOUTS_FENCES,
        "listing = await self._list(\n            prefix,\n            require=",
        'listing = await self._list(\n            prefix.rstrip("/"),\n            require=',
        "every LIST prefix ends in '/': rollout r1 never sees (or retires) the objects of r10",
        "tests/test_adversarial_input.py",
        "tests/test_store_source.py",
        "-k",
        "root or prefixes_do_not_collide",
    ),
    _m(
        "ledger-row-list-prefix-without-slash",
        LEDGER,
        'self._put(row_key, stored),\n            self._list(f"{prefix}ledger/row/{segment}/"),',
        'self._put(row_key, stored),\n            self._list(f"{prefix}ledger/row/{segment}"),',
        "every LIST prefix ends in '/': record of call c1 never sees the row of call c10 as a conflict",
        "tests/test_adversarial_ledger.py",
        "-k",
        "odd_rollout_and_call_ids or extend_each_other",
    ),
    # ------------------------------------------------------------------ freeze
    _m(
        "freeze-misfiled-call-id",
        STORE_SNAPSHOTS,
        "if entry.rollout_id != rollout_id or entry.model_call_id != cid or entry.continuation_fingerprint != fp:",
        "if entry.rollout_id != rollout_id or entry.continuation_fingerprint != fp:",
        "freeze flags an entry stored under another call id's key as misfiled",
        "tests/test_store_source.py",
        "-k",
        "corrupt_and_foreign",
    ),
    _m(
        "freeze-misfiled-fingerprint",
        STORE_SNAPSHOTS,
        "if entry.rollout_id != rollout_id or entry.model_call_id != cid or entry.continuation_fingerprint != fp:",
        "if entry.rollout_id != rollout_id or entry.model_call_id != cid:",
        "freeze flags an entry stored under another fingerprint's key as misfiled",
        "tests/test_misfiled.py",
    ),
    _m(
        "freeze-reads-one-copy-per-sha",
        STORE_SNAPSHOTS,
        "by_call.setdefault(cid, {}).setdefault(sha, []).append((item, fp))",
        "by_call.setdefault(cid, {})[sha] = [(item, fp)]",
        "freeze reads and judges every listed key of an entry's bytes: a copy under another fingerprint's key is "
        "misfiled in either LIST order",
        "tests/test_misfiled.py",
        "-k",
        "copied_under_another_fingerprint",
    ),
    _m(
        "freeze-conflict-needs-three",
        STORE_SNAPSHOTS,
        "if len(by_call[cid]) > 1:",
        "if len(by_call[cid]) > 2:",
        "freeze reports conflicting_payloads for a call id with two payloads",
        "tests/test_store_source.py",
        "-k",
        "conflicting_payload_masks or rebuilt_entry",
    ),
    _m(
        "freeze-ignores-dangling-intent",
        STORE_SNAPSHOTS,
        'reasons.append(f"dangling_intent:{cid}")',
        "pass",
        "a begin_call intent without an entry masks the rollout (dangling_intent)",
        "tests/test_store_source.py",
        "-k",
        "dangling_intent or begin_call_then_put",
    ),
    _m(
        "freeze-ignores-markers",
        STORE_SNAPSHOTS,
        'reasons.append(f"marked_incomplete:{cid}")',
        "pass",
        "a mark_incomplete marker masks the rollout (marked_incomplete)",
        "tests/test_store_source.py",
        "-k",
        "mark_incomplete",
    ),
    _m(
        "freeze-ignores-broken-chain",
        STORE_SNAPSHOTS,
        "if entry.parent_call_id is not None and entry.parent_call_id not in present:",
        "if False:",
        "a delta entry whose parent is not in the snapshot masks it (broken_chain)",
        "tests/test_adversarial_chains.py",
        "-k",
        "without_its_parent",
    ),
    # ------------------------------------------------------------------ snapshot identity and drop
    _m(
        "snapshot-id-ignores-log-keys",
        ROLLOUTS_SCAN,
        'hasher.update(f"{item.key[len(self.prefix) :]}\\n".encode())',
        "pass",
        "snapshot_id is a digest of the sorted log keys: another state with as many objects has another id",
        "tests/test_store_source.py",
        "-k",
        "snapshot or drop or freeze or foreign or conflict",
    ),
    _m(
        "version-ignores-foreign",
        ROLLOUTS_SCAN,
        "return len(self.log) + len(self.foreign), hasher.hexdigest()[:32]",
        "return len(self.log), hasher.hexdigest()[:32]",
        "version counts every object under the rollout's log, foreign ones included",
        "tests/test_store_source.py",
        "-k",
        "foreign",
    ),
    _m(
        "drop-ignores-version",
        STORE_LIFECYCLE,
        "or scan.version_and_id() != (version, snapshot_id):",
        "or scan.version_and_id()[1] != snapshot_id:",
        "drop retires only when both version and snapshot_id equal the consumed snapshot's",
        "tests/test_store_source.py",
        "-k",
        "drop_with_wrong",
        more=(
            ("or after.version_and_id() != (version, snapshot_id):", "or after.version_and_id()[1] != snapshot_id:"),
        ),
    ),
    _m(
        "drop-ignores-changes",
        STORE_LIFECYCLE,
        " or scan.version_and_id() != (version, snapshot_id):",
        ":",
        "drop returns False and keeps everything when anything changed since the snapshot",
        "tests/test_store_source.py",
        "-k",
        "drop or after_freeze",
        more=((" or after.version_and_id() != (version, snapshot_id):", ":"),),
    ),
    # ------------------------------------------------------------------ resolve
    _m(
        "resolve-uses-a-conflicted-call",
        STORE_LINEAGE,
        "        if conflicted:\n",
        "        if False:\n",
        "a call id with conflicting payloads makes resolve UNRESOLVED, never a guess",
        "tests/test_store_lineage.py",
        "-k",
        "conflict",
        more=(
            (
                "singles = [keys[0] for cid, keys in by_call.items() if len(keys) == 1]",
                "singles = [keys[0] for cid, keys in by_call.items()]",
            ),
        ),
    ),
    _m(
        "resolve-ignores-fingerprint",
        STORE_LINEAGE,
        "if entry.rollout_id != rollout_id or entry.continuation_fingerprint != fingerprint:",
        "if entry.rollout_id != rollout_id:",
        "resolve returns only an entry whose own fingerprint is the request's (never a misfiled one)",
        "tests/test_misfiled.py",
    ),
    _m(
        "resolve-ignores-context",
        STORE_LINEAGE,
        "if context != entry.continuation_context_digest:\n                continue",
        "if False:\n                continue",
        "resolve requires the request's leading items to match the entry's recorded context digest",
        "tests/test_store_lineage.py",
        "-k",
        "rewritten_context",
    ),
    _m(
        "read-skips-sha-check",
        STORE_CORE,
        "if sha is not None and hashlib.sha256(payload).hexdigest() != sha:",
        "if False:",
        "a reader verifies the SHA-256 in an entry's key against its bytes",
        "tests/test_store_source.py",
        "-k",
        "corrupt_and_foreign",
    ),
    _m(
        "delta-chain-skips-parent-check",
        STORE_CORE,
        "nearer.entry.parent_call_id != farther.entry.model_call_id\n",
        "False\n",
        "rebuilding a delta prompt checks every parent link of the ancestor chain",
        "tests/test_misfiled.py",
        "tests/test_adversarial_chains.py",
        "tests/test_store_lineage.py",
        "-k",
        "chain_link or cyclic or corrupted_ancestor",
    ),
    # ------------------------------------------------------------------ put and the fence
    _m(
        "put-ignores-retired-fence",
        STORE_WRITES,
        '        if state == "retired":\n            # Never delete the key: it is content-addressed',
        "        if False:\n            # Never delete the key: it is content-addressed",
        "put into a retired rollout raises TokenCaptureRetiredError",
        "tests/test_store_source.py",
        "-k",
        "drop_exact or retire_removes",
    ),
    _m(
        "put-ignores-frozen-fence",
        STORE_WRITES,
        '        if state == "frozen":\n            raise TokenCaptureFrozenError(\n'
        '                f"rollout {record.rollout_id!r} is frozen; the late entry',
        "        if False:\n            raise TokenCaptureFrozenError(\n"
        '                f"rollout {record.rollout_id!r} is frozen; the late entry',
        "put into a frozen rollout raises TokenCaptureFrozenError (the entry landed, the version moved)",
        "tests/test_store_source.py",
        "-k",
        "after_freeze",
    ),
    # ------------------------------------------------------------------ issue 7: verified listings
    _m(
        "list-keeps-keys-outside-prefix",
        LISTING,
        'outside the requested prefix; ignored", prefix, key)\n            continue\n',
        'outside the requested prefix; ignored", prefix, key)\n',
        "a verified listing ignores keys outside the requested prefix: retire, delete and drop of r1 never "
        "delete (or count) objects of r1000",
        "tests/test_faults.py",
        "-k",
        "test_3_sibling_prefix",
    ),
    _m(
        "list-empty-200-is-no-objects",
        LISTING,
        'if "IsTruncated" not in page:',
        "if False:",
        "a 200 LIST with an empty or unparseable body is a store error (retried, then StoreError), never 'no objects'",
        "tests/test_faults.py",
        "tests/test_mutation_gaps.py",
        "-k",
        "test_3_empty_list_body or empty_200_list",
    ),
    _m(
        "freeze-list-need-not-show-fence",
        STORE_SNAPSHOTS,
        'return await self._list(prefix, require=[prefix + "fence"])',
        "return await self._list(prefix)",
        "freeze's listing must show the fence that freeze just wrote (a stale listing is retried, then ListingError)",
        "tests/test_faults.py",
        "-k",
        "test_3_listing_without_what",
    ),
    # ------------------------------------------------------------------ issue 7: fences and drop
    _m(
        "put-retired-deletes-shared-key",
        STORE_WRITES,
        '        if state == "retired":\n            # Never delete the key: it is content-addressed',
        '        if state == "retired":\n            await self._delete_one(key)\n            # Never delete the key: it is content-addressed',
        "a put that reads the rollout retired never deletes its key (an acknowledged identical put may own it)",
        "tests/test_faults.py",
        "tests/test_store_source.py",
        "-k",
        "test_1_put_that_finds or drop_exact or retire_removes",
    ),
    _m(
        "drop-skips-fence-grace",
        STORE_LIFECYCLE,
        "wait = seen_at + self._fence_grace + _CLOCK_SLACK - awake_clock()",
        "wait = 0.0",
        "drop waits fence_grace on this client's clock (awake_clock) since it knew the fence existed",
        "tests/test_faults.py",
        "tests/test_adversarial_fence.py",
        "-k",
        "test_2_drop or outlived",
    ),
    # ------------------------------------------------------------------ issue 7: holes and bytes
    _m(
        "missing-parent-only-for-deltas",
        STORE_SNAPSHOTS,
        "if entry.parent_call_id is not None and entry.parent_call_id not in present:",
        "if entry.prompt_is_delta and entry.parent_call_id not in present:",
        "any entry (full prompt or delta) whose parent_call_id is not in the snapshot masks it (missing_parent)",
        "tests/test_faults.py",
        "-k",
        "test_4_a_hole",
    ),
    _m(
        "decode-accepts-non-canonical-bytes",
        RECORDS,
        "if encode_entry(entry) != data:",
        "if False:",
        "a reader accepts only entry bytes equal to the canonical re-encoding of what it decoded",
        "tests/test_faults.py",
        "-k",
        "test_10_non_canonical",
    ),
    _m(
        "decode-fast-path-skips-canonical-check",
        RECORDS,
        "if entry is not None and not entry.__dict__ and _json_encoder.encode(entry) == data:",
        "if entry is not None and not entry.__dict__:",
        "the typed fast path of decode_canonical_entry accepts only bytes equal to its own encoding of the entry",
        "tests/test_faults.py",
        "tests/test_records.py",
        "-k",
        "test_10_non_canonical or canonical",
    ),
    # ------------------------------------------------------------------ later contracts (2026-12-02)
    _m(
        "resolve-rebuilds-digestless-delta",
        STORE_LINEAGE,
        "if stored.entry.prompt_is_delta and not stored.entry.digest:",
        "if False:",
        "resolve never rebuilds a delta winner without a digest: UNRESOLVED unverifiable_parent (its chain is a "
        "hint outside the key's SHA-256)",
        "tests/test_resolve_unverifiable.py",
    ),
    _m(
        "delta-chain-accepts-another-rollouts-ancestor",
        STORE_CORE,
        "or farther.entry.rollout_id != stored.entry.rollout_id",
        "or False",
        "every ancestor of a delta rebuild belongs to the winner's rollout",
        "tests/test_resolve_unverifiable.py",
        "tests/test_misfiled.py",
    ),
    _m(
        "export-verdict-ignores-incomplete",
        EXPORT_SHARD,
        "    if snapshot.incomplete:\n        masked = True",
        "    if False:\n        masked = True",
        "export never writes a rollout whose snapshot is incomplete as trainable",
        "tests/test_export.py",
        "-k",
        "masked or incomplete or hole",
    ),
    _m(
        "export-skip-writes-masked",
        EXPORT_SHARD,
        'written = not built.masked or job.masked == "include" or supersedes',
        "written = True",
        "masked='skip' (the default) leaves every masked rollout out of the data files",
        "tests/test_export.py",
        "-k",
        "masked",
    ),
    _m(
        "export-row-drops-masked-flag",
        EXPORT_WRITERS,
        '"masked": built.masked,',
        '"masked": False,',
        "a masked rollout written under masked='include' carries masked=true and its reasons",
        "tests/test_export.py",
        "-k",
        "masked",
    ),
    _m(
        "delete-removes-fence-before-tombstone",
        ROLLOUTS_FENCES,
        'last = [scan.prefix + "retired", scan.prefix + "fence"]',
        'last = [scan.prefix + "fence", scan.prefix + "retired"]',
        "delete removes the retire tombstone before the fence: a failure in between never leaves a tombstone "
        "without a fence (writers would take the rollout for open, gc for retired)",
        "tests/test_unfinished_retire.py",
        "-k",
        "fails_midway or tombstone_before",
    ),
    _m(
        "gc-retires-an-unfinished-retire-again",
        OPS_GC,
        'if records and rollout_prefix + "fence" not in listed:',
        "if False:",
        "gc leaves a retire tombstone without a fence alone (writers took the rollout for open: their puts were "
        "acknowledged)",
        "tests/test_unfinished_retire.py",
        "-k",
        "gc_leaves",
    ),
    _m(
        "obstore-delete-objects-501-not-a-fallback",
        TRANSPORT_OBSTORE,
        "if code in _NOT_IMPLEMENTED:\n                return code",
        "if False:\n                return code",
        "the obstore transport falls back to single DELETEs where the store has no DeleteObjects",
        "tests/test_adversarial_delete.py",
        "-k",
        "not_implemented",
    ),
    _m(
        "retire-of-open-rollout-writes-tombstone-first",
        ROLLOUTS_FENCES,
        "        if not scan.fence:\n            # An open rollout: the retired fence first.",
        "        if False:\n            # An open rollout: the retired fence first.",
        "an open rollout's retire writes the retired fence before its tombstone: a failure between them "
        "leaves writers refused, never acknowledged into a rollout readers take for retired",
        "tests/test_unfinished_retire.py",
        "-k",
        "retire_that_fails_midway",
    ),
    _m(
        "delete-objects-trusts-an-answer-that-confirms-nothing",
        TRANSPORT_DELETE,
        "return [k for k in batch if k not in confirmed]",
        "return []",
        "keys a DeleteObjects answer does not confirm are deleted one by one (an empty or HTML 200 is no result)",
        "tests/test_adversarial_delete.py",
        "-k",
        "no_result",
    ),
    _m(
        "extra-field-shadows-a-known-field",
        RECORDS,
        "shadowed = sorted(name for name in extra if name in _FIELD_NAMES)",
        "shadowed: list[str] = []",
        "put refuses extra_fields named like a known field (they would replace its checked value in the stored bytes)",
        "tests/test_adversarial_input.py",
        "-k",
        "named_like_a_known_field",
    ),
    # ------------------------------------------------------------------ issue 7: spill
    _m(
        "cancelled-marker-not-spilled",
        STORE_WRITES,
        '            self._spill_on_cancel(key, b"", f"mark_incomplete({rollout_id!r}, {model_call_id!r})")\n',
        "            pass\n",
        "a mark_incomplete cancelled by the caller is spilled (fsynced) before the cancellation propagates",
        "tests/test_faults.py",
        "-k",
        "test_5_a_cancelled",
    ),
    _m(
        "spill-skips-crashed-claims",
        SPILL,
        "            if any(claim.path == leftover for claim in claims):\n                continue\n",
        "            continue\n",
        "a spill claim left by a crashed replayer is recovered by whoever takes its lock (never judged by PID)",
        "tests/test_faults.py",
        "tests/test_adversarial_spill.py",
        "-k",
        "test_6_the_spill or spilled_during_a_replay",
    ),
    # ------------------------------------------------------------------ capture ledger
    _m(
        "ledger-record-hides-conflict",
        LEDGER,
        "        if others:\n",
        "        if False:\n",
        "record raises LedgerConflictError when another payload for the call id is stored",
        "tests/test_ledger.py",
        "-k",
        "conflicting_record_fails",
    ),
    _m(
        "ledger-resolve-ignores-conflict",
        LEDGER,
        '            if len(variants) > 1:\n                return "conflict", None',
        '            if False:\n                return "conflict", None',
        "ledger resolve is UNRESOLVED for a call id with conflicting rows under any fingerprint",
        "tests/test_ledger.py",
        "-k",
        "conflict",
    ),
    _m(
        "ledger-ignores-retire",
        LEDGER_MANIFEST,
        'return await self._present(prefix + "retired")',
        "return False",
        "a retired rollout's manifest and has_rows raise RolloutRetiredError, its resolve is UNRESOLVED",
        "tests/test_ledger.py",
        "-k",
        "retire",
    ),
    _m(
        "ledger-ignores-intent",
        LEDGER_MANIFEST,
        "failures.update((cid, UNCOMMITTED_CALL_REASON) for cid in intents - accounted)",
        "failures.update(())",
        "a begin_call intent without a committed or failure row is a manifest failure",
        "tests/test_ledger.py",
        "-k",
        "dangling_begin_call",
    ),
    _m(
        "ledger-reader-limit-halved",
        LEDGER_ROWS,
        "if out.tell() > _MAX_ROW_BYTES:",
        "if out.tell() > _MAX_ROW_BYTES // 2:",
        "every row record accepts is readable by every client (reader limit = writer limit)",
        "tests/test_adversarial_ledger.py",
        "-k",
        "row_record_accepts or over_the_limit",
    ),
    _m(
        "ledger-writer-limit-doubled",
        LEDGER,
        "if len(body) > _MAX_ROW_BYTES:\n            # Readers refuse larger rows",
        "if len(body) > 2 * _MAX_ROW_BYTES:\n            # Readers refuse larger rows",
        "record refuses, before any request, a row larger than readers accept",
        "tests/test_adversarial_ledger.py",
        "-k",
        "row_record_accepts or over_the_limit",
    ),
    # ------------------------------------------------------------------ records
    _m(
        "encode-drops-extra-fields",
        RECORDS,
        "    if extra:\n        out.update(extra)\n",
        "    if extra:\n        pass\n",
        "unknown extra fields are written back unchanged (what coerce_entry accepts decodes to the same entry)",
        "tests/test_records.py",
        "-k",
        "coerce_entry_accepts",
    ),
    _m(
        "token-id-max-refused",
        RECORDS,
        "if ids and max(ids) > _MAX_TOKEN_ID:",
        "if ids and max(ids) >= _MAX_TOKEN_ID:",
        "token ids up to 2**64 - 1 are valid (Gym's digest encodes them)",
        "tests/test_records.py",
        "-k",
        "coerce_entry_accepts",
    ),
    # ------------------------------------------------------------------ 2026-12-02 (2): listings cut short, claims
    _m(
        "freeze-ignores-the-listing-end-confirmation",
        LISTING,
        "    if more:\n        return await work(listing + more)",
        "    if False:\n        return await work(listing + more)",
        "a freeze whose listing was cut short (IsTruncated false after the entries) sees the keys the "
        "confirming LIST finds after it: a marker masks the snapshot",
        "tests/test_listing_cut_short.py",
        "-k",
        "freeze_sees",
    ),
    _m(
        "scan-without-the-listing-end-confirmation",
        ROLLOUTS_FENCES,
        "            unless=[prefix + rel for rel in unless],\n            confirm_end=True,",
        "            unless=[prefix + rel for rel in unless],\n            confirm_end=False,",
        "drop's decisive listing (and retire's, delete's) confirms its end: a late marker a cut listing "
        "hides makes the drop fail",
        "tests/test_listing_cut_short.py",
        "-k",
        "drop_sees",
    ),
    _m(
        "export-scan-deletes-on-one-listings-word",
        EXPORT_DESTINATION_S3,
        "        listed = await self.transport.list(self.prefix, confirm_end=True)",
        "        listed = await self.transport.list(self.prefix)",
        "an export's destination scan never takes a durable shard for an orphan because one listing ended early",
        "tests/test_listing_cut_short.py",
        "-k",
        "durable_shard and cut",
        more=(
            (
                "                raw = await self.transport.get(self.prefix + name)\n                if raw is not None:",
                "                raw = None\n                if raw is not None:",
            ),
        ),
    ),
    _m(
        "export-worker-publishes-without-its-claim",
        EXPORT_DESTINATION_S3,
        "        if not self.owner:\n            return\n        claim =",
        "        if True:\n            return\n        claim =",
        "a worker of an export whose claim is gone (taken over) publishes no shard",
        "tests/test_listing_cut_short.py",
        "-k",
        "lost_its_claim",
    ),
    _m(
        "put-accepts-any-depth",
        RECORDS,
        "    plain = _scan_plain([output_items, routed_experts], MAX_JSON_DEPTH, finite=True)\n"
        "    return _scan_plain(extra or {}, MAX_JSON_DEPTH, finite=True) and plain",
        "    plain = _scan_plain([output_items, routed_experts], None, finite=True)\n"
        "    return _scan_plain(extra or {}, None, finite=True) and plain",
        "put refuses content nested deeper than Gym's encoder writes (254 levels), which crashed readers",
        "tests/test_adversarial_input.py",
        "-k",
        "deeper",
    ),
    _m(
        "put-stores-non-finite-nested-floats-as-null",
        RECORDS,
        "    plain = _scan_plain([output_items, routed_experts], MAX_JSON_DEPTH, finite=True)\n"
        "    return _scan_plain(extra or {}, MAX_JSON_DEPTH, finite=True) and plain",
        "    plain = _scan_plain([output_items, routed_experts], MAX_JSON_DEPTH)\n"
        "    return _scan_plain(extra or {}, MAX_JSON_DEPTH) and plain",
        "put refuses NaN and infinities in free-form content (stored as null while the writer's cache kept them)",
        "tests/test_adversarial_input.py",
        "-k",
        "non_finite",
    ),
    _m(
        "drop-retries-a-settled-decisive-listing",
        STORE_LIFECYCLE,
        'after = await self._scan(rollout_id, require=[tombstone], unless=["retired"])',
        "after = await self._scan(rollout_id, require=[tombstone])",
        "a drop whose tombstone a concurrent drop deleted answers False from its decisive listing",
        "tests/test_concurrency.py",
        "-k",
        "tombstone_a_concurrent",
    ),
    _m(
        "export-ages-a-rollout-when-its-turn-comes",
        EXPORT_DRIVER,
        "age = (info.listed_at or store_time(store)) - info.last_write.timestamp()",
        "age = store_time(store) - info.last_write.timestamp()",
        "export --min-age takes a rollout's age when its listing showed it, not when a slow shard let it through",
        "tests/test_clocks.py",
        "-k",
        "export_takes",
    ),
    _m(
        "spill-glues-a-marker-onto-a-torn-line",
        SPILL,
        'if size and os.pread(handle.fileno(), 1, size - 1) != b"\\n":',
        "if False:",
        "a spill append ends a torn last line first, so the next acknowledged marker is not skipped with it",
        "tests/test_adversarial_spill.py",
        "-k",
        "after_a_torn_line",
    ),
    _m(
        "ledger-resolves-to-a-failed-call",
        LEDGER,
        'if failed:\n                return "failed", None',
        'if False:\n                return "failed", None',
        "resolve never answers with a call that has a failure row (Gym's ledgers refuse its row)",
        "tests/test_adversarial_ledger.py",
        "-k",
        "failure_row_is_refused",
    ),
    _m(
        "has-rows-trusts-one-empty-listing",
        LEDGER_MANIFEST,
        "        if found:\n            retired = await self._retired(prefix)",
        "        if True:\n            retired = await self._retired(prefix)",
        "has_rows asks its LISTs again before answering False (one answer that lost the only row admitted a fresh root)",
        "tests/test_adversarial_ledger.py",
        "-k",
        "lost_the_only_key",
    ),
    _m(
        "resolve-compares-raw-cum-len",
        STORE_LINEAGE,
        "(entry.digest, entry.cum_len if entry.cum_len is not None else _cumulative_len(entry)) for entry in entries",
        "(entry.digest, entry.cum_len) for entry in entries",
        "several resolve candidates are one parent only by Gym's rule: a missing cum_len counts as the token count",
        "tests/test_store_lineage.py",
        "-k",
        "cum_len_are_compared",
    ),
]


# --------------------------------------------------------------------------- running


@dataclass
class Result:
    mutant: Mutant
    status: str
    """killed, survived, not found, ambiguous, error, timeout."""
    detail: str = ""
    seconds: float = 0.0
    summary: str = ""
    output: str = field(default="", repr=False)


def copy_repo(destination: Path) -> Path:
    """Copy src/, tests/ and pyproject.toml to ``destination/repo``; link ``destination/shared``.

    Tests find the shared example data at ``../shared`` beside the checkout, so the copy gets a
    symlink to the real one when it exists.
    """
    root = destination / "repo"
    root.mkdir(parents=True)
    for name in COPIED:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, root / name, ignore=IGNORED)
        elif source.exists():
            shutil.copy2(source, root / name)
    shared = REPO.parent / "shared"
    if shared.exists():
        (destination / "shared").symlink_to(shared, target_is_directory=True)
    return root


def apply(root: Path, mutant: Mutant) -> str:
    """Apply ``mutant`` to the copy at ``root``; return "" or why it could not be applied."""
    path = root / mutant.file
    if not path.exists():
        return f"file {mutant.file} not found"
    text = path.read_text(encoding="utf-8")
    for old, new in mutant.edits:
        count = text.count(old)
        first = old.strip().splitlines()[0] if old.strip() else old
        if count == 0:
            return f"snippet not found in {mutant.file}: {first!r}"
        if count > 1:
            return f"snippet ambiguous ({count} matches) in {mutant.file}: {first!r}"
        text = text.replace(old, new, 1)
    path.write_text(text, encoding="utf-8")
    return ""


def pytest_env(root: Path, servers: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root / "src")
    env["S3CAPTURE_TEST_SERVERS"] = servers
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_import_location(python: str, root: Path, servers: str) -> str:
    """ "" when the copy's s3capture is what the tests import, else the reason it is not."""
    probe = subprocess.run(
        [python, "-c", "import s3capture, sys; sys.stdout.write(s3capture.__file__)"],
        cwd=root,
        env=pytest_env(root, servers),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0:
        return f"cannot import s3capture from the copy: {probe.stderr.strip()[-500:]}"
    if not Path(probe.stdout).resolve().is_relative_to(root.resolve()):
        return f"PYTHONPATH does not win: s3capture imports from {probe.stdout}, not from the copy {root}"
    return ""


_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)
_SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed|error|skipped|deselected|xfailed|xpassed).*?)\s*=*$", re.MULTILINE)


def run_pytest(python: str, root: Path, args: tuple[str, ...], servers: str, timeout: float) -> tuple[int | None, str]:
    command = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args]
    try:
        proc = subprocess.run(
            command, cwd=root, env=pytest_env(root, servers), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as error:
        out = error.stdout or ""
        return None, out if isinstance(out, str) else out.decode(errors="replace")
    return proc.returncode, proc.stdout + proc.stderr


def summary_line(output: str) -> str:
    found = _SUMMARY.findall(output)
    return found[-1] if found else ""


def run_mutant(mutant: Mutant, python: str, servers: str, timeout: float, keep: bool) -> Result:
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix=f"s3capture-mut-{mutant.name}-"))
    try:
        root = copy_repo(workdir)
        problem = apply(root, mutant)
        if problem:
            status = "ambiguous" if "ambiguous" in problem else "not found"
            return Result(mutant, status, problem, time.monotonic() - started)
        code, output = run_pytest(python, root, mutant.tests, servers, timeout)
        seconds = time.monotonic() - started
        summary = summary_line(output)
        if code is None:
            return Result(mutant, "timeout", f"no verdict within {timeout:.0f} s", seconds, summary, output)
        if code == 0:
            return Result(mutant, "survived", "every selected test passed", seconds, summary, output)
        if code == 1:
            failed = _FAILED.findall(output)
            return Result(mutant, "killed", failed[0] if failed else "a test failed", seconds, summary, output)
        tail = " | ".join(output.strip().splitlines()[-3:])
        return Result(mutant, "error", f"pytest exited {code}: {tail}", seconds, summary, output)
    finally:
        if keep:
            print(f"  (kept {workdir})", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def baseline(mutants: list[Mutant], python: str, servers: str, timeout: float) -> tuple[bool, str]:
    """Run every distinct selection once on the unmutated copy; (passed, detail)."""
    workdir = Path(tempfile.mkdtemp(prefix="s3capture-mut-baseline-"))
    try:
        root = copy_repo(workdir)
        problem = check_import_location(python, root, servers)
        if problem:
            return False, problem
        selections = list(dict.fromkeys(m.tests for m in mutants))
        for selection in selections:
            code, output = run_pytest(python, root, selection, servers, timeout)
            if code != 0:
                tail = "\n".join(output.strip().splitlines()[-15:])
                return False, f"baseline of `{' '.join(selection)}` did not pass (exit {code}):\n{tail}"
        return True, f"{len(selections)} selections pass unmutated"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def markdown(results: list[Result]) -> str:
    lines = [
        "| mutant | file | contract it breaks | tests | result | killed by / detail | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        detail = r.detail.replace("|", "\\|")
        tests = " ".join(r.mutant.tests).replace("|", "\\|")
        lines.append(
            f"| `{r.mutant.name}` | {Path(r.mutant.file).name} | {r.mutant.contract} | `{tests}` | "
            f"**{r.status}** | {detail} | {r.seconds:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    parser.add_argument(
        "--python", default=sys.executable, help="Python with the test dependencies (default: this one)"
    )
    parser.add_argument("--servers", default="moto", help="S3CAPTURE_TEST_SERVERS for the runs (default: moto)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per pytest run (default: 300)")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run in parallel (default: 1)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the selections")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies (paths on stderr)")
    parser.add_argument("--markdown", type=Path, help="also write the results table (Markdown) to this file")
    parser.add_argument("--verbose", action="store_true", help="print the pytest output of survivors and errors")
    parser.add_argument(
        "--select",
        metavar="ARGS",
        help="pytest arguments replacing every selected mutant's own selection, e.g. "
        '"tests/test_layout.py -k near_collisions" (to see which tests alone kill a mutant)',
    )
    args = parser.parse_args(argv)
    # The runs start in a temporary copy: a relative --python (".venv/bin/python", as the docs
    # show) is resolved here, against the directory the command was typed in.
    found = shutil.which(args.python)
    if found is None:
        parser.error(f"--python {args.python}: no such interpreter")
    args.python = os.path.abspath(found)

    names = [m.name for m in MUTANTS]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        parser.error(f"duplicate mutant names: {sorted(duplicates)}")
    selected = MUTANTS
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            parser.error(f"unknown mutant(s) {unknown}; see --list")
        selected = [m for m in MUTANTS if m.name in args.only]
    if args.select:
        selected = [replace(m, tests=tuple(shlex.split(args.select))) for m in selected]

    if args.list:
        for m in selected:
            print(f"{m.name}\n    {m.file}: {m.contract}\n    pytest -x {' '.join(m.tests)}")
        return 0

    if not args.no_baseline:
        print(f"baseline: running {len(set(m.tests for m in selected))} selections unmutated ...", flush=True)
        ok, detail = baseline(selected, args.python, args.servers, args.timeout)
        print(f"baseline: {detail}", flush=True)
        if not ok:
            return 2

    results: list[Result] = []
    width = max(len(m.name) for m in selected)

    def report(result: Result) -> None:
        results.append(result)
        extra = f" [{result.summary}]" if result.summary else ""
        print(
            f"{result.status.upper():>9}  {result.mutant.name:<{width}}  {result.seconds:5.0f}s  {result.detail}{extra}",
            flush=True,
        )
        if args.verbose and result.status in ("survived", "error", "timeout") and result.output:
            print("\n".join("    " + line for line in result.output.strip().splitlines()[-30:]), flush=True)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(run_mutant, m, args.python, args.servers, args.timeout, args.keep) for m in selected]
        for future in concurrent.futures.as_completed(futures):
            report(future.result())

    order = {m.name: i for i, m in enumerate(selected)}
    results.sort(key=lambda r: order[r.mutant.name])
    counts = {
        status: sum(r.status == status for r in results)
        for status in ("killed", "survived", "not found", "ambiguous", "error", "timeout")
    }
    print()
    print("summary: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + f" (of {len(results)} mutants)")
    for r in results:
        if r.status != "killed":
            print(f"  {r.status}: {r.mutant.name} - {r.mutant.contract} ({r.detail})")
    if args.markdown:
        args.markdown.write_text(markdown(results), encoding="utf-8")
        print(f"results table written to {args.markdown}")
    if counts["survived"]:
        return 1
    if len(results) != counts["killed"]:
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
