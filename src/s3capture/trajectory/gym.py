"""NeMo Gym conversion and the ``engine="gym"`` builder (issue 9).

``to_gym_entries`` converts entries to NeMo Gym 0.7.0 ``TokenEntry`` objects. The Gym engine runs
Gym's own ``trajectories_from_source`` on an in-process source (``_SnapshotSource``) holding one
snapshot, on a private per-thread event loop from synchronous code (``_run``), and maps Gym's
result and ``rebuilt_response`` back onto the snapshot's entries (``_gym_build``,
``_trajectory_from_response``; the rules are in the ``s3capture.trajectory`` package docstring).
NeMo Gym is imported only when a function here needs it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from s3capture.records import TokenEntry, coerce_entry, to_gym
from s3capture.trajectory.chains import ChainError, _cumulative
from s3capture.trajectory.results import (
    RolloutBuild,
    Trajectory,
    _incomplete,
    _rollout_build,
    _snapshot_reasons,
)


_GYM_INSTALL = "pip install pydantic orjson && pip install --no-deps --ignore-requires-python nemo-gym==0.7.0"


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
        # Why Gym's builder refused parent links (e.g. parent_digest_mismatch: a child's prompt
        # does not start with its parent's tokens), which otherwise only its metrics say.
        failures = metrics.get("parent_link_failures") or {}
        if isinstance(failures, dict):
            reasons.extend(f"parent_link_failures:{kind}={count}" for kind, count in sorted(failures.items()))
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
