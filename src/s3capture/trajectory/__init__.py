"""Training trajectories from a frozen snapshot: chain helpers and the offline builder (issue 9).

A frozen rollout (``S3TokenStore.freeze`` or ``read_snapshot``: a ``FrozenSnapshot``) holds one
``TokenEntry`` per model call. Each entry records its full prompt, or with ``prompt_is_delta`` only
the prompt suffix after its RESOLVED parent's cumulative tokens (the parent's full prompt plus its
generation), and the parent decision taken when the call was served (``parent_resolution``,
``parent_call_id``). This module turns such a snapshot into training rows.

Chain helpers (no S3, no NeMo Gym needed):

- ``cumulative_prompt(entry, entries_by_call_id)``: the full prompt token ids of any entry, rebuilt
  through its parent links when it is a delta (the same reconstruction as Gym's
  ``builder._materialize_delta_prompts`` and ``S3TokenStore``'s own delta chains, verified against
  the entry's ``digest``);
- ``check_chain(entries)``: the contiguity problems of a snapshot's entries (holes, children whose
  prompt does not extend their parent's cumulative tokens, digests and ``cum_len`` that do not match);
- ``to_gym_entries(snapshot)``: the same entries as NeMo Gym ``TokenEntry`` objects (needs ``nemo_gym``).

The builder, ``build_rollout(snapshot, builder=, engine=)`` -> ``RolloutBuild``, has two engines:

``engine="gym"`` runs NeMo Gym 0.7.0's own public consumer, ``nemo_gym.token_id_capture.consumer.
trajectories_from_source(rollout_id, source, builder=...)``, on an in-process source whose
``freeze`` returns this snapshot (entries converted by ``to_gym_entries``; same ``incomplete``,
``snapshot_id``, ``version``). Output, masking (``mask_sample``, ``capture_incomplete``) and metrics
are Gym's exactly; the returned dict is kept as ``RolloutBuild.gym_result``. No verified response
and no terminal call id are passed, so Gym's terminal attribution abstains (``no_response_object``)
and its strict single-chain policy decides the mask. Gym's ``rebuilt_response`` becomes one
``Trajectory`` (Gym delivers one chain per rollout, its "main" chain):

- the generated output items are the items with ``generation_token_ids`` (one per model call of
  the chain, in chain order; Gym has checked they are prefix-contiguous);
- ``token_ids`` = the first such item's ``prompt_token_ids`` + its ``generation_token_ids``, then for
  each following item the part of its ``prompt_token_ids`` after the tokens so far (the
  interstitial prompt tokens: tool results, the next user turn, chat-template glue) + its
  ``generation_token_ids``;
- ``loss_mask`` is 1 on generated tokens and 0 on prompt tokens; ``logprobs`` is the item's
  ``generation_log_probs`` on generated tokens and 0.0 on prompt tokens;
- ``call_ids``: each generated item is matched to the snapshot entry with the same full prompt and
  generation; when several entries have identical tokens (a retry that generated the same text),
  the one the next call of the chain names as its parent, and for the last call the smallest id
  (the sibling Gym keeps);
- ``chain_id`` is the id of the chain's last (terminal) model call (Gym's own name, ``"main"``, is
  the same for every rollout; the terminal call id names the chain across engines and re-builds).

A Gym build that fails (Gym's ``error``: no entries, no safe chain, a non-contiguous projection)
has no ``rebuilt_response`` and gives no trajectory.

``builder="per_request"`` (the built-in engine's own: NeMo Gym 0.7.0 has no such builder, and
``engine="auto"`` picks the built-in engine for it) gives one ``Trajectory`` per model call with
generated tokens: the call's full prompt (loss 0) and its generation (loss 1), ``chain_id`` the
call's id. It masks on the same evidence as ``prefix_merging``.

``engine="builtin"`` needs no NeMo Gym. It follows the recorded parent links and builds the main
chain the way Gym's ``prefix_merging`` does for the same input when no terminal is attributed:
duplicate model call ids are collapsed (conflicting ones masked); delta prompts are rebuilt through
their parents; calls are linked to their recorded parent when the child's full prompt starts with
the parent's cumulative tokens; an UNRESOLVED call (or one without a parent decision) starts its own
fragment; retry siblings (same parent, same prompt) keep the one a later call extends, and a retry
nobody extends is unresolved; the chains are the root-to-leaf paths without a quarantined retry and
the main chain is the one whose root call has the smallest ``(created_at, model_call_id)``; the
rollout is masked unless exactly one root and one chain remain with no unresolved retry or parent.
The metrics dict has Gym's keys and, on the same input, Gym's values (``terminal_attribution`` is
Gym's "no response" abstention). Where it differs from Gym, it is stricter (it masks where Gym might
deliver), never looser:

- a recorded parent that is not in the snapshot (a hole) or was dropped (an empty generation, a
  delta that cannot be rebuilt) is never replaced: Gym may re-attach such a child to a surviving
  ancestor by token-prefix matching (``parent_call_id_missing_recovered``); the built-in builder
  masks it (``missing_parent:<cid>``, or ``delta_chain_unreconstructable:<cid>`` for a delta prompt);
- any call with an empty generation masks the rollout (``empty_generation:<cid>``); Gym drops such
  calls and masks only when the drop breaks the chain;
- every recorded ``digest`` and ``cum_len`` is verified against the rebuilt cumulative tokens
  (``digest_mismatch:<cid>``, ``cum_len_mismatch:<cid>``); Gym verifies them only on parent links
  and delta rebuilds;
- a parent link is checked by comparing tokens (the child's prompt starts with the parent's
  cumulative tokens) where Gym compares the digest of the prompt prefix with the parent's recorded
  digest; with verified digests the two agree;
- it also has ``builder="per_request"`` (above), which Gym 0.7.0 does not.

Both engines mask every incomplete snapshot (``FrozenSnapshot.incomplete``, or a snapshot that
gives ``reasons``: Gym's source is then told it is incomplete); ``mask_reasons`` then starts with
the snapshot's own ``reasons`` followed by ``"capture_incomplete"``.

Mask reasons (``RolloutBuild.mask_reasons``; ``<cid>`` is a model call id): the snapshot's reasons
(``conflicting_payloads:<cid>``, ``dangling_intent:<cid>``, ``marked_incomplete:<cid>``,
``missing_parent:<cid>``, ...), ``capture_incomplete``, ``no_entries``, ``roots:<n>`` and
``chains:<n>`` (n roots / chains where exactly one is required), ``unresolved_retry:<cid>``; from the
Gym engine ``gym_mask_sample`` (always, when Gym masks), ``gym_error:<Gym's error>``,
``unresolved_parent:<cid>`` and, should Gym's output not map back onto the entries (not seen; then
no trajectory), ``gym_output_not_contiguous:<i>``, ``gym_output_unmatched:<i>`` or
``no_generated_tokens``; from the built-in engine ``duplicate_call_id_conflict:<cid>``,
``delta_chain_unreconstructable:<cid>``, ``parent_unresolved:<cid>``, ``missing_resolution:<cid>``,
``resolved_parent_missing_id:<cid>``, ``not_contiguous:<cid>``, ``digest_mismatch:<cid>``,
``cum_len_mismatch:<cid>``, ``empty_generation:<cid>``, ``logprob_length_mismatch:<cid>`` and
``no_trainable_chain``. A masked rollout may still carry its main chain's trajectory (Gym's does
whenever its projection succeeded); it must never be trained on.

Memory: one rollout at a time; rebuilding a delta chain keeps every call's cumulative tokens (at
most the model's context window per call) for the duration of the build.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from s3capture.records import TokenEntry, coerce_entry, compute_digest, to_gym

if TYPE_CHECKING:  # importing the store would import aioboto3
    from s3capture.store import FrozenSnapshot

__all__ = [
    "ChainError",
    "cumulative_prompt",
    "check_chain",
    "to_gym_entries",
    "Trajectory",
    "RolloutBuild",
    "build_rollout",
    "build_rollout_async",
]

_BUILDERS = ("prefix_merging", "per_request")
"""Builders of the built-in engine. ``per_request`` (not in NeMo Gym 0.7.0) gives one trajectory per
model call: its full prompt (loss 0) and its generation (loss 1)."""
_ENGINES = ("auto", "gym", "builtin")
_GYM_INSTALL = "pip install pydantic orjson && pip install --no-deps --ignore-requires-python nemo-gym==0.7.0"
_NO_ATTRIBUTION = {"method": "none", "call_id": None, "reason": "no_response_object"}
"""Gym's terminal-attribution metric when the consumer is given no verified response."""


class ChainError(ValueError):
    """An entry's chain cannot be rebuilt: a hole (a parent missing from the snapshot), a cycle of
    parent links, a delta prompt without a parent, or rebuilt tokens that fail the entry's digest."""


# --------------------------------------------------------------------------- chain helpers
def _cumulative(entry: Any, by_id: Mapping[str, Any], memo: dict[str, list[int]] | None) -> list[int]:
    """``entry``'s cumulative tokens (full prompt + generation); raises ``ChainError``.

    Iterative (a chain can be thousands of calls deep). Every delta entry rebuilt is checked
    against its ``digest``; with ``memo`` every entry walked is remembered there.
    """
    path: list[Any] = []
    seen: set[str] = set()
    current = entry
    while True:
        key = current.model_call_id
        if memo is not None and key in memo:
            base = memo[key]
            break
        if not current.prompt_is_delta:
            base = list(current.prompt_token_ids)
            base.extend(current.generation_token_ids)
            if memo is not None:
                memo[key] = base
            break
        if key in seen:
            raise ChainError(f"{entry.model_call_id}: the parent links of its delta chain form a cycle at {key}")
        seen.add(key)
        path.append(current)
        parent_id = current.parent_call_id
        if not parent_id:
            raise ChainError(f"{key}: delta prompt without a parent_call_id to rebuild it from")
        parent = by_id.get(parent_id)
        if parent is None:
            raise ChainError(
                f"{key}: delta prompt whose parent {parent_id} is not in the snapshot (a hole in the chain)"
            )
        current = parent
    if not path:
        return base
    if memo is None:
        # One concatenation, one digest: the entry's digest covers its whole sequence.
        tokens = list(base)
        for item in reversed(path):
            tokens.extend(item.prompt_token_ids)
            tokens.extend(item.generation_token_ids)
        if entry.digest and compute_digest(tokens) != entry.digest:
            raise ChainError(
                f"{entry.model_call_id}: the cumulative tokens rebuilt from its delta prompt fail its digest"
            )
        return tokens
    tokens = base
    for item in reversed(path):
        tokens = tokens + list(item.prompt_token_ids) + list(item.generation_token_ids)
        if item.digest and compute_digest(tokens) != item.digest:
            raise ChainError(
                f"{item.model_call_id}: the cumulative tokens rebuilt from its delta prompt fail its digest"
            )
        memo[item.model_call_id] = tokens
    return tokens


def cumulative_prompt(
    entry: Any, entries_by_call_id: Mapping[str, Any], *, memo: dict[str, list[int]] | None = None
) -> list[int]:
    """The full prompt token ids of ``entry`` (a new list), whether it stores a full or a delta prompt.

    ``entry``: an s3capture or NeMo Gym ``TokenEntry``. A full-prompt entry's own
    ``prompt_token_ids`` are returned. A ``prompt_is_delta`` entry stores only the suffix after its
    parent's cumulative tokens: its full prompt is the parent's cumulative tokens (the parent's full
    prompt plus its ``generation_token_ids``, rebuilt the same way up to the nearest full-prompt
    ancestor, looked up by ``parent_call_id`` in ``entries_by_call_id``) followed by that suffix.
    The rebuilt cumulative tokens (prompt plus generation) of every delta entry are checked against
    its recorded ``digest`` (when it has one).

    ``memo``: optional dict, model call id -> cumulative tokens (full prompt + generation), read and
    filled; pass the same dict for every entry of one snapshot to rebuild a whole delta chain in
    time linear in its tokens. Its lists are shared: do not mutate them.

    Raises ``ChainError`` on a hole (a parent missing from ``entries_by_call_id``), a cycle, a
    delta entry without ``parent_call_id``, or rebuilt tokens that fail a digest.
    """
    tokens = _cumulative(entry, entries_by_call_id, memo)
    return tokens[: len(tokens) - len(entry.generation_token_ids)]


def _same_tokens(a: Any, b: Any) -> bool:
    return (list(a.prompt_token_ids), list(a.generation_token_ids), bool(a.prompt_is_delta)) == (
        list(b.prompt_token_ids),
        list(b.generation_token_ids),
        bool(b.prompt_is_delta),
    )


def check_chain(entries: Sequence[Any]) -> list[str]:
    """The contiguity problems of one rollout's entries (an empty list: every chain is contiguous).

    ``entries``: the entries of one snapshot (``snapshot.entries``), s3capture or NeMo Gym
    ``TokenEntry`` objects, in any order. Each problem is one line starting with the model call id
    it concerns. Reported:

    - a model call id held by two entries with different tokens;
    - a chain that cannot be rebuilt (``cumulative_prompt`` raises ``ChainError``: a hole, a cycle,
      a digest that a rebuilt delta fails);
    - a recorded ``digest`` or ``cum_len`` that does not match the entry's cumulative tokens;
    - a ``parent_call_id`` that is not among the entries (a hole);
    - a child whose full prompt does not start with its parent's cumulative tokens (the parent's
      full prompt plus its generation).

    Parent *decisions* (UNRESOLVED calls, several roots) are not problems here; ``build_rollout``
    judges them. Raises nothing for bad chains; ``AttributeError`` for objects that are not entries.
    """
    problems: list[str] = []
    by_id: dict[str, Any] = {}
    for entry in entries:
        previous = by_id.get(entry.model_call_id)
        if previous is not None:
            if previous is not entry and not _same_tokens(previous, entry):
                problems.append(f"{entry.model_call_id}: two entries with different tokens share this model call id")
            continue
        by_id[entry.model_call_id] = entry
    memo: dict[str, list[int]] = {}
    for cid, entry in by_id.items():
        try:
            tokens = _cumulative(entry, by_id, memo)
        except ChainError as error:
            problems.append(str(error))
            continue
        if not entry.prompt_is_delta and entry.digest and compute_digest(tokens) != entry.digest:
            problems.append(f"{cid}: cumulative tokens fail their digest")
        if entry.cum_len is not None and entry.cum_len != len(tokens):
            problems.append(f"{cid}: cum_len {entry.cum_len} but its cumulative tokens are {len(tokens)} long")
        parent_id = entry.parent_call_id
        if not parent_id:
            continue
        parent = by_id.get(parent_id)
        if parent is None:
            if not entry.prompt_is_delta:  # a delta entry's hole is already reported by _cumulative
                problems.append(f"{cid}: parent {parent_id} not in snapshot (a hole in the chain)")
            continue
        if entry.prompt_is_delta:
            continue  # rebuilt from the parent: contiguous by construction (and digest-checked)
        try:
            parent_tokens = _cumulative(parent, by_id, memo)
        except ChainError:
            continue  # reported on the parent
        n = len(parent_tokens)
        if len(tokens) - len(entry.generation_token_ids) < n or tokens[:n] != parent_tokens:
            problems.append(
                f"{cid}: prompt does not start with parent {parent_id}'s tokens (its prompt plus generation)"
            )
    return _unique(problems)  # a broken ancestor is reported once, not again for each descendant


def to_gym_entries(entries_or_snapshot: Any) -> list[Any]:
    """The entries as NeMo Gym 0.7.0 ``nemo_gym.token_id_capture.records.TokenEntry`` objects.

    ``entries_or_snapshot``: a snapshot (anything with ``.entries``) or an iterable of entries:
    s3capture ``TokenEntry`` (converted with ``s3capture.records.to_gym``, the conversion
    ``S3TokenStore(entry_type="gym")`` uses; delta prompts stay delta), Gym ``TokenEntry`` (passed
    through, the same objects) or dicts in the wire shape (validated by ``coerce_entry`` first).
    Order is kept. Raises ``ImportError`` (with the install command) without ``nemo_gym``,
    ``TypeError`` for other objects, ``RecordError`` for invalid records.
    """
    try:
        from nemo_gym.token_id_capture.records import TokenEntry as GymTokenEntry
    except ImportError as error:
        raise ImportError(f"to_gym_entries needs NeMo Gym ({error}); install it with: {_GYM_INSTALL}") from error
    entries = getattr(entries_or_snapshot, "entries", entries_or_snapshot)
    if isinstance(entries, (str, bytes, Mapping)) or not isinstance(entries, Iterable):
        raise TypeError(f"expected a snapshot or an iterable of entries, got {type(entries_or_snapshot).__name__}")
    out: list[Any] = []
    for entry in entries:
        if isinstance(entry, GymTokenEntry):
            out.append(entry)
        elif isinstance(entry, TokenEntry):
            out.append(to_gym(entry))
        else:
            out.append(to_gym(coerce_entry(entry)))  # TypeError / RecordError for anything else
    return out


# --------------------------------------------------------------------------- results
class Trajectory(msgspec.Struct, kw_only=True):
    """One training sequence: a rollout's main chain as one contiguous token sequence.

    ``chain_id``: the model call id of the chain's last (terminal) call. ``call_ids``: the chain's
    model call ids, root first. ``token_ids``: the root call's full prompt, then each call's
    generation and the next call's interstitial prompt tokens. ``loss_mask`` (same length): 1 on
    generated tokens, 0 on prompt tokens. ``logprobs`` (same length; natural-log probabilities of
    the sampled tokens as captured): the generation's log probability where ``loss_mask`` is 1, 0.0
    where it is 0.
    """

    chain_id: str
    call_ids: list[str]
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]


class RolloutBuild(msgspec.Struct, kw_only=True):
    """What ``build_rollout`` made of one snapshot.

    ``rollout_id``, ``snapshot_id``, ``version``: the snapshot's. ``trajectories``: with
    ``prefix_merging`` at most one (the main chain; none when no chain could be built), with
    ``per_request`` one per model call with generated tokens. ``masked``: never train on this rollout
    (Gym's ``mask_sample``; always True for an incomplete snapshot). ``mask_reasons``: why (empty
    when not masked; see the module docstring). ``metrics``: Gym's metrics dict when Gym's builder
    ran, else the built-in builder's with the same keys. ``gym_result``: the dict Gym's
    ``trajectories_from_source`` returned (engine "gym"), else None.
    """

    rollout_id: str
    snapshot_id: str
    version: int
    trajectories: list[Trajectory]
    masked: bool
    mask_reasons: list[str]
    metrics: dict
    gym_result: dict | None = None


_gym_found: bool | None = None


def _gym_importable() -> bool:
    """Whether NeMo Gym's consumer imports (checked once per process)."""
    global _gym_found
    if _gym_found is None:
        try:
            importlib.import_module("nemo_gym.token_id_capture.consumer")
            _gym_found = True
        except ImportError:
            _gym_found = False
    return _gym_found


def build_rollout(snapshot: "FrozenSnapshot", *, builder: str = "prefix_merging", engine: str = "auto") -> RolloutBuild:
    """Build the training trajectory of one frozen rollout; never raises for a bad rollout.

    ``snapshot``: a ``FrozenSnapshot`` (``S3TokenStore.freeze`` / ``read_snapshot``, either
    ``entry_type``) or any ``TokenCaptureSnapshot`` (its ``reasons`` are then empty).
    ``builder``: ``"prefix_merging"`` (the only builder NeMo Gym 0.7.0 has; both engines) or
    ``"per_request"`` (the built-in engine's own: one trajectory per model call with generated
    tokens; ``"auto"`` then picks the built-in engine). ``engine``: ``"gym"`` (NeMo Gym's own
    ``trajectories_from_source``), ``"builtin"`` (no Gym needed) or ``"auto"`` (``"gym"`` when
    ``nemo_gym`` is importable). The module docstring gives both engines' rules and how Gym's
    result becomes ``Trajectory`` rows.

    A malformed, incomplete or ambiguous rollout is returned masked with its reasons. Raises
    ``ValueError`` for an unknown ``engine`` or ``builder`` (a caller's mistake, not a rollout's:
    masking every rollout for it would hide it), ``ImportError`` for ``engine="gym"`` without
    ``nemo_gym``, ``TypeError`` when ``snapshot`` is not a snapshot.

    Synchronous and CPU-bound (the Gym engine runs Gym's coroutine on a private event loop of the
    calling thread); from async code await ``build_rollout_async`` (the same result without a
    private loop), or call this through ``asyncio.to_thread`` (called on a running event loop it
    still works, on a helper thread, but blocks that loop meanwhile).
    """
    if _choose_engine(snapshot, builder, engine) == "gym":
        return _build_with_gym(snapshot, builder)
    return _build_builtin(snapshot, builder)


async def build_rollout_async(
    snapshot: "FrozenSnapshot", *, builder: str = "prefix_merging", engine: str = "auto"
) -> RolloutBuild:
    """``build_rollout`` on the caller's running event loop: the same result and errors.

    Gym's engine awaits Gym's ``trajectories_from_source`` directly (no private loop, no thread);
    the built-in engine is plain synchronous code. Either way the build is CPU-bound and holds the
    loop for its duration (about a millisecond per rollout of four 1,000-token calls,
    ``tools/bench_export.py``), which is what an exporter whose requests run in the background
    (object_store's runtime, the kernel's socket buffers) wants: no thread hand-off and no second
    event loop per rollout (``s3capture export`` spends about 5% less CPU than with
    ``asyncio.to_thread(build_rollout, ...)``). Gym's consumer itself still runs its builder
    through ``asyncio.to_thread``.
    """
    if _choose_engine(snapshot, builder, engine) == "gym":
        from nemo_gym.token_id_capture.consumer import trajectories_from_source

        result = await trajectories_from_source(snapshot.rollout_id, _SnapshotSource(snapshot), builder=builder)
        return _gym_build(snapshot, result)
    return _build_builtin(snapshot, builder)


def _choose_engine(snapshot: Any, builder: str, engine: str) -> str:
    """The engine ``build_rollout`` runs (``"gym"`` or ``"builtin"``), after its argument checks."""
    if engine not in _ENGINES:
        raise ValueError(f"engine must be one of {list(_ENGINES)}, got {engine!r}")
    if not isinstance(builder, str):
        raise TypeError(f"builder must be a string, got {type(builder).__name__}")
    for name in ("rollout_id", "entries", "incomplete", "snapshot_id", "version"):
        if not hasattr(snapshot, name):
            raise TypeError(
                f"expected a FrozenSnapshot (or TokenCaptureSnapshot), got {type(snapshot).__name__} without {name!r}"
            )
    if engine == "auto":
        # Gym's engine for the builders Gym has; ``per_request`` is the built-in engine's own.
        engine = "gym" if _gym_importable() and builder != "per_request" else "builtin"
    if engine == "gym":
        if not _gym_importable():
            raise ImportError(f"engine='gym' needs NeMo Gym; install it with: {_GYM_INSTALL}")
        _check_gym_builder(builder)
        return "gym"
    if builder not in _BUILDERS:
        raise ValueError(f"unknown builder {builder!r} for the built-in engine; known: {list(_BUILDERS)}")
    return "builtin"


def _incomplete(snapshot: Any) -> bool:
    """``snapshot.incomplete``, or a snapshot that gives reasons (a contradiction: taken as incomplete)."""
    return bool(snapshot.incomplete) or bool(getattr(snapshot, "reasons", ()))


def _snapshot_reasons(snapshot: Any) -> list[str]:
    reasons = [str(r) for r in getattr(snapshot, "reasons", ()) or ()]
    if _incomplete(snapshot):
        reasons.append("capture_incomplete")
    return reasons


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _rollout_build(
    snapshot: Any,
    trajectories: list[Trajectory],
    masked: bool,
    reasons: list[str],
    metrics: dict,
    gym_result: dict | None = None,
) -> RolloutBuild:
    """The ``RolloutBuild`` of ``snapshot`` (either engine): reasons kept only when masked."""
    return RolloutBuild(
        rollout_id=snapshot.rollout_id,
        snapshot_id=snapshot.snapshot_id,
        version=snapshot.version,
        trajectories=trajectories,
        masked=masked,
        mask_reasons=_unique(reasons) if masked else [],
        metrics=metrics,
        gym_result=gym_result,
    )


# --------------------------------------------------------------------------- engine "gym"
def _check_gym_builder(builder: str) -> None:
    """Raise ``ValueError`` for a builder Gym's ``run_builder`` does not know (its own check, on no entries)."""
    from nemo_gym.token_id_capture.builder import run_builder

    try:
        run_builder([], builder)
    except ValueError as error:
        raise ValueError(f"NeMo Gym does not know this builder: {error}") from None


class _SnapshotSource:
    """A ``TokenSource`` whose ``freeze`` returns one given snapshot (converted to Gym entries)."""

    def __init__(self, snapshot: Any) -> None:
        self._snapshot = snapshot

    async def freeze(self, rollout_id: str) -> Any:
        from nemo_gym.token_id_capture.protocols import TokenCaptureSnapshot as GymSnapshot

        snap = self._snapshot
        if rollout_id != snap.rollout_id:
            raise ValueError(f"this source holds rollout {snap.rollout_id!r}, not {rollout_id!r}")
        return GymSnapshot(
            snap.rollout_id, tuple(to_gym_entries(snap.entries)), _incomplete(snap), snap.snapshot_id, snap.version
        )


class _Loop:
    """The private event loop of one thread, closed when the thread ends (its thread-local goes)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.pid = os.getpid()

    def __del__(self) -> None:
        loop = self.loop
        if self.pid == os.getpid() and not loop.is_closed() and not loop.is_running():
            loop.close()


_local = threading.local()


def _run(coroutine_factory: Any) -> Any:
    """Run ``coroutine_factory()`` to completion from synchronous code.

    One event loop per thread and process, reused (``asyncio.run`` would build and tear down a loop
    and its thread pool per rollout, ~1.5 ms) and closed with its thread; from a thread whose loop
    is running, on a helper thread with ``asyncio.run``.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(lambda: asyncio.run(coroutine_factory())).result()
    holder = getattr(_local, "holder", None)
    if holder is None or holder.pid != os.getpid() or holder.loop.is_closed():  # a forked child builds its own
        holder = _local.holder = _Loop()
    return holder.loop.run_until_complete(coroutine_factory())


def _build_with_gym(snapshot: Any, builder: str) -> RolloutBuild:
    from nemo_gym.token_id_capture.consumer import trajectories_from_source

    source = _SnapshotSource(snapshot)
    result = _run(lambda: trajectories_from_source(snapshot.rollout_id, source, builder=builder))
    return _gym_build(snapshot, result)


def _gym_build(snapshot: Any, result: dict) -> RolloutBuild:
    """The ``RolloutBuild`` of Gym's ``trajectories_from_source`` result for ``snapshot``."""
    metrics = dict(result.get("metrics") or {})
    masked = bool(result.get("mask_sample"))
    reasons = _snapshot_reasons(snapshot)
    trajectories: list[Trajectory] = []
    response = result.get("rebuilt_response")
    if response is not None:
        trajectory, problem = _trajectory_from_response(response, snapshot.entries)
        if trajectory is not None:
            trajectories.append(trajectory)
        else:
            masked = True
            reasons.append(problem)
    if masked:
        reasons.append("gym_mask_sample")
        if result.get("error"):
            reasons.append(f"gym_error:{result['error']}")
        reasons.extend(f"unresolved_retry:{cid}" for cid in result.get("unresolved_retries") or ())
        unresolved = result.get("unresolved_parent_calls") or ()
        reasons.extend(f"unresolved_parent:{cid}" for cid in unresolved)
        # Gym counts a call without any parent decision among its unresolved parents; name the
        # cause as the built-in builder does (the capture path never stamped the entry).
        reasons.extend(
            f"missing_resolution:{cid}"
            for e in snapshot.entries
            if (cid := getattr(e, "model_call_id", None)) in unresolved
            and getattr(e, "parent_resolution", None) is None
            and not getattr(e, "parent_call_id", None)
        )
        for name in ("roots", "chains"):
            if name in metrics and metrics[name] != 1:
                reasons.append(f"{name}:{metrics[name]}")
    return _rollout_build(snapshot, trajectories, masked, reasons, metrics, gym_result=result)


def _trajectory_from_response(response: dict, entries: Sequence[Any]) -> tuple[Trajectory | None, str]:
    """Gym's ``rebuilt_response`` as a ``Trajectory`` (see the module docstring), or ``(None, reason)``."""
    token_ids: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    generated = [
        item
        for item in response.get("output", [])
        if isinstance(item, dict) and item.get("generation_token_ids") is not None
    ]
    by_id: dict[str, Any] = {}
    for entry in entries:
        by_id.setdefault(entry.model_call_id, entry)
    memo: dict[str, list[int]] = {}
    index: dict[tuple[int, tuple[int, ...]], list[tuple[Any, list[int]]]] = {}
    for entry in by_id.values():
        try:
            cumulative = _cumulative(entry, by_id, memo)
        except ChainError:
            continue  # Gym excluded it too (delta_chain_unreconstructable)
        generated_ids = tuple(entry.generation_token_ids)
        index.setdefault((len(cumulative) - len(generated_ids), generated_ids), []).append((entry, cumulative))
    candidates: list[list[Any]] = []
    for position, item in enumerate(generated):
        prompt = list(item.get("prompt_token_ids") or [])
        generation = list(item["generation_token_ids"])
        probs = list(item.get("generation_log_probs") or [])
        seen = len(token_ids)
        if prompt[:seen] != token_ids or len(probs) != len(generation):
            return None, f"gym_output_not_contiguous:{position}"
        full = prompt + generation
        matches = [e for e, cumulative in index.get((len(prompt), tuple(generation)), ()) if cumulative == full]
        if not matches:
            return None, f"gym_output_unmatched:{position}"
        candidates.append(matches)
        interstitial = prompt[seen:]
        token_ids.extend(interstitial)
        loss_mask.extend([0] * len(interstitial))
        logprobs.extend([0.0] * len(interstitial))
        token_ids.extend(generation)
        loss_mask.extend([1] * len(generation))
        logprobs.extend(map(float, probs))
    if not candidates:
        return None, "no_generated_tokens"
    # Several entries with the same tokens (a retry that generated the same text): the chain runs
    # through the one its next call names as parent; at the end, Gym keeps the smallest id.
    call_ids: list[str] = []
    for matches in reversed(candidates):
        named = [e for e in matches if call_ids and e.model_call_id == by_id[call_ids[-1]].parent_call_id]
        call_ids.append(min(e.model_call_id for e in named or matches))
    call_ids.reverse()
    return Trajectory(
        chain_id=call_ids[-1], call_ids=call_ids, token_ids=token_ids, loss_mask=loss_mask, logprobs=logprobs
    ), ""


# --------------------------------------------------------------------------- engine "builtin"
@dataclass(eq=False)
class _Node:
    entry: Any
    prompt_len: int
    cumulative: list[int]
    parent: "_Node | None" = None
    children: list["_Node"] = field(default_factory=list)
    quarantined: bool = False


def _status(entry: Any) -> str | None:
    value = entry.parent_resolution
    return None if value is None else str(getattr(value, "value", value))


def _build_builtin(snapshot: Any, builder: str = "prefix_merging") -> RolloutBuild:
    entries = list(snapshot.entries)
    reasons = _snapshot_reasons(snapshot)

    def result(trajectories: list[Trajectory], masked: bool, metrics: dict) -> RolloutBuild:
        masked = masked or bool(reasons)
        if _incomplete(snapshot):
            metrics["capture_incomplete"] = True
        return _rollout_build(snapshot, trajectories, masked, reasons, metrics)

    if not entries:
        reasons.append("no_entries")
        return result([], True, {"n_calls": 0})
    failed_metrics = {"n_calls": len(entries), "terminal_attribution": {**_NO_ATTRIBUTION, "chain": "error"}}

    failures: dict[str, int] = {}
    unresolved_parents: list[str] = []

    def fail(kind: str, cid: str, reason: str | None = None) -> None:
        failures[kind] = failures.get(kind, 0) + 1
        unresolved_parents.append(cid)
        reasons.append(f"{reason or kind}:{cid}")

    # Duplicates: an identical one is a redelivery; different tokens under one id are corrupt.
    by_id: dict[str, Any] = {}
    for entry in entries:
        previous = by_id.get(entry.model_call_id)
        if previous is None:
            by_id[entry.model_call_id] = entry
        elif previous is not entry and not _same_tokens(previous, entry):
            fail("duplicate_call_id_conflict", entry.model_call_id)

    # Full prompts, verified (delta prompts are rebuilt through their parents first).
    memo: dict[str, list[int]] = {}
    survivors: list[tuple[Any, list[int]]] = []
    for cid, entry in by_id.items():
        try:
            cumulative = _cumulative(entry, by_id, memo)
        except ChainError:
            fail("delta_chain_unreconstructable", cid)
            continue
        if not entry.prompt_is_delta and entry.digest and compute_digest(cumulative) != entry.digest:
            reasons.append(f"digest_mismatch:{cid}")
        if entry.cum_len is not None and entry.cum_len != len(cumulative):
            reasons.append(f"cum_len_mismatch:{cid}")
        if len(entry.generation_log_probs) != len(entry.generation_token_ids):
            reasons.append(f"logprob_length_mismatch:{cid}")
        survivors.append((entry, cumulative))

    empty = [e.model_call_id for e, _ in survivors if not e.generation_token_ids]
    reasons.extend(f"empty_generation:{cid}" for cid in empty)
    survivors = [(e, c) for e, c in survivors if e.generation_token_ids]
    if not survivors:
        reasons.append("no_trainable_chain")
        return result([], True, failed_metrics)
    if builder == "per_request":
        return _per_request(survivors, entries, reasons, failures, empty, result)

    # Link calls by their recorded parents, shortest prompt first (a parent's prompt is shorter).
    survivors.sort(key=lambda pair: (len(pair[1]) - len(pair[0].generation_token_ids), pair[0].model_call_id))
    nodes: list[_Node] = []
    roots: list[_Node] = []
    nodes_by_id: dict[str, _Node] = {}
    for entry, cumulative in survivors:
        cid = entry.model_call_id
        node = _Node(entry, len(cumulative) - len(entry.generation_token_ids), cumulative)
        status = _status(entry)
        parent: _Node | None = None
        if status == "root":
            pass
        elif status == "unresolved":
            fail("parent_unresolved", cid)
        elif status == "resolved" or entry.parent_call_id is not None:
            if entry.parent_call_id is None:
                fail("resolved_parent_missing_id", cid)
            elif (candidate := nodes_by_id.get(entry.parent_call_id)) is None:
                fail("parent_call_id_missing", cid, "missing_parent")
            elif (
                node.prompt_len >= len(candidate.cumulative)
                and cumulative[: len(candidate.cumulative)] == candidate.cumulative
            ):
                parent = candidate
            else:
                fail("parent_digest_mismatch", cid, "not_contiguous")
        else:
            fail("missing_resolution", cid)
        if parent is not None:
            node.parent = parent
            parent.children.append(node)
        else:
            roots.append(node)
        nodes.append(node)
        nodes_by_id[cid] = node

    # Retry siblings (same parent, same prompt): keep the ones a later call extends; when none is
    # extended keep the smallest id and report the group unresolved (Gym's rule without a terminal).
    unresolved_retries: list[str] = []
    quarantined = 0
    groups: dict[Any, list[_Node]] = {}
    for node in nodes:
        groups.setdefault("roots" if node.parent is None else id(node.parent), []).append(node)
    for group in groups.values():
        by_prompt: dict[tuple[int, ...], list[_Node]] = {}
        for node in group:
            by_prompt.setdefault(tuple(node.cumulative[: node.prompt_len]), []).append(node)
        for retry_group in by_prompt.values():
            if len(retry_group) < 2:
                continue
            extended = [n for n in retry_group if any(not child.quarantined for child in n.children)]
            if extended:
                keep = set(extended)
            else:
                keep = {min(retry_group, key=lambda n: n.entry.model_call_id)}
                unresolved_retries.extend(n.entry.model_call_id for n in retry_group)
            for node in retry_group:
                if node not in keep and not node.quarantined:
                    node.quarantined = True
                    quarantined += 1
    reasons.extend(f"unresolved_retry:{cid}" for cid in unresolved_retries)

    # Root-to-leaf chains without a quarantined call; the main one has the earliest root.
    chains: list[list[_Node]] = []
    for leaf in (n for n in nodes if not n.children):
        path: list[_Node] = []
        current: _Node | None = leaf
        while current is not None:
            path.append(current)
            current = current.parent
        if not any(n.quarantined for n in path):
            chains.append(path[::-1])
    if len(roots) != 1:
        reasons.append(f"roots:{len(roots)}")
    if len(chains) != 1:
        reasons.append(f"chains:{len(chains)}")
    if not chains:
        reasons.append("no_trainable_chain")
        return result([], True, failed_metrics)
    main = min(chains, key=lambda c: (c[0].entry.created_at, c[0].entry.model_call_id))

    token_ids: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    for node in main:
        interstitial = node.cumulative[len(token_ids) : node.prompt_len]
        token_ids.extend(interstitial)
        loss_mask.extend([0] * len(interstitial))
        logprobs.extend([0.0] * len(interstitial))
        token_ids.extend(node.entry.generation_token_ids)
        loss_mask.extend([1] * len(node.entry.generation_token_ids))
        logprobs.extend(map(float, node.entry.generation_log_probs))  # C-level: a generator cost ~5 ms a rollout
    if any(r.startswith("logprob_length_mismatch:") for r in reasons):
        return result([], True, failed_metrics)  # log probabilities that do not align: Gym fails the build
    call_ids = [n.entry.model_call_id for n in main]
    trajectories = [
        Trajectory(
            chain_id=call_ids[-1], call_ids=call_ids, token_ids=token_ids, loss_mask=loss_mask, logprobs=logprobs
        )
    ]

    captured = sum(len(e.generation_token_ids) for e, _ in survivors)
    delivered = sum(len(n.entry.generation_token_ids) for n in main)
    metrics = {
        "n_calls": len(entries),
        "terminal_attribution": {**_NO_ATTRIBUTION, "chain": ""},
        "chains": len(chains),
        "roots": len(roots),
        "quarantined_calls": quarantined,
        "quarantined_fraction": round(quarantined / len(entries), 4),
        "delivered_fraction": round(delivered / captured, 4) if captured else 0.0,
        "generated_tokens_captured": captured,
        "generated_tokens_delivered": delivered,
        "parent_link_failures": failures,
        "unresolved_parent_calls": len(unresolved_parents),
        "empty_generation_calls": len(empty),
    }
    return result(trajectories, bool(reasons), metrics)


def _per_request(
    survivors: list[tuple[Any, list[int]]],
    entries: list[Any],
    reasons: list[str],
    failures: dict[str, int],
    empty: list[str],
    result: Any,
) -> RolloutBuild:
    """Builder ``per_request``: one trajectory per model call with generated tokens, ordered by
    prompt length then call id. ``token_ids`` is the call's full prompt (loss 0) and its generation
    (loss 1); ``chain_id`` and ``call_ids`` name the call. Parent links are not needed to build it,
    but the rollout is masked on the same evidence as ``prefix_merging`` (an incomplete snapshot,
    a delta prompt that cannot be rebuilt, a digest, length or log-probability mismatch, an empty
    generation), so a rollout with a hole is never trainable whichever builder reads it."""
    if any(r.startswith("logprob_length_mismatch:") for r in reasons):
        return result([], True, {"n_calls": len(entries), "parent_link_failures": failures})
    ordered = sorted(
        survivors, key=lambda pair: (len(pair[1]) - len(pair[0].generation_token_ids), pair[0].model_call_id)
    )
    trajectories = []
    for entry, cumulative in ordered:
        generated = len(entry.generation_token_ids)
        prompt = len(cumulative) - generated
        trajectories.append(
            Trajectory(
                chain_id=entry.model_call_id,
                call_ids=[entry.model_call_id],
                token_ids=list(cumulative),
                loss_mask=[0] * prompt + [1] * generated,
                logprobs=[0.0] * prompt + list(map(float, entry.generation_log_probs)),
            )
        )
    captured = sum(len(e.generation_token_ids) for e, _ in survivors)
    metrics = {
        "n_calls": len(entries),
        "generated_tokens_captured": captured,
        "generated_tokens_delivered": captured,
        "parent_link_failures": failures,
        "empty_generation_calls": len(empty),
    }
    return result(trajectories, bool(reasons), metrics)
