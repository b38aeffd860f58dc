"""Chain helpers of one rollout's entries (issue 9): cumulative tokens and contiguity checks.

``cumulative_prompt`` rebuilds the full prompt of a delta or full-prompt entry through its parent
links (verified against the entries' digests), ``check_chain`` lists the contiguity problems of a
snapshot's entries, and ``ChainError`` is raised for a chain that cannot be rebuilt. ``_cumulative``
(cumulative tokens, prompt plus generation) is what both builders (``builtin``, ``gym``) rebuild
chains with. No S3, no NeMo Gym.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from s3capture.records import compute_digest


class ChainError(ValueError):
    """An entry's chain cannot be rebuilt: a hole (a parent missing from the snapshot), a cycle of
    parent links, a delta prompt without a parent, or rebuilt tokens that fail the entry's digest."""


# --------------------------------------------------------------------------- chain helpers
def _cumulative(entry: Any, by_id: Mapping[str, Any], memo: dict[str, list[int]] | None) -> list[int]:
    """``entry``'s cumulative tokens (full prompt + generation); raises ``ChainError``.

    Iterative (a chain can be thousands of calls deep). Every delta entry rebuilt is checked
    against its ``digest``; with ``memo`` every entry walked is remembered there.
    """
    path: list[Any] = []
    seen: set[str] = set()
    current = entry
    while True:
        key = current.model_call_id
        if memo is not None and key in memo:
            base = memo[key]
            break
        if not current.prompt_is_delta:
            base = list(current.prompt_token_ids)
            base.extend(current.generation_token_ids)
            if memo is not None:
                memo[key] = base
            break
        if key in seen:
            raise ChainError(f"{entry.model_call_id}: the parent links of its delta chain form a cycle at {key}")
        seen.add(key)
        path.append(current)
        parent_id = current.parent_call_id
        if not parent_id:
            raise ChainError(f"{key}: delta prompt without a parent_call_id to rebuild it from")
        parent = by_id.get(parent_id)
        if parent is None:
            raise ChainError(
                f"{key}: delta prompt whose parent {parent_id} is not in the snapshot (a hole in the chain)"
            )
        current = parent
    if not path:
        return base
    if memo is None:
        # One concatenation, one digest: the entry's digest covers its whole sequence.
        tokens = list(base)
        for item in reversed(path):
            tokens.extend(item.prompt_token_ids)
            tokens.extend(item.generation_token_ids)
        if entry.digest and compute_digest(tokens) != entry.digest:
            raise ChainError(
                f"{entry.model_call_id}: the cumulative tokens rebuilt from its delta prompt fail its digest"
            )
        return tokens
    tokens = base
    for item in reversed(path):
        tokens = tokens + list(item.prompt_token_ids) + list(item.generation_token_ids)
        if item.digest and compute_digest(tokens) != item.digest:
            raise ChainError(
                f"{item.model_call_id}: the cumulative tokens rebuilt from its delta prompt fail its digest"
            )
        memo[item.model_call_id] = tokens
    return tokens


def cumulative_prompt(
    entry: Any, entries_by_call_id: Mapping[str, Any], *, memo: dict[str, list[int]] | None = None
) -> list[int]:
    """The full prompt token ids of ``entry`` (a new list), whether it stores a full or a delta prompt.

    ``entry``: an s3capture or NeMo Gym ``TokenEntry``. A full-prompt entry's own
    ``prompt_token_ids`` are returned. A ``prompt_is_delta`` entry stores only the suffix after its
    parent's cumulative tokens: its full prompt is the parent's cumulative tokens (the parent's full
    prompt plus its ``generation_token_ids``, rebuilt the same way up to the nearest full-prompt
    ancestor, looked up by ``parent_call_id`` in ``entries_by_call_id``) followed by that suffix.
    The rebuilt cumulative tokens (prompt plus generation) are checked against ``entry``'s recorded
    ``digest`` (when it has one), which covers the whole sequence; with ``memo``, the digest of every
    delta entry rebuilt on the way is checked too, so a wrong ``digest`` recorded on an ancestor
    raises only then (``check_chain`` reports it either way).

    ``memo``: optional dict, model call id -> cumulative tokens (full prompt + generation), read and
    filled; pass the same dict for every entry of one snapshot to rebuild a whole delta chain in
    time linear in its tokens. Its lists are shared: do not mutate them.

    Raises ``ChainError`` on a hole (a parent missing from ``entries_by_call_id``), a cycle, a
    delta entry without ``parent_call_id``, or rebuilt tokens that fail a digest.
    """
    tokens = _cumulative(entry, entries_by_call_id, memo)
    return tokens[: len(tokens) - len(entry.generation_token_ids)]


def _same_tokens(a: Any, b: Any) -> bool:
    return (list(a.prompt_token_ids), list(a.generation_token_ids), bool(a.prompt_is_delta)) == (
        list(b.prompt_token_ids),
        list(b.generation_token_ids),
        bool(b.prompt_is_delta),
    )


def check_chain(entries: Sequence[Any]) -> list[str]:
    """The contiguity problems of one rollout's entries (an empty list: every chain is contiguous).

    ``entries``: the entries of one snapshot (``snapshot.entries``), s3capture or NeMo Gym
    ``TokenEntry`` objects, in any order. Each problem is one line starting with the model call id
    it concerns. Reported:

    - a model call id held by two entries with different tokens;
    - a chain that cannot be rebuilt (``cumulative_prompt`` raises ``ChainError``: a hole, a cycle,
      a digest that a rebuilt delta fails);
    - a recorded ``digest`` or ``cum_len`` that does not match the entry's cumulative tokens;
    - a ``parent_call_id`` that is not among the entries (a hole);
    - a child whose full prompt does not start with its parent's cumulative tokens (the parent's
      full prompt plus its generation);
    - a cycle of parent links through a full-prompt entry (possible without a contiguity problem
      only when the generations on it are empty; a cycle of delta entries is a ``ChainError``).

    Parent *decisions* (UNRESOLVED calls, several roots) are not problems here; ``build_rollout``
    judges them. Raises nothing for bad chains; ``AttributeError`` for objects that are not entries.
    """
    problems: list[str] = []
    by_id: dict[str, Any] = {}
    for entry in entries:
        previous = by_id.get(entry.model_call_id)
        if previous is not None:
            if previous is not entry and not _same_tokens(previous, entry):
                problems.append(f"{entry.model_call_id}: two entries with different tokens share this model call id")
            continue
        by_id[entry.model_call_id] = entry
    memo: dict[str, list[int]] = {}
    for cid, entry in by_id.items():
        try:
            tokens = _cumulative(entry, by_id, memo)
        except ChainError as error:
            problems.append(str(error))
            continue
        if not entry.prompt_is_delta and entry.digest and compute_digest(tokens) != entry.digest:
            problems.append(f"{cid}: cumulative tokens fail their digest")
        if entry.cum_len is not None and entry.cum_len != len(tokens):
            problems.append(f"{cid}: cum_len {entry.cum_len} but its cumulative tokens are {len(tokens)} long")
        parent_id = entry.parent_call_id
        if not parent_id:
            continue
        parent = by_id.get(parent_id)
        if parent is None:
            if not entry.prompt_is_delta:  # a delta entry's hole is already reported by _cumulative
                problems.append(f"{cid}: parent {parent_id} not in snapshot (a hole in the chain)")
            continue
        if entry.prompt_is_delta:
            continue  # rebuilt from the parent: contiguous by construction (and digest-checked)
        try:
            parent_tokens = _cumulative(parent, by_id, memo)
        except ChainError:
            continue  # reported on the parent
        n = len(parent_tokens)
        if len(tokens) - len(entry.generation_token_ids) < n or tokens[:n] != parent_tokens:
            problems.append(
                f"{cid}: prompt does not start with parent {parent_id}'s tokens (its prompt plus generation)"
            )
    problems.extend(_cycles(by_id))
    return _unique(problems)  # a broken ancestor is reported once, not again for each descendant


def _cycles(by_id: Mapping[str, Any]) -> list[str]:
    """One problem per cycle of parent links that holds a full-prompt entry (iterative, linear)."""
    problems: list[str] = []
    done: set[str] = set()
    for start in by_id:
        on_path: dict[str, int] = {}
        path: list[str] = []
        cid: str | None = start
        while cid is not None and cid in by_id and cid not in done and cid not in on_path:
            on_path[cid] = len(path)
            path.append(cid)
            cid = by_id[cid].parent_call_id or None
        if cid is not None and cid in on_path:
            cycle = path[on_path[cid] :]
            if any(not by_id[c].prompt_is_delta for c in cycle):
                problems.append(f"{cycle[0]}: its parent links form a cycle ({' -> '.join([*cycle, cycle[0]])})")
        done.update(path)
    return problems


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))
