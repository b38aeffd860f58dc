"""What a killed process of s3capture leaves in a temp folder, and its safe removal.

Two kinds of process write into the system's temp folder and clean up after themselves, unless
they are killed (SIGKILL, an OOM kill, a machine reset):

* an export to an ``s3://`` destination writes each shard to a temp file before its one PUT
  (``s3capture.export.destinations``);
* a local test server (``s3capture.localserver``: SeaweedFS, the Ceph gateway) keeps its data,
  logs and sockets in a temp folder, removed by ``LocalS3Server.stop``.

Each names its leftover for its owner: this machine and PID namespace (:func:`host_tag`) and its
process id. :func:`remove_dead` removes a leftover only when it can tell that its owner is gone.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import time


def host_tag(*, short: bool = False) -> str:
    """This machine as a leftover's name carries it: its host name (letters, digits, ``.`` and ``-``;
    anything else as ``_``; at most 64 characters) and the id of this process's PID namespace
    (Linux; 0 elsewhere), as ``<host>.ns<id>``, so that a process id is only judged in the
    namespace it belongs to (containers with the same host name may share a temp folder).

    With ``short``, the first 10 hex digits of that string's SHA-256 instead: for folders whose
    paths must stay short (a Unix socket's path holds at most 107 bytes)."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    tag = f"{re.sub(r'[^A-Za-z0-9.-]', '_', socket.gethostname())[:64] or 'host'}.ns{namespace}"
    return hashlib.sha256(tag.encode()).hexdigest()[:10] if short else tag


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists in this PID namespace (one owned by another user counts);
    a pid the system cannot even look up (too large) counts as alive: never judged dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # e.g. PermissionError: it exists, owned by someone else
        return True
    return True


def _last_write(path: str, info: os.stat_result, directory: bool) -> float:
    """Seconds since the epoch of the newest write to a file, or to a folder and the entries
    directly in it (a server's log is one level down)."""
    newest = info.st_mtime
    if directory:
        with os.scandir(path) as children:
            for child in children:
                newest = max(newest, child.stat(follow_symlinks=False).st_mtime)
    return newest


def remove_dead(
    folder: str, pattern: re.Pattern[str], *, host: str, stale_after: float, directories: bool
) -> list[str]:
    """Remove the leftovers of dead processes from ``folder`` and return their paths.

    An entry goes only when all of these hold: its name matches ``pattern`` (named groups ``host``
    and ``pid``) with ``host`` equal to the given one (this machine's :func:`host_tag`); it is a
    regular file (``directories=False``) or a folder (``directories=True``; never a symbolic
    link) that this user owns; its process is gone (:func:`process_alive`); and nothing wrote it
    for ``stale_after`` seconds (a folder: nor any entry directly in it). Never raises: an entry it
    cannot judge or remove stays (a folder removed in part is reported as removed)."""
    removed: list[str] = []
    uid, now = getattr(os, "getuid", lambda: None)(), time.time()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None or match["host"] != host:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            is_kind = entry.is_dir(follow_symlinks=False) if directories else entry.is_file(follow_symlinks=False)
            if not is_kind or (uid is not None and info.st_uid != uid):
                continue
            if process_alive(int(match["pid"])) or now - _last_write(entry.path, info, directories) < stale_after:
                continue
            if directories:
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
        except (OSError, ValueError):
            continue
        removed.append(entry.path)
    return removed
