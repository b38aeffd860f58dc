"""Running NeMo Gym 0.7.0's token-capture code on Python 3.11: one small, documented shim.

Gym 0.7.0 declares Python >= 3.13. Its ``TokenIdCaptureConfig._build_endpoint`` (behind
``build_sink()`` and ``build_lineage_store()``, the YAML route ``token_id_capture.sink: module:Class``)
validates the object it built with ``sorted(protocol.__protocol_attrs__)``. ``typing`` sets
``__protocol_attrs__`` on every protocol class from Python 3.12 on; on 3.11 the attribute does not
exist, so ``build_sink()`` raises ``AttributeError: type object 'TokenSink' has no attribute
'__protocol_attrs__'`` before it looks at the sink at all.

``install_protocol_attrs_shim()`` supplies the attribute the way 3.12 does, without touching any
protocol class: it adds a non-data descriptor ``__protocol_attrs__`` to ``typing._ProtocolMeta`` (the
metaclass of every ``typing.Protocol`` class) that returns ``frozenset(typing._get_protocol_attrs(cls))``,
the member names Python 3.11 itself checks in ``isinstance`` against a runtime-checkable protocol
(for Gym's ``TokenSink``: ``{"put", "mark_incomplete", "close"}``). Because the descriptor lives on
the metaclass, not in a class ``__dict__``, 3.11's own protocol checks never see it as a member; it
has no ``__set__``, so ``typing_extensions.Protocol`` (which stores its own ``__protocol_attrs__`` in
each class on 3.11) is unaffected. On Python >= 3.12 the shim does nothing.

``s3capture.protocols`` applies the shim when it is imported on Python < 3.12 and a ``nemo_gym``
package is installed (found with ``importlib.util.find_spec``, without importing it). Gym imports
the class named in ``token_id_capture.sink`` before it validates it, and importing any
``s3capture`` module imports ``s3capture.protocols`` first, so Gym's YAML route works on 3.11 with
no action by the user. Set ``S3CAPTURE_NO_PROTOCOL_SHIM=1`` to leave ``typing`` alone.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import typing

__all__ = ["NO_SHIM_VAR", "install_protocol_attrs_shim", "protocol_attrs_shim_needed"]

NO_SHIM_VAR = "S3CAPTURE_NO_PROTOCOL_SHIM"


def protocol_attrs_shim_needed() -> bool:
    """True on Python < 3.12 when ``typing.Protocol`` classes lack ``__protocol_attrs__``."""
    return sys.version_info < (3, 12) and not hasattr(typing.Protocol, "__protocol_attrs__")


class _ProtocolAttrs:
    """A non-data descriptor on the metaclass: a class that sets its own ``__protocol_attrs__``
    (``typing_extensions.Protocol`` does, on 3.11) keeps it, since the class ``__dict__`` wins."""

    def __get__(self, cls: type | None, meta: type | None = None) -> object:
        if cls is None:
            return self
        if not getattr(cls, "_is_protocol", False):
            raise AttributeError(f"type object {cls.__name__!r} has no attribute '__protocol_attrs__'")
        return frozenset(typing._get_protocol_attrs(cls))  # type: ignore[attr-defined]  # 3.11 only


def install_protocol_attrs_shim() -> bool:
    """Give every protocol class a 3.12-style ``__protocol_attrs__`` on Python 3.11. Idempotent.

    Returns True when the attribute is available afterwards (installed now, earlier, or native on
    Python >= 3.12). Non-protocol classes built by the same metaclass still raise
    ``AttributeError`` for it, as on 3.12.
    """
    if not protocol_attrs_shim_needed():
        return True
    meta = type(typing.Protocol)
    getter = getattr(typing, "_get_protocol_attrs", None)
    if getter is None:  # pragma: no cover - a 3.11 without the helper: nothing safe to do
        return False
    meta.__protocol_attrs__ = _ProtocolAttrs()  # type: ignore[attr-defined]  # 3.12 has it; this is the 3.11 shim
    return hasattr(typing.Protocol, "__protocol_attrs__")


def apply_if_gym_installed() -> None:
    """Install the shim when ``nemo_gym`` is installed, unless ``S3CAPTURE_NO_PROTOCOL_SHIM`` is set."""
    if not protocol_attrs_shim_needed() or os.environ.get(NO_SHIM_VAR, "").strip() not in ("", "0"):
        return
    try:
        found = importlib.util.find_spec("nemo_gym") is not None
    except (ImportError, ValueError):
        found = False
    if found:
        install_protocol_attrs_shim()
