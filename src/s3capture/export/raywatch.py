"""A watchdog that ends the local Ray runtime an export started, when the export dies with it.

``ray_engine`` starts it (Linux only: it reads ``/proc``) just before it calls ``ray.init`` to
start a local runtime, so that a kill during ``ray.init`` is covered too, and tells it the
runtime's session directory when ``ray.init`` returns (or ``forget`` when it joined a cluster
instead). Its stdin is a pipe from the export::

    python -m s3capture.export.raywatch PARENT_PID PARENT_START SINCE [SESSION_DIR]

The runtime's processes are the *roots* ``ray.init`` started as direct children of the export
process, started at ``SINCE`` (clock ticks after boot, taken just before ``ray.init``) or later,
with the session directory in their command line (GCS, raylet, monitors; until the export names
the session, any Ray session directory), and every descendant of those (the raylet's agents
``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent``, its workers). No other process is ever
noted: not another Ray runtime of the same program (its roots name another session directory),
not a cluster the export only joined (its roots are not the export's children, or were started
before ``ray.init``, as when the export is PID 1 of a container and adopted a ``ray start``
cluster's processes), not anything else the program runs. Each is noted as ``(pid, start
time)``, so that a reused pid is never mistaken for one of them: every 2 seconds for 30 seconds
(the runtime starts its agents then), every 30 seconds afterwards (a scan of ``/proc`` costs
milliseconds on a busy node).

The export writes ``done`` to the pipe after ``ray.shutdown()`` (or after a ``ray.init`` that
raised): the watchdog then ends whatever of the runtime is still running and exits. When the export
dies instead (SIGKILL, the OOM killer), the watchdog sees it gone (its pid no longer has its start
time, checked every second, or the pipe closed), gives the runtime's processes ``GRACE`` seconds to
exit by themselves (Ray ends its GCS and raylet when the driver dies, but not the raylet's agents:
seen with Ray 2.60.0), then sends SIGTERM, and SIGKILL to what is left 3 seconds later. A child the
export forked keeps the pipe open, which is why neither ending relies on the pipe closing.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

SCAN_EVERY = 2.0
"""Seconds between two notes of the runtime's processes during its first ``SETTLED`` seconds,
and ``SETTLED`` seconds between two notes afterwards."""
SETTLED = 30.0
POLL = 1.0
"""Seconds between two checks that the export is still alive."""
GRACE = 3.0
"""Seconds the runtime's processes get to exit by themselves after the export died."""
DONE = b"done"
"""A line the export writes after ``ray.shutdown()`` (or after a ``ray.init`` that failed)."""
SESSION = b"session "
"""``session <dir>``: the line the export writes when ``ray.init`` returned with a runtime of its own."""
FORGET = b"forget"
"""The line the export writes when ``ray.init`` joined a cluster instead: the watchdog exits."""


def process_table() -> dict[int, tuple[int, int]]:
    """``pid -> (parent pid, start time in clock ticks)`` of every live process (zombies left out)."""
    table: dict[int, tuple[int, int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            found = _stat(int(name))
            if found is not None:
                table[int(name)] = found
    return table


def _stat(pid: int) -> tuple[int, int] | None:
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


def start_time(pid: int) -> int | None:
    """The start time (clock ticks after boot) of a live process, ``None`` when it is gone."""
    found = _stat(pid)
    return None if found is None else found[1]


def _command(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def now_ticks() -> int:
    """This moment in the clock ticks after boot that ``/proc/<pid>/stat`` gives start times in."""
    with open("/proc/uptime") as handle:
        return int(float(handle.read().split()[0]) * os.sysconf("SC_CLK_TCK"))


def runtime_roots(
    parent: int, session_dir: str, since: int = 0, table: dict[int, tuple[int, int]] | None = None
) -> set[int]:
    """The direct children of ``parent`` started at ``since`` (clock ticks after boot) or later
    whose command line names ``session_dir``: the processes ``ray.init`` started for a local
    runtime of ``parent``. None when it joined a cluster: that cluster's processes are not
    ``parent``'s children, or (a ``parent`` that adopts orphans: PID 1 in a container, a subreaper)
    they were started before ``ray.init`` was called. ``session_dir=""`` (while ``ray.init`` runs
    and its session is not known yet): any Ray session directory (``.../session_<time>_<pid>``)."""
    table = process_table() if table is None else table
    marker = session_dir.encode() if session_dir else b"/session_"
    return {
        pid for pid, (ppid, started) in table.items() if ppid == parent and started >= since and marker in _command(pid)
    }


def runtime_processes(parent: int, session_dir: str, since: int = 0) -> dict[int, int]:
    """``pid -> start time`` of the runtime's roots and all their live descendants."""
    table = process_table()
    family = runtime_roots(parent, session_dir, since, table)
    grew = True
    while grew:
        more = {pid for pid, (ppid, _) in table.items() if ppid in family} - family
        family |= more
        grew = bool(more)
    family.discard(os.getpid())
    return {pid: table[pid][1] for pid in family}


def _alive(pid: int, started: int) -> bool:
    return start_time(pid) == started


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
    if len(args) not in (3, 4) or not all(arg.isdigit() for arg in args[:3]):
        print("usage: python -m s3capture.export.raywatch PARENT_PID PARENT_START SINCE [SESSION_DIR]", file=sys.stderr)
        return 2
    parent, parent_start, since = int(args[0]), int(args[1]), int(args[2])
    session_dir = args[3] if len(args) == 4 else ""
    seen: dict[int, int] = {}
    stdin = sys.stdin.fileno()
    began = time.monotonic()
    next_scan = began
    grace = GRACE
    pending = b""
    while True:
        now = time.monotonic()
        if now >= next_scan:
            seen.update(runtime_processes(parent, session_dir, since))
            next_scan = now + (SCAN_EVERY if now - began < SETTLED else SETTLED)
        if start_time(parent) != parent_start:
            break  # the export died (or ended without saying so)
        ready, _, _ = select.select([stdin], [], [], min(POLL, max(0.0, next_scan - time.monotonic())))
        if not ready:
            continue
        try:
            data = os.read(stdin, 4096)
        except OSError:
            data = b""
        if not data:
            break  # the pipe closed: the export died
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.startswith(SESSION):
                # ray.init returned: from now on only this session's roots are the runtime's
                session_dir = line[len(SESSION) :].decode(errors="surrogateescape")
                seen = runtime_processes(parent, session_dir, since)
            elif line == FORGET:
                return 0  # ray.init joined a cluster: nothing here is the export's to end
            elif line == DONE:
                end(seen, 1.0)  # ray.shutdown() has run: what is left of the runtime is left over
                return 0
    end(seen, grace)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the export is not for this
    sys.exit(main())
