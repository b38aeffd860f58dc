"""NeMo Gym availability for tests: skip locally when it is missing, fail under CI.

Tests that compare s3capture with NeMo Gym call ``gym = require_gym()`` first. Where Gym is not
installed the test is skipped, except when the ``CI`` environment variable is set to a true value
(CI systems set ``CI=true``): there a missing Gym would silently turn the compatibility suite into
skips, so the test fails with the install command instead.
"""

from __future__ import annotations

import os
from types import ModuleType

import pytest

INSTALL = "pip install pydantic orjson && pip install --no-deps --ignore-requires-python nemo-gym==0.7.0"
GYM_MODULE = "nemo_gym.token_id_capture"


def running_under_ci() -> bool:
    """True when ``CI`` is set to anything but an empty/false value (``CI=true`` on CI systems)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no", "off")


def require_gym() -> ModuleType:
    """Return ``nemo_gym.token_id_capture``; skip when missing, but fail when ``CI`` is set."""
    if running_under_ci():
        try:
            import importlib

            return importlib.import_module(GYM_MODULE)
        except ImportError as error:
            pytest.fail(
                f"nemo_gym is required under CI but cannot be imported ({error}); install it with: {INSTALL}",
                pytrace=False,
            )
    return pytest.importorskip(GYM_MODULE, reason=f"nemo_gym is not installed; install it with: {INSTALL}")
