"""Model-based tests of the token store and the ledger (hypothesis ``RuleBasedStateMachine``).

The machines live in ``tests/model_machines.py`` (shared with ``tools/chaos.py``, which runs them
longer); ``docs/reliability.md`` lists the invariants they check after every step. Here they run
on each test server with the small fixed CI budget of ``ci_settings()`` (derandomized, so every
CI run explores the same sequences).
"""

from __future__ import annotations

from hypothesis.stateful import run_state_machine_as_test

from model_machines import Stats, ci_settings, ledger_machine, store_machine


def test_token_store_model(s3_env):
    stats = Stats()
    run_state_machine_as_test(store_machine(s3_env, stats), settings=ci_settings())
    assert not stats.violations
    assert sum(stats.checks.values()) > 0 and stats.runs > 0


def test_ledger_model(s3_env):
    stats = Stats()
    run_state_machine_as_test(ledger_machine(s3_env, stats), settings=ci_settings())
    assert not stats.violations
    assert sum(stats.checks.values()) > 0 and stats.runs > 0
