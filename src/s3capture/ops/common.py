"""Helpers every ``s3capture.ops`` operation shares: the clock ages are taken at, LastModified
arithmetic, the stderr progress counter and a rollout's key prefix."""

from __future__ import annotations

import datetime
import sys
from collections.abc import Callable, Iterable
from typing import Any

from s3capture.clocks import store_time
from s3capture.rollouts import RolloutObjects
from s3capture.transport import ListedObject


# --------------------------------------------------------------------------- helpers
def _age(now: float, modified: float) -> float:
    return now - modified


def _clock(store: Any, now: float | None) -> Callable[..., float]:
    """Seconds since the epoch to take ages at: ``now`` when given, else the time the listing of
    ``info`` (an optional argument) was answered (``RolloutInfo.listed_at``), else
    ``store_time(store)``. An age taken when a listed rollout's turn comes would grow by however
    long the work before it took, and make a rollout written just before its listing look old."""
    if now is not None:
        return lambda info=None: now

    def clock(info: Any = None) -> float:  # a RolloutInfo, or anything with a listed_at
        listed_at = getattr(info, "listed_at", None)
        return listed_at if listed_at else store_time(store)

    return clock


def _newest(items: Iterable[ListedObject]) -> float:
    return max((item.modified for item in items), default=0.0)


def _when(modified: float) -> datetime.datetime | None:
    return datetime.datetime.fromtimestamp(modified, tz=datetime.timezone.utc) if modified > 0 else None


def _progress(enabled: bool, what: str) -> Any:
    """A tqdm counter of listed rollouts on stderr (disabled: a no-op with the same methods)."""
    from tqdm import tqdm

    return tqdm(desc=what, unit=" rollouts", file=sys.stderr, disable=not enabled, leave=False, mininterval=0.5)


def _rollout_prefix(store: RolloutObjects, rollout_id: str) -> str:
    return store.layout.rollout(rollout_id)
