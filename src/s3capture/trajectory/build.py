"""The builder's entry points: ``build_rollout`` and ``build_rollout_async``, and the engine choice.

``_choose_engine`` checks the arguments and picks the engine (``"gym"`` when NeMo Gym's consumer
imports, ``_gym_importable``, checked once per process in ``_gym_found``; ``"builtin"`` otherwise
and for ``per_request``); the engines themselves are in ``gym`` and ``builtin``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from s3capture.trajectory.builtin import _build_builtin
from s3capture.trajectory.gym import (
    _GYM_INSTALL,
    _build_with_gym,
    _check_gym_builder,
    _gym_build,
    _SnapshotSource,
)
from s3capture.trajectory.results import RolloutBuild

if TYPE_CHECKING:  # importing the store would import aioboto3
    from s3capture.store import FrozenSnapshot


_BUILDERS = ("prefix_merging", "per_request")
"""Builders of the built-in engine. ``per_request`` (not in NeMo Gym 0.7.0) gives one trajectory per
model call: its full prompt (loss 0) and its generation (loss 1)."""
_ENGINES = ("auto", "gym", "builtin")


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
