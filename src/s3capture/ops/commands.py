"""The ``s3capture ls``, ``status`` and ``gc`` subcommands: their argparse options (``register``),
``--state`` parsing, and the command functions that open the store, run the operation and print
(the empty-listing hints on stderr included)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Any

import msgspec

from s3capture.ops.formatting import _counted, format_action, format_gc, format_rollout_row, format_status
from s3capture.ops.gc_run import MIN_SAFE_AGE, GcAction, gc
from s3capture.ops.roots import roots_near
from s3capture.ops.status_report import StoreStatus, status
from s3capture.rollouts import ROLLOUT_STATES, RolloutObjects


# --------------------------------------------------------------------------- command line
def _state_list(text: str) -> tuple[str, ...]:
    """``--state`` of ``ls``: comma-separated state names (the option also repeats)."""
    import argparse

    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    bad = [name for name in names if name not in ROLLOUT_STATES]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(ROLLOUT_STATES)}, got {text!r}"
        )
    return names


def _given_states(groups: list[tuple[str, ...]] | None) -> list[str] | None:
    """The states of every ``--state`` given (``action="append"`` of ``_state_list``), in order,
    each once; ``None`` when none was given."""
    return list(dict.fromkeys(name for group in groups for name in group)) if groups else None


def register(sub: Any) -> dict[str, Any]:
    """Add ``ls``, ``status`` and ``gc`` to an argparse subparsers object; returns name -> parser."""
    from s3capture.cli import _argument, check_endpoint, check_s3_url

    def duration(text: str) -> float:
        from s3capture.export import parse_duration

        return parse_duration(text)

    parsers: dict[str, Any] = {}
    ls = sub.add_parser(
        "ls",
        help="list a root's rollouts with state, objects, bytes and last write",
        description="One streaming listing of URL's rollouts (LIST only). A table on a terminal, "
        "tab-separated lines otherwise, JSON lines with --json.",
    )
    st = sub.add_parser(
        "status",
        help="counts by state, oldest open rollout, masked counts, retired leftovers",
        description="One streaming listing plus one GET per frozen rollout's newest manifest "
        "(--no-manifests: LIST only). See docs/operations.md.",
    )
    g = sub.add_parser(
        "gc",
        help="remove what retired rollouts leave behind (dry run unless --yes)",
        description="Delete the fence and tombstone of retired rollouts whose every key is older than "
        "--retired-older-than (retiring again those that hold straggler objects), after re-listing "
        "each one; report open rollouts quiet for that long without deleting them. A dry run unless "
        "--yes. See docs/operations.md for the rules and for what removing a fence means for id reuse.",
    )
    for parser in (ls, st, g):
        parser.add_argument(
            "url", type=_argument(check_s3_url), help="s3://bucket/prefix the rollouts were captured under"
        )
        parser.add_argument(
            "--endpoint",
            type=_argument(check_endpoint),
            help="S3 endpoint URL (default: AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, else AWS S3)",
        )
        parser.add_argument("--prefix", default="", help="only rollout ids starting with this text")
        parser.add_argument("--json", action="store_true", help="machine-readable output")
    ls.add_argument(
        "--state",
        type=_state_list,
        action="append",
        metavar="STATES",
        help=f"only these states: comma-separated and repeatable, among {', '.join(ROLLOUT_STATES)}",
    )
    for parser in (st, g):
        parser.add_argument("--no-progress", action="store_true", help="no progress counter on stderr")
    st.add_argument("--no-manifests", action="store_true", help="LIST only: skip the masked counts")
    g.add_argument(
        "--retired-older-than",
        type=_argument(duration),
        required=True,
        metavar="AGE",
        help="handle a retired rollout only when every key under it is this old, e.g. 7d, 12h (a bare number is seconds)",
    )
    g.add_argument(
        "--abandoned-after",
        type=_argument(duration),
        metavar="AGE",
        help="report open rollouts quiet for this long (default: --retired-older-than)",
    )
    g.add_argument("--yes", action="store_true", help="delete (default: a dry run that deletes nothing)")
    ls.set_defaults(func=_ls_command)
    st.set_defaults(func=_status_command)
    g.set_defaults(func=_gc_command)
    parsers.update({"ls": ls, "status": st, "gc": g})
    return parsers


def _open_store(args: Any) -> Any:
    import os

    from s3capture.store import S3TokenStore

    if args.endpoint:
        os.environ["AWS_ENDPOINT_URL"] = os.environ["AWS_ENDPOINT_URL_S3"] = args.endpoint
    return S3TokenStore(args.url, endpoint_url=args.endpoint)


async def _close_after(store: Any, work: Any) -> Any:
    try:
        return await work
    finally:
        await store.close()


def _ls_command(args: Any) -> int:
    store = _open_store(args)
    table = sys.stdout is not None and sys.stdout.isatty() and not args.json  # None: stdout closed (`>&-`)

    async def run() -> int:
        count = 0
        # The header comes with the first row (or alone, for an empty listing): a listing that
        # fails at once (no credentials, no bucket) prints its error without a table above it.
        header = not args.json
        async with contextlib.aclosing(store.rollouts(_given_states(args.state), prefix=args.prefix)) as rollouts:
            async for info in rollouts:
                if header:
                    print(format_rollout_row(None, table=table))
                    header = False
                line = msgspec.json.encode(info).decode() if args.json else format_rollout_row(info, table=table)
                print(line)
                count += 1
        if header:
            print(format_rollout_row(None, table=table))
        if table:
            print(_counted(count, "rollout"), file=sys.stderr)
        if not count and not args.json:
            _print_hint(await _empty_listing_hint(store, filtered=bool(args.state or args.prefix)))
        return 0

    return asyncio.run(_close_after(store, run()))


def _status_command(args: Any) -> int:
    store = _open_store(args)
    progress = not args.no_progress and sys.stderr.isatty()

    async def run() -> tuple[StoreStatus, str]:
        result = await status(store, prefix=args.prefix, manifests=not args.no_manifests, progress=progress)
        empty = not any(counts.rollouts for counts in result.states.values())
        return result, await _empty_listing_hint(store, filtered=bool(args.prefix)) if empty and not args.json else ""

    result, hint = asyncio.run(_close_after(store, run()))
    print(msgspec.json.encode(result).decode() if args.json else format_status(result))
    _print_hint(hint)
    return 0


async def _empty_listing_hint(store: RolloutObjects, *, filtered: bool) -> str:
    """What ``ls`` and ``status`` say on stderr when they show no rollout: for a selection
    (``--state``, ``--prefix``) of a root that holds rollouts, that none matched; else the roots
    inside or beside the URL (``roots_near``), a mistyped or too short root. ``""``: nothing to say."""
    if filtered:
        from s3capture.errors import StoreError

        holds = False
        try:  # the first rollout of the root, if any (folder markers alone are none)
            async with contextlib.aclosing(store.rollouts_listed()) as every:
                async for _ in every:
                    holds = True
                    break
        except StoreError:
            pass
        if holds:
            return "no rollouts match --state/--prefix; this root holds others (`s3capture ls URL` lists them all)"
    hint = await roots_near(store)
    return f"no rollouts here; {hint}" if hint else ""


def _print_hint(hint: str) -> None:
    if hint:
        print(hint, file=sys.stderr)


def _gc_command(args: Any) -> int:
    if args.retired_older_than < MIN_SAFE_AGE:
        print(
            f"s3capture gc: warning: --retired-older-than {args.retired_older_than:g}s is under {MIN_SAFE_AGE:.0f}s; "
            "a threshold must exceed the longest a put can take (retries included) "
            "(docs/operations.md)",
            file=sys.stderr,
        )
    store = _open_store(args)
    progress = not args.no_progress and sys.stderr.isatty()
    dry_run = not args.yes

    reader_gone = False
    unwritten = False  # the output failed for another reason than its reader going away (a full disk)

    def show(action: GcAction) -> None:
        nonlocal reader_gone, unwritten
        line = (
            msgspec.json.encode({"type": "action", **msgspec.to_builtins(action)}).decode()
            if args.json
            else format_action(action, dry_run=dry_run)
        )
        try:
            print(line, flush=True)
        except OSError as error:
            if dry_run:
                raise  # `gc URL | head`: a quiet end; a full disk: an error; either way nothing was changed
            # `gc --yes | head`, or output to a full disk: stopping here would leave the run half
            # done; it finishes its deletions, and says so (and its summary) on stderr.
            from s3capture.cli import stdout_to_devnull

            stdout_to_devnull()
            unwritten = unwritten or not isinstance(error, BrokenPipeError)
            if not reader_gone:
                reader_gone = True
                why = (
                    "the output's reader went away"
                    if isinstance(error, BrokenPipeError)
                    else f"cannot write the output ({error})"
                )
                print(f"s3capture gc: {why}; finishing the run", file=sys.stderr)

    report = asyncio.run(
        _close_after(
            store,
            gc(
                store,
                args.retired_older_than,
                dry_run=dry_run,
                abandoned_after=args.abandoned_after,
                prefix=args.prefix,
                on_action=show,
                progress=progress,
            ),
        )
    )
    if args.json:
        print(msgspec.json.encode({"type": "summary", **msgspec.to_builtins(report)}).decode())
    else:
        print(format_gc(report))
    if reader_gone:
        print(f"s3capture gc: {format_gc(report)}", file=sys.stderr)
    # Its deletions finished either way; a report that could not be written (not a reader that
    # went away, which is how `| head` ends) is a failure a script must see.
    return 1 if unwritten else 0
