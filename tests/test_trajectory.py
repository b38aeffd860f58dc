"""``s3capture.trajectory``: chain helpers, and the built-in builder against NeMo Gym's own.

The differential test captures the shared example rollouts (``../shared/data/gym-example-rollouts``,
never copied here) through the demo's own call path (``s3capture.demo._serve_call``) into an
in-memory capture whose resolver is Gym's reference ``InMemoryLineageStore``, once with full and
once with delta prompts, and checks that the built-in builder's rows (and metrics) equal what Gym's
``trajectories_from_source`` gives for every rollout. The unit tests build snapshots directly
(``FrozenSnapshot``); one test captures into the selected S3 servers, freezes and builds.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import uuid

import msgspec
import pytest

from gymcompat import require_gym
from helpers import build_conversation, make_entry, turn_entry
from test_demo import example_file

from s3capture import demo
from s3capture.protocols import LineageMatch, LineageResolution
from s3capture.records import ParentResolutionStatus, TokenEntry, cumulative_tokens, stamp_lineage, to_gym
from s3capture.replay import load_rollouts
from s3capture.store import FrozenSnapshot
from s3capture.trajectory import (
    ChainError,
    RolloutBuild,
    Trajectory,
    build_rollout,
    build_rollout_async,
    check_chain,
    cumulative_prompt,
    to_gym_entries,
)

EXAMPLES = ("anyterminal_hermes.jsonl", "competitive_coding.jsonl", "hermes_math.jsonl")
ENGINES = ("builtin", "gym")


# --------------------------------------------------------------------------- snapshots
def snapshot(
    entries, *, rollout_id: str = "r", incomplete: bool = False, reasons: tuple[str, ...] = ()
) -> FrozenSnapshot:
    return FrozenSnapshot(rollout_id, tuple(entries), incomplete, "snap-1", 7, tuple(reasons))


def conversation(turns: int = 5, *, delta: bool = False, rollout_id: str = "r") -> list[TokenEntry]:
    """A linear conversation's entries (``helpers.build_conversation``), full or delta prompts."""
    out = []
    previous = None
    for turn in build_conversation(rollout_id, turns):
        out.append(turn_entry(rollout_id, turn, delta=delta, parent_cumulative=previous))
        previous = turn.cumulative
    return out


def builds(snap: FrozenSnapshot) -> dict[str, RolloutBuild]:
    require_gym()
    return {engine: build_rollout(snap, engine=engine) for engine in ENGINES}


def rows(build: RolloutBuild) -> list[tuple]:
    return [(t.chain_id, t.call_ids, t.token_ids, t.loss_mask, t.logprobs) for t in build.trajectories]


# --------------------------------------------------------------------------- capture of the examples
class _MemoryCapture:
    """Just enough of a store for ``demo._serve_call``: entries kept as put, Gym's reference resolver
    (``InMemoryLineageStore``) fed with full-prompt copies (it cannot rebuild delta prompts)."""

    def __init__(self) -> None:
        from nemo_gym.token_id_capture.lineage import InMemoryLineageStore

        self.lineage = InMemoryLineageStore(max_tokens=1 << 40)
        self.entries: dict[str, list[TokenEntry]] = {}
        self.cumulative: dict[str, list[int]] = {}

    async def resolve(self, rollout_id: str, request_items: list[dict]) -> LineageResolution:
        found = await self.lineage.resolve(rollout_id, request_items)
        status = ParentResolutionStatus(found.status.value)
        if found.match is None:
            return LineageResolution(status, reason=found.reason)
        m = found.match
        return LineageResolution(
            status, LineageMatch(m.model_call_id, tuple(m.cumulative_token_ids), m.digest, prev_len=m.prev_len)
        )

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        pass

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        raise AssertionError(f"no put fails in memory ({rollout_id}/{model_call_id})")

    async def put(self, entry: TokenEntry) -> None:
        self.entries.setdefault(entry.rollout_id, []).append(entry)
        full = copy.copy(entry)
        if entry.prompt_is_delta:
            full.prompt_token_ids = self.cumulative[entry.parent_call_id] + list(entry.prompt_token_ids)
            full.prompt_is_delta = False
        self.cumulative[entry.model_call_id] = cumulative_tokens(full)
        await self.lineage.put(to_gym(full))


async def _capture(rollouts, delta: bool, store) -> None:
    for rollout in rollouts:
        previous = None
        for call in rollout.calls:
            result = await demo._serve_call(store, 0, rollout.rollout_id, call, delta, previous)
            assert result.parent_ok, f"{call.model_call_id} resolved to the wrong parent"
            previous = call.model_call_id


@pytest.fixture(scope="module")
def example_snapshots() -> dict[str, list[FrozenSnapshot]]:
    """``{"full": [...], "delta": [...]}``: every example rollout captured in memory."""
    require_gym()
    rollouts = load_rollouts([example_file(name) for name in EXAMPLES])
    out = {}
    for storage in ("full", "delta"):
        capture = _MemoryCapture()
        asyncio.run(_capture(rollouts, storage == "delta", capture))
        out[storage] = [
            FrozenSnapshot(r.rollout_id, tuple(capture.entries[r.rollout_id]), False, f"snap-{r.rollout_id}", 1, ())
            for r in rollouts
            if r.calls
        ]
    return out


@pytest.mark.parametrize("storage", ["full", "delta"])
def test_builtin_builder_equals_gym_on_the_example_rollouts(example_snapshots, storage):
    snaps = example_snapshots[storage]
    assert len(snaps) == 15 and sum(len(s.entries) for s in snaps) == 160
    assert any(len(s.entries) > 50 for s in snaps)
    if storage == "delta":
        assert sum(e.prompt_is_delta for s in snaps for e in s.entries) == 145
    for snap in snaps:
        by_engine = builds(snap)
        gym, builtin = by_engine["gym"], by_engine["builtin"]
        assert gym.gym_result is not None and builtin.gym_result is None
        assert not gym.masked and not builtin.masked, (gym.mask_reasons, builtin.mask_reasons)
        assert len(gym.trajectories) == 1
        assert rows(builtin) == rows(gym), snap.rollout_id
        assert builtin.metrics == gym.metrics
        # The row is the terminal call's whole cumulative sequence, generated tokens masked in.
        (row,) = gym.trajectories
        by_id = {e.model_call_id: e for e in snap.entries}
        last = by_id[row.chain_id]
        assert row.call_ids[-1] == row.chain_id and len(row.call_ids) == len(snap.entries)
        assert row.token_ids == cumulative_prompt(last, by_id) + list(last.generation_token_ids)
        assert len(row.loss_mask) == len(row.logprobs) == len(row.token_ids)
        assert (
            sum(row.loss_mask)
            == sum(len(e.generation_token_ids) for e in snap.entries)
            == gym.metrics["generated_tokens_delivered"]
        )
        assert all(p == 0.0 for p, m in zip(row.logprobs, row.loss_mask) if m == 0)
        assert [p for p, m in zip(row.logprobs, row.loss_mask) if m] == [
            p for c in row.call_ids for p in by_id[c].generation_log_probs
        ]
        # And it is exactly what Gym projected.
        generated = [
            i for i in gym.gym_result["rebuilt_response"]["output"] if i.get("generation_token_ids") is not None
        ]
        assert row.token_ids == generated[-1]["prompt_token_ids"] + generated[-1]["generation_token_ids"]
        assert check_chain(snap.entries) == []


def test_full_and_delta_storage_give_the_same_rows(example_snapshots):
    full = {s.rollout_id: rows(build_rollout(s, engine="builtin")) for s in example_snapshots["full"]}
    delta = {s.rollout_id: rows(build_rollout(s, engine="builtin")) for s in example_snapshots["delta"]}
    assert full.keys() == delta.keys()
    for rid in full:  # the generations' log probabilities are the file's; the sequences must match
        assert [r[2:4] for r in full[rid]] == [r[2:4] for r in delta[rid]]


# --------------------------------------------------------------------------- cumulative_prompt
@pytest.mark.parametrize("delta", [False, True])
def test_cumulative_prompt_rebuilds_full_and_delta_chains(delta):
    turns = build_conversation("r", 6)
    entries = conversation(6, delta=delta)
    assert [e.prompt_is_delta for e in entries] == [False] + [delta] * 5
    by_id = {e.model_call_id: e for e in entries}
    memo: dict[str, list[int]] = {}
    for turn, entry in zip(turns, entries):
        assert cumulative_prompt(entry, by_id) == turn.prompt
        assert cumulative_prompt(entry, by_id, memo=memo) == turn.prompt
    assert memo.keys() >= {t.call_id for t in turns[:-1]} and all(
        memo[t.call_id] == t.cumulative for t in turns if t.call_id in memo
    )
    # NeMo Gym entries work the same way.
    if delta:
        require_gym()
        gym_entries = to_gym_entries(entries)
        gym_by_id = {e.model_call_id: e for e in gym_entries}
        assert [cumulative_prompt(e, gym_by_id) for e in gym_entries] == [t.prompt for t in turns]


def test_cumulative_prompt_raises_chain_error_on_a_hole_a_cycle_and_a_bad_digest():
    entries = conversation(4, delta=True)
    by_id = {e.model_call_id: e for e in entries}
    hole = {cid: e for cid, e in by_id.items() if cid != entries[1].model_call_id}
    with pytest.raises(ChainError, match=f"parent {entries[1].model_call_id} is not in the snapshot"):
        cumulative_prompt(entries[3], hole)
    assert cumulative_prompt(entries[0], {}) == list(entries[0].prompt_token_ids)  # a full prompt needs no parent
    a, b = copy.deepcopy(entries[2]), copy.deepcopy(entries[3])
    a.parent_call_id, b.parent_call_id = b.model_call_id, a.model_call_id
    with pytest.raises(ChainError, match="cycle"):
        cumulative_prompt(b, {a.model_call_id: a, b.model_call_id: b})
    tampered = copy.deepcopy(entries[2])
    tampered.prompt_token_ids[0] += 1
    with pytest.raises(ChainError, match="fail its digest"):
        cumulative_prompt(tampered, by_id)
    assert issubclass(ChainError, ValueError)


# --------------------------------------------------------------------------- check_chain
@pytest.mark.parametrize("delta", [False, True])
def test_check_chain_accepts_a_contiguous_chain_and_reports_a_hole(delta):
    entries = conversation(5, delta=delta)
    assert check_chain(entries) == []
    assert check_chain(list(reversed(entries))) == []
    missing = entries[2].model_call_id
    problems = check_chain(entries[:2] + entries[3:])
    assert problems and all(missing in p for p in problems)
    assert any(p.startswith(f"{entries[3].model_call_id}:") and "not in" in p for p in problems)


def test_check_chain_reports_a_non_contiguous_child_a_bad_digest_and_a_duplicate():
    turns = build_conversation("r", 3)
    entries = conversation(3)
    # A child whose full prompt does not extend its parent's tokens (stamped honestly otherwise).
    bad = make_entry(
        "r",
        turns[2].call_id,
        turns[2].request_items,
        turns[2].output_items,
        [9, 9] + turns[2].prompt[2:],
        turns[2].generation,
        parent_call_id=turns[1].call_id,
    )
    problems = check_chain(entries[:2] + [bad])
    assert problems == [
        f"{bad.model_call_id}: prompt does not start with parent {turns[1].call_id}'s tokens (its prompt plus generation)"
    ]
    corrupt = copy.deepcopy(entries[1])
    corrupt.generation_token_ids[-1] += 1
    problems = check_chain([entries[0], corrupt, entries[2]])
    assert f"{corrupt.model_call_id}: cumulative tokens fail their digest" in problems
    assert any(p.startswith(entries[2].model_call_id) and "does not start" in p for p in problems)
    tampered = [copy.deepcopy(e) for e in conversation(3, delta=True)]
    tampered[1].prompt_token_ids[0] += 1  # a delta suffix: contiguous by construction, caught by its digest
    assert check_chain(tampered) == [
        f"{tampered[1].model_call_id}: the cumulative tokens rebuilt from its delta prompt fail its digest"
    ]
    builtin = build_rollout(snapshot(tampered), engine="builtin")
    assert builtin.masked and f"delta_chain_unreconstructable:{tampered[1].model_call_id}" in builtin.mask_reasons
    wrong_len = copy.deepcopy(entries[2])
    wrong_len.cum_len += 1
    assert check_chain(entries[:2] + [wrong_len]) == [
        f"{wrong_len.model_call_id}: cum_len {wrong_len.cum_len} but its cumulative tokens are {wrong_len.cum_len - 1} long"
    ]
    builtin = build_rollout(snapshot(entries[:2] + [wrong_len]), engine="builtin")
    assert builtin.masked and builtin.mask_reasons == [f"cum_len_mismatch:{wrong_len.model_call_id}"]
    other = copy.deepcopy(entries[2])
    other.generation_token_ids = [1, 2, 3]
    assert any("share this model call id" in p for p in check_chain(entries + [other]))
    assert check_chain(entries + [copy.deepcopy(entries[2])]) == []  # an identical redelivery is fine


# --------------------------------------------------------------------------- to_gym_entries
def test_check_chain_reports_a_cycle_of_full_prompt_entries_with_empty_generations():
    """Empty generations let a cycle of parent links look contiguous (each prompt starts with the
    other's cumulative tokens); a breaker found check_chain silent on it."""
    turns = build_conversation("r", 1)
    a = _sibling(turns[0], "a", [1, 2, 3], [], parent_call_id="b")
    b = _sibling(turns[0], "b", [1, 2, 3], [], parent_call_id="a")
    assert check_chain([a, b]) == ["a: its parent links form a cycle (a -> b -> a)"]
    alone = _sibling(turns[0], "s", [1, 2, 3], [], parent_call_id="s")
    assert check_chain([alone]) == ["s: its parent links form a cycle (s -> s)"]
    # A chain that merely ends in a hole, or a clean one, has no cycle.
    assert not any("cycle" in p for p in check_chain(conversation(4)))
    assert not any("cycle" in p for p in check_chain(conversation(4)[1:]))


def test_cumulative_prompt_checks_an_ancestors_digest_only_with_a_memo():
    """As documented: without ``memo`` only the entry asked for is checked against its digest (its
    tokens are right); with ``memo`` every delta rebuilt on the way is; check_chain reports it."""
    entries = conversation(3, delta=True)
    entries[1].digest = "sha256:" + "0" * 64
    by_id = {e.model_call_id: e for e in entries}
    clean = {e.model_call_id: e for e in conversation(3, delta=True)}
    assert cumulative_prompt(entries[2], by_id) == cumulative_prompt(clean[entries[2].model_call_id], clean)
    with pytest.raises(ChainError, match="fail its digest"):
        cumulative_prompt(entries[2], by_id, memo={})
    assert any(p.startswith(f"{entries[1].model_call_id}:") and "digest" in p for p in check_chain(entries))


def test_to_gym_entries_converts_snapshots_entries_and_dicts():
    require_gym()
    from nemo_gym.token_id_capture.records import TokenEntry as GymTokenEntry

    entries = conversation(3, delta=True)
    converted = to_gym_entries(snapshot(entries))
    assert all(type(e) is GymTokenEntry for e in converted)
    assert [e.model_dump(mode="json") for e in converted] == [e.model_dump() for e in entries]
    assert converted[1].prompt_is_delta and converted[1].parent_call_id == entries[0].model_call_id
    again = to_gym_entries(converted)
    assert all(a is b for a, b in zip(again, converted))
    assert [e.model_call_id for e in to_gym_entries([e.model_dump() for e in entries])] == [
        e.model_call_id for e in entries
    ]
    with pytest.raises(TypeError):
        to_gym_entries("not entries")
    with pytest.raises(TypeError):
        to_gym_entries([object()])


# --------------------------------------------------------------------------- build_rollout masking
@pytest.mark.parametrize("delta", [False, True])
def test_a_clean_rollout_is_trainable_on_both_engines(delta):
    entries = conversation(4, delta=delta)
    result = builds(snapshot(entries))
    for build in result.values():
        assert not build.masked and build.mask_reasons == []
        assert (build.rollout_id, build.snapshot_id, build.version) == ("r", "snap-1", 7)
        (row,) = build.trajectories
        assert isinstance(row, Trajectory) and row.chain_id == entries[-1].model_call_id
        assert row.call_ids == [e.model_call_id for e in entries]
    assert rows(result["builtin"]) == rows(result["gym"])
    assert result["builtin"].metrics == result["gym"].metrics
    # Gym entries in the snapshot (S3TokenStore(entry_type="gym")) build the same.
    gym_snap = snapshot(to_gym_entries(entries))
    assert (
        rows(build_rollout(gym_snap, engine="builtin"))
        == rows(build_rollout(gym_snap, engine="gym"))
        == rows(result["gym"])
    )


@pytest.mark.parametrize("delta", [False, True])
def test_an_incomplete_snapshot_is_always_masked(delta):
    reasons = ("dangling_intent:r-c9", "marked_incomplete:r-c3")
    for engine, build in builds(snapshot(conversation(3, delta=delta), incomplete=True, reasons=reasons)).items():
        assert build.masked, engine
        assert build.mask_reasons[:3] == [*reasons, "capture_incomplete"], engine
        assert build.metrics["capture_incomplete"] is True
    assert build.gym_result["mask_sample"] is True  # gym: Gym's own verdict
    # A snapshot that gives reasons is incomplete, whatever its flag says.
    for engine, build in builds(snapshot(conversation(3, delta=delta), reasons=reasons[:1])).items():
        assert build.masked and build.mask_reasons[:2] == [reasons[0], "capture_incomplete"], engine


def test_an_empty_snapshot_is_masked_without_trajectories():
    result = builds(snapshot([]))
    for build in result.values():
        assert build.masked and build.trajectories == [] and build.metrics["n_calls"] == 0
    assert "no_entries" in result["builtin"].mask_reasons
    assert "gym_error:capture contains no token records" in result["gym"].mask_reasons


def _sibling(
    turn, call_id: str, prompt: list[int], generation: list[int], created_at: float = 1700000000.0, **kw
) -> TokenEntry:
    return make_entry(
        "r", call_id, turn.request_items, turn.output_items, prompt, generation, created_at=created_at, **kw
    )


def test_two_roots_and_a_fork_are_masked_and_build_the_same_main_chain():
    turns = build_conversation("r", 3)
    entries = conversation(3)
    # A second root (another conversation in the same rollout), created later.
    other = _sibling(turns[0], "z-root", [7, 7, 7], [8, 8], created_at=1800000000.0)
    result = builds(snapshot(entries + [other]))
    for build in result.values():
        assert build.masked and "roots:2" in build.mask_reasons and "chains:2" in build.mask_reasons
        assert build.trajectories[0].call_ids == [e.model_call_id for e in entries]  # earliest root
    assert rows(result["builtin"]) == rows(result["gym"]) and result["builtin"].metrics == result["gym"].metrics
    # A fork: two children of one parent with different prompts.
    fork = _sibling(turns[2], "r-fork", turns[1].cumulative + [5, 5], [6, 6], parent_call_id=turns[1].call_id)
    result = builds(snapshot(entries + [fork]))
    for build in result.values():
        assert build.masked and "chains:2" in build.mask_reasons
    assert rows(result["builtin"]) == rows(result["gym"]) and result["builtin"].metrics == result["gym"].metrics


def test_a_retry_nobody_extended_is_masked_and_an_extended_retry_is_resolved():
    turns = build_conversation("r", 3)
    entries = conversation(3)
    # Retry of the middle call, same prompt, other generation, not extended: the chain goes through the original.
    abandoned = _sibling(turns[1], "r-retry", turns[1].prompt, [4, 4, 4], parent_call_id=turns[0].call_id)
    result = builds(snapshot(entries + [abandoned]))
    for build in result.values():
        assert not build.masked, build.mask_reasons
        assert build.trajectories[0].call_ids == [e.model_call_id for e in entries]
        assert build.metrics["quarantined_calls"] == 1
    assert rows(result["builtin"]) == rows(result["gym"]) and result["builtin"].metrics == result["gym"].metrics
    # Retry of the final call: no later call says which generation the harness kept.
    final_retry = _sibling(turns[2], "r-last-retry", turns[2].prompt, [4, 4], parent_call_id=turns[1].call_id)
    result = builds(snapshot(entries + [final_retry]))
    for build in result.values():
        assert build.masked
        assert {f"unresolved_retry:{turns[2].call_id}", "unresolved_retry:r-last-retry"} <= set(build.mask_reasons)
    assert rows(result["builtin"]) == rows(result["gym"]) and result["builtin"].metrics == result["gym"].metrics


def test_retries_with_identical_tokens_map_to_the_call_on_the_chain():
    turns = build_conversation("r", 3)
    entries = conversation(3)
    # The middle call retried with the same output; the next call names the original as parent.
    twin = _sibling(turns[1], "a-retry", turns[1].prompt, turns[1].generation, parent_call_id=turns[0].call_id)
    result = builds(snapshot(entries + [twin]))
    for build in result.values():
        assert not build.masked, build.mask_reasons
        assert build.trajectories[0].call_ids == [e.model_call_id for e in entries]
    assert rows(result["builtin"]) == rows(result["gym"])
    # The last call retried with the same output: unresolved (masked); Gym keeps the smallest id.
    last_twin = _sibling(turns[2], "a-last", turns[2].prompt, turns[2].generation, parent_call_id=turns[1].call_id)
    result = builds(snapshot(entries + [last_twin]))
    for build in result.values():
        assert build.masked and build.trajectories[0].call_ids == [turns[0].call_id, turns[1].call_id, "a-last"]
    assert rows(result["builtin"]) == rows(result["gym"])


def test_unresolved_and_non_contiguous_calls_are_masked():
    turns = build_conversation("r", 3)
    entries = conversation(3)
    unresolved = copy.deepcopy(entries[2])
    stamp_lineage(unresolved, None, parent_resolution=ParentResolutionStatus.UNRESOLVED, reason="no_match")
    result = builds(snapshot(entries[:2] + [unresolved]))
    assert f"parent_unresolved:{unresolved.model_call_id}" in result["builtin"].mask_reasons
    assert f"unresolved_parent:{unresolved.model_call_id}" in result["gym"].mask_reasons
    assert all(b.masked for b in result.values())
    bad = _sibling(
        turns[2], turns[2].call_id, [9, 9] + turns[2].prompt[2:], turns[2].generation, parent_call_id=turns[1].call_id
    )
    result = builds(snapshot(entries[:2] + [bad]))
    assert f"not_contiguous:{bad.model_call_id}" in result["builtin"].mask_reasons
    # The Gym engine names the cause too (it used to be only in the metrics: a README walk found
    # a new user looking at "unresolved_parent" for a child whose prompt broke contiguity).
    assert "parent_link_failures:parent_digest_mismatch=1" in result["gym"].mask_reasons
    assert all(b.masked for b in result.values())
    assert (
        result["builtin"].metrics["parent_link_failures"]
        == result["gym"].metrics["parent_link_failures"]
        == {"parent_digest_mismatch": 1}
    )


@pytest.mark.parametrize("delta", [False, True])
def test_a_missing_parent_is_masked(delta):
    entries = conversation(4, delta=delta)
    hole = entries[:1] + entries[2:]
    child = entries[2].model_call_id
    # As a store freezes it: incomplete with the hole's reason. Never trainable on either engine.
    result = builds(snapshot(hole, incomplete=True, reasons=(f"missing_parent:{child}",)))
    for build in result.values():
        assert build.masked and build.mask_reasons[0] == f"missing_parent:{child}"
    # The builders alone (a snapshot that does not say it is incomplete).
    builtin = build_rollout(snapshot(hole), engine="builtin")
    assert builtin.masked
    assert (f"delta_chain_unreconstructable:{child}" if delta else f"missing_parent:{child}") in builtin.mask_reasons
    gym = build_rollout(snapshot(hole), engine="gym")
    if delta:
        assert gym.masked
    else:
        # Documented difference: Gym re-attaches the orphan to its surviving grandparent by token
        # prefix (parent_call_id_missing_recovered) and delivers; the built-in builder masks.
        assert not gym.masked and gym.metrics["parent_link_failures"] == {"parent_call_id_missing_recovered": 1}


def test_conflicting_duplicates_and_empty_generations_are_masked():
    turns = build_conversation("r", 3)
    entries = conversation(3)
    conflict = copy.deepcopy(entries[2])
    conflict.generation_token_ids = [1, 2, 3]
    result = builds(snapshot(entries + [conflict]))
    assert f"duplicate_call_id_conflict:{conflict.model_call_id}" in result["builtin"].mask_reasons
    assert all(b.masked for b in result.values())
    assert result["builtin"].metrics["parent_link_failures"] == result["gym"].metrics["parent_link_failures"]
    empty = _sibling(turns[2], turns[2].call_id, turns[2].prompt, [], parent_call_id=turns[1].call_id)
    builtin = build_rollout(snapshot(entries[:2] + [empty]), engine="builtin")
    assert builtin.masked and f"empty_generation:{empty.model_call_id}" in builtin.mask_reasons
    only_empty = _sibling(turns[0], turns[0].call_id, turns[0].prompt, [])
    for build in builds(snapshot([only_empty])).values():
        assert build.masked and build.trajectories == []


def test_build_rollout_never_raises_and_masks_every_broken_chain():
    entries = conversation(5, delta=True)
    variants = []  # (entries, broken: the built-in builder must mask them)
    for i in range(len(entries)):
        variants.append(([e for j, e in enumerate(entries) if j != i], i < len(entries) - 1))
        corrupt = [copy.deepcopy(e) for e in entries]
        corrupt[i].prompt_token_ids = [t + 1 for t in corrupt[i].prompt_token_ids] or [1]
        variants.append((corrupt, True))
        empty = [copy.deepcopy(e) for e in entries]
        empty[i].generation_token_ids, empty[i].generation_log_probs = [], []
        variants.append((empty, True))
    for variant, broken in variants:
        problems = check_chain(variant)
        assert bool(problems) == broken, problems  # an emptied generation fails its digest too
        for build in builds(snapshot(variant)).values():
            assert isinstance(build, RolloutBuild)
            for row in build.trajectories:
                assert len(row.token_ids) == len(row.loss_mask) == len(row.logprobs)
        assert build_rollout(snapshot(variant), engine="builtin").masked == broken, problems


def test_engine_and_builder_are_checked():
    snap = snapshot(conversation(2))
    with pytest.raises(ValueError, match="engine"):
        build_rollout(snap, engine="spark")
    with pytest.raises(ValueError, match="merge_all"):
        build_rollout(snap, engine="builtin", builder="merge_all")
    require_gym()
    with pytest.raises(ValueError, match="per_request"):  # NeMo Gym 0.7.0 knows only prefix_merging
        build_rollout(snap, engine="gym", builder="per_request")
    with pytest.raises(TypeError):
        build_rollout(list(snap.entries))
    assert build_rollout(snap).gym_result is not None  # auto: Gym when importable


def test_build_rollout_runs_inside_an_event_loop():
    require_gym()
    snap = snapshot(conversation(3))

    async def inside() -> RolloutBuild:
        return build_rollout(snap, engine="gym")

    assert rows(asyncio.run(inside())) == rows(build_rollout(snap, engine="builtin"))


def test_an_entry_without_a_parent_decision_is_named_by_both_engines():
    """A call whose capture path never stamped a parent decision (no ``parent_resolution``, no
    ``parent_call_id``): Gym lists it as an unresolved parent, which reads like a lost parent;
    both engines name the cause, ``missing_resolution:<cid>``."""
    require_gym()
    entries = conversation(3)
    unstamped = msgspec.structs.replace(entries[0], parent_resolution=None, parent_call_id=None)
    snap = snapshot([unstamped, *entries[1:]])
    for engine, build in builds(snap).items():
        assert build.masked, engine
        assert f"missing_resolution:{unstamped.model_call_id}" in build.mask_reasons, (engine, build.mask_reasons)
    whole = builds(snapshot(entries))
    assert not any(r.startswith("missing_resolution") for b in whole.values() for r in b.mask_reasons)


def _outcome(build: RolloutBuild) -> tuple:
    return (rows(build), build.masked, build.mask_reasons, build.metrics, build.gym_result, build.snapshot_id)


def test_build_rollout_async_gives_build_rollouts_result_and_errors():
    """The exporter awaits ``build_rollout_async`` on its own loop (no thread per rollout): for
    every engine, on whole, delta, holed, incomplete and conflicting snapshots, it returns what
    ``build_rollout`` returns, and refuses the same arguments with the same errors."""
    require_gym()
    delta = conversation(4, delta=True)
    cases = {
        "full": snapshot(conversation(4)),
        "delta": snapshot(delta),
        "hole": snapshot(delta[:1] + delta[2:]),
        "incomplete": snapshot(conversation(3), incomplete=True, reasons=("dangling_intent:x",)),
        "empty": snapshot([]),
    }
    for engine in (*ENGINES, "auto"):
        for builder in ("prefix_merging", "per_request"):
            if engine == "gym" and builder == "per_request":
                continue
            for name, snap in cases.items():
                want = build_rollout(snap, engine=engine, builder=builder)
                got = asyncio.run(build_rollout_async(snap, engine=engine, builder=builder))
                assert _outcome(got) == _outcome(want), (engine, builder, name)
    assert build_rollout(cases["hole"], engine="gym").masked  # the cases do reach the masking paths
    snap = cases["full"]
    for bad, error in (
        ({"engine": "spark"}, ValueError),
        ({"engine": "builtin", "builder": "merge_all"}, ValueError),
        ({"engine": "gym", "builder": "per_request"}, ValueError),
    ):
        with pytest.raises(error) as sync_error:
            build_rollout(snap, **bad)
        with pytest.raises(error) as async_error:
            asyncio.run(build_rollout_async(snap, **bad))
        assert str(async_error.value) == str(sync_error.value)
    with pytest.raises(TypeError):
        asyncio.run(build_rollout_async(list(snap.entries)))


def _token_items(entry: TokenEntry, shape: str) -> list[dict]:
    """Output items of ``entry`` with its token arrays inline, in one of the shapes users write."""
    tokens = {
        "prompt_token_ids": list(entry.prompt_token_ids),
        "generation_token_ids": list(entry.generation_token_ids),
        "generation_log_probs": list(entry.generation_log_probs),
    }
    reasoning = {"type": "reasoning", "id": "rs", "summary": []}
    message = {"type": "message", "role": "assistant", "id": "m", "content": []}
    if shape == "one_inline":  # a served response: one item carries the call's tokens
        return [reasoning, {**message, **tokens}]
    if shape in ("two_inline", "indexed_and_stray"):  # both items carry them
        return [{**reasoning, **tokens}, {**message, **tokens}]
    if shape == "stray_without_prompt":  # the indexed item is clean, another carries a generation
        return [reasoning, {**message, "generation_token_ids": list(entry.generation_token_ids)}]
    raise AssertionError(shape)


INLINE_SHAPES = {
    # shape: (token_item_index, masked)
    "one_inline": (None, False),
    "two_inline": (None, True),
    "indexed_and_stray": (1, True),
    "stray_without_prompt": (0, True),
}


def _with_token_items(entries: list[TokenEntry], shape: str, calls=None) -> list[TokenEntry]:
    index, _ = INLINE_SHAPES[shape]
    out = []
    for position, entry in enumerate(entries):
        entry = copy.deepcopy(entry)
        if calls is None or position in calls:
            entry.output_items = _token_items(entry, shape)
            entry.token_item_index = index
        out.append(entry)
    return out


@pytest.mark.parametrize("builder", ["prefix_merging", "per_request"])
@pytest.mark.parametrize("shape", sorted(INLINE_SHAPES))
def test_token_arrays_on_more_than_one_output_item_mask_on_both_engines(shape, builder):
    """Output items that carry token arrays besides the call's own item: Gym's projection copies the
    generation onto each and masks the rollout; the built-in engine used to deliver it (a breaker
    session, 2026-12-03). One inline item, the shape a served response has, stays trainable."""
    require_gym()
    _, masked = INLINE_SHAPES[shape]
    for delta in (False, True):
        entries = _with_token_items(conversation(3, delta=delta), shape, calls={1})
        snap = snapshot(entries)
        gym = build_rollout(snap, engine="gym")
        builtin = build_rollout(snap, engine="builtin", builder=builder)
        assert gym.masked is masked, (shape, gym.mask_reasons)
        assert builtin.masked is masked, (shape, builder, builtin.mask_reasons)
        cid = entries[1].model_call_id
        if masked:
            assert f"token_fields_in_output_items:{cid}" in builtin.mask_reasons
        else:
            clean = build_rollout(snapshot(conversation(3, delta=delta)), engine="builtin", builder=builder)
            assert builtin.mask_reasons == [] and rows(builtin) == rows(clean)
            if builder == "prefix_merging":
                assert rows(builtin) == rows(gym)


def test_token_arrays_on_an_off_chain_retry_do_not_mask_the_main_chain():
    """Gym projects only the main chain: a quarantined retry's output items are never projected, so
    the built-in ``prefix_merging`` engine does not mask for them either (and agrees with Gym)."""
    turns = build_conversation("r", 3)
    entries = conversation(3)
    abandoned = _sibling(turns[1], "r-retry", turns[1].prompt, [4, 4, 4], parent_call_id=turns[0].call_id)
    abandoned.output_items = _token_items(abandoned, "two_inline")
    result = builds(snapshot(entries + [abandoned]))
    for build in result.values():
        assert not build.masked, build.mask_reasons
        assert build.metrics["quarantined_calls"] == 1
    assert rows(result["builtin"]) == rows(result["gym"])


# --------------------------------------------------------------------------- on S3
async def test_capture_freeze_and_build_on_s3(fresh):
    """Capture two example rollouts (delta prompts) through the demo's call path into S3, freeze,
    build: both engines agree, and the Gym engine's result is what Gym's consumer gives on the store."""
    require_gym()
    from nemo_gym.token_id_capture.consumer import trajectories_from_source

    run = uuid.uuid4().hex[:6]
    picked = [r for r in load_rollouts([example_file("hermes_math.jsonl")]) if len(r.calls) > 1][:1]
    picked += [r for r in load_rollouts([example_file("anyterminal_hermes.jsonl")]) if len(r.calls) < 10][:1]
    picked = [dataclasses.replace(r, rollout_id=f"{r.rollout_id}-{run}") for r in picked]
    assert [len(r.calls) for r in picked] == [4, 7]
    writer = fresh()
    await _capture(picked, True, writer)
    reader, gym_reader = fresh(), fresh(entry_type="gym")
    for rollout in picked:
        snap = await reader.freeze(rollout.rollout_id)
        assert not snap.incomplete and len(snap.entries) == len(rollout.calls)
        assert sum(e.prompt_is_delta for e in snap.entries) == len(rollout.calls) - 1
        assert check_chain(snap.entries) == []
        gym, builtin = build_rollout(snap, engine="gym"), build_rollout(snap, engine="builtin")
        assert not gym.masked and not builtin.masked
        assert rows(gym) == rows(builtin) and gym.metrics == builtin.metrics
        (row,) = builtin.trajectories
        assert row.call_ids == [c.model_call_id for c in rollout.calls]
        last = rollout.calls[-1]
        assert row.token_ids == list(last.prompt_token_ids) + list(last.generation_token_ids)
        # Gym's consumer on the store itself (a frozen rollout freezes to the same snapshot).
        direct = await trajectories_from_source(rollout.rollout_id, gym_reader)
        assert direct == gym.gym_result
        gym_snap = await gym_reader.freeze(rollout.rollout_id)
        assert rows(build_rollout(gym_snap, engine="builtin")) == rows(builtin)


async def test_token_arrays_on_two_output_items_mask_on_s3(fresh):
    """The same through the store: entries whose output items carry token arrays inline are stored
    as given, and after a freeze both engines mask them (one inline item stays trainable)."""
    require_gym()
    run = uuid.uuid4().hex[:6]
    writer, reader = fresh(), fresh()
    for shape in ("one_inline", "two_inline"):
        rid = f"inline-{shape}-{run}"
        entries = _with_token_items(conversation(3, delta=True, rollout_id=rid), shape)
        for entry in entries:
            await writer.begin_call(rid, entry.model_call_id)
            await writer.put(entry)
        snap = await reader.freeze(rid)
        assert not snap.incomplete and [e.output_items for e in snap.entries] == [e.output_items for e in entries]
        gym, builtin = await build_rollout_async(snap, engine="gym"), await build_rollout_async(snap, engine="builtin")
        masked = INLINE_SHAPES[shape][1]
        assert (gym.masked, builtin.masked) == (masked, masked), (shape, gym.mask_reasons, builtin.mask_reasons)
        if masked:
            assert {f"token_fields_in_output_items:{e.model_call_id}" for e in entries} <= set(builtin.mask_reasons)
        else:
            assert rows(gym) == rows(builtin) and len(builtin.trajectories) == 1


def test_without_nemo_gym_auto_uses_the_builtin_engine(monkeypatch):
    import subprocess
    import sys

    from s3capture.trajectory import build as trajectory_build  # _gym_importable reads _gym_found there

    # The module imports and builds with NeMo Gym unimportable (a fresh interpreter).
    code = (
        "import sys; sys.modules['nemo_gym'] = None\n"
        "from s3capture.trajectory import build_rollout\n"
        "from s3capture.store import FrozenSnapshot\n"
        "b = build_rollout(FrozenSnapshot('r', (), False, 's', 1, ()))\n"
        "assert b.masked and b.gym_result is None and b.mask_reasons == ['no_entries'], b\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("nemo_gym.token_id_capture.consumer", "nemo_gym.token_id_capture.records"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(trajectory_build, "_gym_found", None)
    snap = snapshot(conversation(3, delta=True))
    auto = build_rollout(snap)
    assert (
        auto.gym_result is None
        and not auto.masked
        and auto.trajectories[0].call_ids == [e.model_call_id for e in snap.entries]
    )
    with pytest.raises(ImportError, match="nemo-gym"):
        build_rollout(snap, engine="gym")
    with pytest.raises(ImportError, match="nemo-gym"):
        to_gym_entries(snap)


def test_per_request_gives_each_call_its_full_sequence():
    """Builder ``per_request`` (built-in; NeMo Gym 0.7.0 has none): one row per model call, its
    full prompt with loss 0 and its generation with loss 1; auto picks the built-in engine for it."""
    entries = conversation(3)
    by_id = {e.model_call_id: e for e in entries}
    build = build_rollout(snapshot(entries), builder="per_request")
    assert not build.masked and build.gym_result is None
    assert [t.call_ids for t in build.trajectories] == [[e.model_call_id] for e in entries]
    for row in build.trajectories:
        entry = by_id[row.chain_id]
        prompt = cumulative_prompt(entry, by_id)
        assert row.token_ids == prompt + list(entry.generation_token_ids)
        assert row.loss_mask == [0] * len(prompt) + [1] * len(entry.generation_token_ids)
        assert row.logprobs[len(prompt) :] == [float(p) for p in entry.generation_log_probs]
    # The same evidence masks it as prefix_merging: an incomplete snapshot is never trainable.
    masked = build_rollout(snapshot(entries, incomplete=True, reasons=("dangling_intent:x",)), builder="per_request")
    assert masked.masked and "dangling_intent:x" in masked.mask_reasons
