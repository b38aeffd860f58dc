"""A watchdog that ends the local Ray runtime an export started, when the export dies with it.

``ray_engine`` starts it (Linux only: it reads ``/proc``) right after ``ray.init`` started a local
runtime for this export alone::

    python -m s3capture.export.raywatch PARENT_PID SESSION_DIR    # stdin: a pipe from the export

While the export lives, it notes every descendant of ``PARENT_PID`` that is Ray's (its command line
names ``SESSION_DIR`` or starts with ``ray::``), as ``(pid, start time)`` so that a reused pid is
never mistaken for one of them: every 2 seconds for 30 seconds (the runtime starts its agents
then), every 30 seconds afterwards (a scan of ``/proc`` costs milliseconds on a busy node). When
its stdin closes (the export ended, or was killed: SIGKILL and the OOM killer included), it gives
those processes ``GRACE`` seconds to exit by themselves, then sends SIGTERM, and SIGKILL to what
is left 3 seconds later. Ray ends its GCS
and raylet when the driver dies, but not the agents the raylet started (``ray::DashboardAgent``,
``ray::RuntimeEnvAgent``, seen with Ray 2.60.0): this is what ends them. After a normal end
(``ray.shutdown()`` first) nothing is left to end.

It never touches a process it did not see descend from the export, nor one that is not Ray's.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

SCAN_EVERY = 2.0
"""Seconds between two notes of the export's Ray descendants during its first ``SETTLED`` seconds
(the runtime starts its agents then), and ``SETTLED`` seconds between two notes afterwards."""
SETTLED = 30.0
GRACE = 3.0
"""Seconds Ray's processes get to exit by themselves after the export ended."""


def _stat(pid: int) -> tuple[int, int] | None:
    """``(parent pid, start time in clock ticks)`` of a live process, ``None`` for a gone or zombie one."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] == b"Z":
        return None
    try:
        return int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None


def ray_descendants(root: int, session_dir: str) -> dict[int, int]:
    """``pid -> start time`` of the live descendants of ``root`` that are Ray's processes."""
    table: dict[int, tuple[int, int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            found = _stat(int(name))
            if found is not None:
                table[int(name)] = found
    family = {root}
    grew = True
    while grew:
        more = {pid for pid, (parent, _) in table.items() if parent in family} - family
        family |= more
        grew = bool(more)
    family.discard(root)
    family.discard(os.getpid())
    marker = session_dir.encode()
    out: dict[int, int] = {}
    for pid in family:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                command = handle.read()
        except OSError:
            continue
        if command.startswith(b"ray::") or (marker and marker in command):
            out[pid] = table[pid][1]
    return out


def _alive(pid: int, started: int) -> bool:
    found = _stat(pid)
    return found is not None and found[1] == started


def end(processes: dict[int, int], grace: float = GRACE) -> None:
    """Wait ``grace`` seconds for ``processes`` to exit, then SIGTERM, then SIGKILL what is left."""
    for sig, wait in ((None, grace), (signal.SIGTERM, 3.0), (signal.SIGKILL, 1.0)):
        left = {pid: started for pid, started in processes.items() if _alive(pid, started)}
        if not left:
            return
        if sig is not None:
            for pid in left:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_alive(pid, started) for pid, started in left.items()):
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[0].isdigit():
        print("usage: python -m s3capture.export.raywatch PARENT_PID SESSION_DIR", file=sys.stderr)
        return 2
    root, session_dir = int(args[0]), args[1]
    seen: dict[int, int] = {}
    stdin = sys.stdin.fileno()
    started = time.monotonic()
    while True:
        seen.update(ray_descendants(root, session_dir))
        early = time.monotonic() - started < SETTLED
        ready, _, _ = select.select([stdin], [], [], SCAN_EVERY if early else SETTLED)
        if ready:
            try:
                data = os.read(stdin, 4096)
            except OSError:
                data = b""
            if not data:
                break  # the export closed the pipe, or died
    end(seen)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the export is not for this
    sys.exit(main())
