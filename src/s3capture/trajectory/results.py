"""The builders' results: ``Trajectory`` and ``RolloutBuild``, and the helpers both engines share.

``_rollout_build`` makes the ``RolloutBuild`` of a snapshot (reasons kept only when masked);
``_incomplete`` and ``_snapshot_reasons`` read a snapshot's own incompleteness and reasons, which
both engines put first in ``mask_reasons``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from s3capture.trajectory.chains import _unique


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


def _incomplete(snapshot: Any) -> bool:
    """``snapshot.incomplete``, or a snapshot that gives reasons (a contradiction: taken as incomplete)."""
    return bool(snapshot.incomplete) or bool(getattr(snapshot, "reasons", ()))


def _snapshot_reasons(snapshot: Any) -> list[str]:
    reasons = [str(r) for r in getattr(snapshot, "reasons", ()) or ()]
    if _incomplete(snapshot):
        reasons.append("capture_incomplete")
    return reasons


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
