"""The runnable examples in the docs run as they are written.

A block preceded by ``<!-- example:NAME -->`` is extracted and run as a script in a fresh
interpreter (it starts its own embedded S3 server), so the docs cannot drift from the API.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _example(doc: str, name: str) -> str:
    text = (REPO / doc).read_text()
    match = re.search(rf"<!-- example:{name} -->\n```python\n(.*?)```", text, re.S)
    assert match, f"{doc} has no example {name!r}"
    return match.group(1)


def test_the_ledger_example_without_gym_runs(tmp_path):
    pytest.importorskip("moto")
    script = tmp_path / "ledger_example.py"
    script.write_text(_example("docs/ledger.md", "ledger"))
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "[('call-1', None, 5), ('call-2', 'call-1', 8)]",
        "{'removed': ['r-1'], 'absent': []}",
        "{'removed': ['r-1'], 'absent': []}",
    ]
