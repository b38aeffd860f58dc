"""The built-in engine (``engine="builtin"``, no NeMo Gym): ``prefix_merging`` and ``per_request``.

``_build_builtin`` follows the recorded parent links and builds the main chain the way Gym's
``prefix_merging`` does for the same input when no terminal is attributed (stricter where they
differ, never looser); ``_per_request`` gives one trajectory per model call. The rules and mask
reasons are in the ``s3capture.trajectory`` package docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from s3capture.records import compute_digest
from s3capture.trajectory.chains import ChainError, _cumulative, _same_tokens
from s3capture.trajectory.results import (
    RolloutBuild,
    Trajectory,
    _incomplete,
    _rollout_build,
    _snapshot_reasons,
)


_NO_ATTRIBUTION = {"method": "none", "call_id": None, "reason": "no_response_object"}
"""Gym's terminal-attribution metric when the consumer is given no verified response."""


# --------------------------------------------------------------------------- engine "builtin"
@dataclass(eq=False)
class _Node:
    entry: Any
    prompt_len: int
    cumulative: list[int]
    parent: "_Node | None" = None
    children: list["_Node"] = field(default_factory=list)
    quarantined: bool = False


def _status(entry: Any) -> str | None:
    value = entry.parent_resolution
    return None if value is None else str(getattr(value, "value", value))


def _stray_token_items(entry: Any) -> bool:
    """Whether Gym's projection of ``entry`` (``project_chain_to_output_items``) would put token
    fields on more than the one output item that carries the call's generation, which its
    contiguity check then refuses (or fails on with a ``KeyError``): with a valid
    ``token_item_index``, another item that carries ``generation_token_ids`` inline; without one,
    two or more items that carry them (each gets the whole generation). A breaker session found
    the built-in engine delivering such rollouts that Gym's masks."""
    items = entry.output_items or []
    inline = [
        i for i, item in enumerate(items) if isinstance(item, dict) and item.get("generation_token_ids") is not None
    ]
    index = entry.token_item_index
    if index is not None and 0 <= index < len(items):
        return any(i != index for i in inline)
    return len(inline) > 1


def _build_builtin(snapshot: Any, builder: str = "prefix_merging") -> RolloutBuild:
    entries = list(snapshot.entries)
    reasons = _snapshot_reasons(snapshot)

    def result(trajectories: list[Trajectory], masked: bool, metrics: dict) -> RolloutBuild:
        masked = masked or bool(reasons)
        if _incomplete(snapshot):
            metrics["capture_incomplete"] = True
        return _rollout_build(snapshot, trajectories, masked, reasons, metrics)

    if not entries:
        reasons.append("no_entries")
        return result([], True, {"n_calls": 0})
    failed_metrics = {"n_calls": len(entries), "terminal_attribution": {**_NO_ATTRIBUTION, "chain": "error"}}

    failures: dict[str, int] = {}
    unresolved_parents: list[str] = []

    def fail(kind: str, cid: str, reason: str | None = None) -> None:
        failures[kind] = failures.get(kind, 0) + 1
        unresolved_parents.append(cid)
        reasons.append(f"{reason or kind}:{cid}")

    # Duplicates: an identical one is a redelivery; different tokens under one id are corrupt.
    by_id: dict[str, Any] = {}
    for entry in entries:
        previous = by_id.get(entry.model_call_id)
        if previous is None:
            by_id[entry.model_call_id] = entry
        elif previous is not entry and not _same_tokens(previous, entry):
            fail("duplicate_call_id_conflict", entry.model_call_id)

    # Full prompts, verified (delta prompts are rebuilt through their parents first).
    memo: dict[str, list[int]] = {}
    survivors: list[tuple[Any, list[int]]] = []
    for cid, entry in by_id.items():
        try:
            cumulative = _cumulative(entry, by_id, memo)
        except ChainError:
            fail("delta_chain_unreconstructable", cid)
            continue
        if not entry.prompt_is_delta and entry.digest and compute_digest(cumulative) != entry.digest:
            reasons.append(f"digest_mismatch:{cid}")
        if entry.cum_len is not None and entry.cum_len != len(cumulative):
            reasons.append(f"cum_len_mismatch:{cid}")
        if len(entry.generation_log_probs) != len(entry.generation_token_ids):
            reasons.append(f"logprob_length_mismatch:{cid}")
        survivors.append((entry, cumulative))

    empty = [e.model_call_id for e, _ in survivors if not e.generation_token_ids]
    reasons.extend(f"empty_generation:{cid}" for cid in empty)
    survivors = [(e, c) for e, c in survivors if e.generation_token_ids]
    if not survivors:
        reasons.append("no_trainable_chain")
        return result([], True, failed_metrics)
    if builder == "per_request":
        return _per_request(survivors, entries, reasons, failures, empty, result)

    # Link calls by their recorded parents, shortest prompt first (a parent's prompt is shorter).
    survivors.sort(key=lambda pair: (len(pair[1]) - len(pair[0].generation_token_ids), pair[0].model_call_id))
    nodes: list[_Node] = []
    roots: list[_Node] = []
    nodes_by_id: dict[str, _Node] = {}
    for entry, cumulative in survivors:
        cid = entry.model_call_id
        node = _Node(entry, len(cumulative) - len(entry.generation_token_ids), cumulative)
        status = _status(entry)
        parent: _Node | None = None
        if status == "root":
            pass
        elif status == "unresolved":
            fail("parent_unresolved", cid)
        elif status == "resolved" or entry.parent_call_id is not None:
            if entry.parent_call_id is None:
                fail("resolved_parent_missing_id", cid)
            elif (candidate := nodes_by_id.get(entry.parent_call_id)) is None:
                fail("parent_call_id_missing", cid, "missing_parent")
            elif (
                node.prompt_len >= len(candidate.cumulative)
                and cumulative[: len(candidate.cumulative)] == candidate.cumulative
            ):
                parent = candidate
            else:
                fail("parent_digest_mismatch", cid, "not_contiguous")
        else:
            fail("missing_resolution", cid)
        if parent is not None:
            node.parent = parent
            parent.children.append(node)
        else:
            roots.append(node)
        nodes.append(node)
        nodes_by_id[cid] = node

    # Retry siblings (same parent, same prompt): keep the ones a later call extends; when none is
    # extended keep the smallest id and report the group unresolved (Gym's rule without a terminal).
    unresolved_retries: list[str] = []
    quarantined = 0
    groups: dict[Any, list[_Node]] = {}
    for node in nodes:
        groups.setdefault("roots" if node.parent is None else id(node.parent), []).append(node)
    for group in groups.values():
        by_prompt: dict[tuple[int, ...], list[_Node]] = {}
        for node in group:
            by_prompt.setdefault(tuple(node.cumulative[: node.prompt_len]), []).append(node)
        for retry_group in by_prompt.values():
            if len(retry_group) < 2:
                continue
            extended = [n for n in retry_group if any(not child.quarantined for child in n.children)]
            if extended:
                keep = set(extended)
            else:
                keep = {min(retry_group, key=lambda n: n.entry.model_call_id)}
                unresolved_retries.extend(n.entry.model_call_id for n in retry_group)
            for node in retry_group:
                if node not in keep and not node.quarantined:
                    node.quarantined = True
                    quarantined += 1
    reasons.extend(f"unresolved_retry:{cid}" for cid in unresolved_retries)

    # Root-to-leaf chains without a quarantined call; the main one has the earliest root.
    chains: list[list[_Node]] = []
    for leaf in (n for n in nodes if not n.children):
        path: list[_Node] = []
        current: _Node | None = leaf
        while current is not None:
            path.append(current)
            current = current.parent
        if not any(n.quarantined for n in path):
            chains.append(path[::-1])
    if len(roots) != 1:
        reasons.append(f"roots:{len(roots)}")
    if len(chains) != 1:
        reasons.append(f"chains:{len(chains)}")
    if not chains:
        reasons.append("no_trainable_chain")
        return result([], True, failed_metrics)
    main = min(chains, key=lambda c: (c[0].entry.created_at, c[0].entry.model_call_id))
    reasons.extend(f"token_fields_in_output_items:{n.entry.model_call_id}" for n in main if _stray_token_items(n.entry))

    token_ids: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    for node in main:
        interstitial = node.cumulative[len(token_ids) : node.prompt_len]
        token_ids.extend(interstitial)
        loss_mask.extend([0] * len(interstitial))
        logprobs.extend([0.0] * len(interstitial))
        token_ids.extend(node.entry.generation_token_ids)
        loss_mask.extend([1] * len(node.entry.generation_token_ids))
        logprobs.extend(map(float, node.entry.generation_log_probs))  # C-level: a generator cost ~5 ms a rollout
    if any(r.startswith("logprob_length_mismatch:") for r in reasons):
        return result([], True, failed_metrics)  # log probabilities that do not align: Gym fails the build
    call_ids = [n.entry.model_call_id for n in main]
    trajectories = [
        Trajectory(
            chain_id=call_ids[-1], call_ids=call_ids, token_ids=token_ids, loss_mask=loss_mask, logprobs=logprobs
        )
    ]

    captured = sum(len(e.generation_token_ids) for e, _ in survivors)
    delivered = sum(len(n.entry.generation_token_ids) for n in main)
    metrics = {
        "n_calls": len(entries),
        "terminal_attribution": {**_NO_ATTRIBUTION, "chain": ""},
        "chains": len(chains),
        "roots": len(roots),
        "quarantined_calls": quarantined,
        "quarantined_fraction": round(quarantined / len(entries), 4),
        "delivered_fraction": round(delivered / captured, 4) if captured else 0.0,
        "generated_tokens_captured": captured,
        "generated_tokens_delivered": delivered,
        "parent_link_failures": failures,
        "unresolved_parent_calls": len(unresolved_parents),
        "empty_generation_calls": len(empty),
    }
    return result(trajectories, bool(reasons), metrics)


def _per_request(
    survivors: list[tuple[Any, list[int]]],
    entries: list[Any],
    reasons: list[str],
    failures: dict[str, int],
    empty: list[str],
    result: Any,
) -> RolloutBuild:
    """Builder ``per_request``: one trajectory per model call with generated tokens, ordered by
    prompt length then call id. ``token_ids`` is the call's full prompt (loss 0) and its generation
    (loss 1); ``chain_id`` and ``call_ids`` name the call. Parent links are not needed to build it,
    but the rollout is masked on the same evidence as ``prefix_merging`` (an incomplete snapshot,
    a delta prompt that cannot be rebuilt, a digest, length or log-probability mismatch, an empty
    generation, output items that carry token fields besides the call's own), so a rollout with a hole
    is never trainable whichever builder reads it."""
    reasons.extend(f"token_fields_in_output_items:{e.model_call_id}" for e, _ in survivors if _stray_token_items(e))
    if any(r.startswith("logprob_length_mismatch:") for r in reasons):
        return result([], True, {"n_calls": len(entries), "parent_link_failures": failures})
    ordered = sorted(
        survivors, key=lambda pair: (len(pair[1]) - len(pair[0].generation_token_ids), pair[0].model_call_id)
    )
    trajectories = []
    for entry, cumulative in ordered:
        generated = len(entry.generation_token_ids)
        prompt = len(cumulative) - generated
        trajectories.append(
            Trajectory(
                chain_id=entry.model_call_id,
                call_ids=[entry.model_call_id],
                token_ids=list(cumulative),
                loss_mask=[0] * prompt + [1] * generated,
                logprobs=[0.0] * prompt + list(map(float, entry.generation_log_probs)),
            )
        )
    captured = sum(len(e.generation_token_ids) for e, _ in survivors)
    metrics = {
        "n_calls": len(entries),
        "generated_tokens_captured": captured,
        "generated_tokens_delivered": captured,
        "parent_link_failures": failures,
        "empty_generation_calls": len(empty),
    }
    return result(trajectories, bool(reasons), metrics)
