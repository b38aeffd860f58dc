"""The export's options, checked before anything is read: ``parse_duration`` and ``read_ids`` (the
command line's ``--min-age`` and ``--ids``), ``check_destination`` (a destination apart from the
source's rollouts), ``_check_options`` (every option of ``export``, the builder and engine probed
once), and the small helpers ``export`` decides with (``_resolved_engine``, ``_root_of``,
``_called_by_a_reimported_script``)."""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from s3capture.errors import install_hint
from s3capture.export.destination_base import _is_s3
from s3capture.export.engines import ENGINES, _import_ray
from s3capture.export.records import BUILD_WITH, FORMATS, MASKED_CHOICES, STATES, TOKEN_TYPES


def parse_duration(text: str) -> float:
    """Seconds from ``"90"``, ``"90s"``, ``"10m"``, ``"2h"`` or ``"1d"``; ``ValueError`` otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(text))
    if not match:
        raise ValueError(f"expected a duration such as 90s, 10m, 2h or 1d, got {text!r}")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]


def read_ids(path: str | os.PathLike) -> list[str]:
    """Rollout ids of an ``--ids`` file: one per line; blank lines and lines starting with ``#``
    are ignored, surrounding whitespace is stripped. ``ValueError`` for an unreadable or empty file."""
    try:
        with open(path, encoding="utf-8-sig") as handle:  # a BOM (Notepad, PowerShell) is not part of an id
            ids = [line.strip() for line in handle]
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--ids {path}: cannot read it: {error}") from None
    ids = [i for i in ids if i and not i.startswith("#")]
    if not ids:
        raise ValueError(f"--ids {path}: no rollout id in it")
    return ids


def check_destination(url: str, dest: str) -> None:
    """Refuse an ``s3://`` destination inside the source root's rollouts, or one that contains
    them (its scan would list every captured object), or whose prefix servers would not keep as
    written (``s3capture.layout.check_prefix_segments``: ``//``, ``.``, ``..``, a backslash).
    ``ValueError``; a local folder passes."""
    from s3capture.layout import check_prefix_segments
    from s3capture.rollouts import parse_s3_url

    bucket, root = parse_s3_url(url)
    if _is_s3(dest):
        dest_bucket, dest_prefix = parse_s3_url(dest)
        try:
            check_prefix_segments(dest_prefix)
        except ValueError as error:
            raise ValueError(f"destination {dest}: {error}") from None
        inside = f"{root}/rollouts" if root else "rollouts"
        if dest_bucket == bucket and (
            dest_prefix == inside or dest_prefix.startswith(inside + "/") or "rollouts" in dest_prefix.split("/")
        ):
            raise ValueError(f"destination {dest} lies inside the rollouts of {url}; choose a prefix outside it")
        if dest_bucket == bucket and (not dest_prefix or inside.startswith(dest_prefix + "/")):
            # The destination scan lists every key under DEST: here every captured object, each run.
            raise ValueError(
                f"destination {dest} contains the rollouts of {url}: reading the destination would list every captured "
                "object; choose a prefix beside them"
            )


def _check_options(url: str, dest: str, opts: dict[str, Any]) -> None:
    from s3capture.rollouts import parse_s3_url

    parse_s3_url(url)
    for name, allowed in (
        ("format", FORMATS),
        ("masked", MASKED_CHOICES),
        ("build_with", BUILD_WITH),
        ("token_type", TOKEN_TYPES),
    ):
        if opts[name] not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {opts[name]!r}")
    if opts["format"] == "gym-jsonl" and opts["builder"] == "per_request":
        # A Gym JSONL line is the one response (main chain) Gym's consumer returns for a rollout;
        # per_request gives one trajectory per call, all but one of which it would leave out.
        raise ValueError(
            "--format gym-jsonl holds one Gym response (the main chain) per rollout and Gym has no "
            "per_request builder: use --format parquet with --builder per_request"
        )
    if opts["engine"] not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {opts['engine']!r}")
    for name in opts["states"]:
        if name not in STATES:
            raise ValueError(f"state must be among {', '.join(STATES)}, got {name!r}")
    for name, low in (("workers", 0), ("concurrency", 1), ("shard_rollouts", 1), ("row_group_rows", 1)):
        if not isinstance(opts[name], int) or opts[name] < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {opts[name]!r}")
    if not opts["min_age"] >= 0:  # NaN too: no age compares below it, every open rollout would pass
        raise ValueError(f"min_age must be >= 0 seconds, got {opts['min_age']!r}")
    if isinstance(opts["ids"], (str, bytes)):
        raise TypeError("ids must be a collection of rollout ids, not a single str")
    if not opts["fence_grace"] >= 0:
        raise ValueError(f"fence_grace must be >= 0 seconds, got {opts['fence_grace']!r}")
    if opts["engine"] == "ray":
        _import_ray()  # one line naming the extra, before anything is read
        if opts["workers"] < 1:
            raise ValueError(f"--engine ray needs --workers >= 1 (Ray tasks at once), got {opts['workers']}")
    if not dest:
        raise ValueError("no destination (dest, or --out on the command line)")
    check_destination(url, dest)
    if opts["format"] == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ValueError(f"--format parquet needs pyarrow: {install_hint('parquet')}") from None
    # The builder and engine, checked once here (on an empty snapshot, which only masks) rather than
    # failing every rollout (NeMo Gym 0.7.0 knows prefix_merging only; per_request is built-in).
    from s3capture.store import FrozenSnapshot
    from s3capture.trajectory import build_rollout

    try:
        build_rollout(
            FrozenSnapshot("s3capture-export-probe", (), False, "", 0),
            builder=opts["builder"],
            engine=opts["build_with"],
        )
    except ValueError as error:
        raise ValueError(f"--builder {opts['builder']} --build-with {opts['build_with']}: {error}") from None
    except ImportError as error:
        raise ValueError(f"--build-with {opts['build_with']}: {error}") from None


def _resolved_engine(builder: str, build_with: str) -> str:
    """``"gym"`` or ``"builtin"``: the engine ``build_with`` (``auto`` | ``gym`` | ``builtin``) picks here."""
    from s3capture.store import FrozenSnapshot
    from s3capture.trajectory import _choose_engine

    return _choose_engine(FrozenSnapshot("s3capture-export-probe", (), False, "", 0), builder, build_with)


def _root_of(url: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of a source URL, so that ``s3://b/run`` and ``s3://b/run/`` compare equal."""
    from s3capture.rollouts import parse_s3_url

    try:
        return parse_s3_url(url)
    except ValueError:
        return url, ""


def _called_by_a_reimported_script() -> bool:
    """Whether this call comes from the top-level code of a script that a ``spawn`` child is
    re-importing as ``__mp_main__`` (a script that calls ``export`` without a ``__main__`` guard):
    left to run, it would start an export of its own inside the worker."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        # (spawn runs the script through runpy under the name __mp_main__, in a namespace of its own)
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            return True
        frame = frame.f_back
    return False
