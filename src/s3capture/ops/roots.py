"""Hints for a URL without rollouts: the s3capture roots inside it (a URL one level too high) or
beside it (a typo in its last segment), from one LIST page each (``roots_below``, ``roots_beside``,
``roots_hint``, ``roots_near``)."""

from __future__ import annotations

import difflib

from s3capture.rollouts import RolloutObjects


async def roots_below(store: RolloutObjects, limit: int = 5) -> list[str]:
    """``s3://`` URLs of s3capture roots inside ``store``'s root: prefixes under it that hold a
    ``rollouts/`` folder, from one LIST page (the first 1,000 keys under the root).

    A hint for a URL that names a parent of the root its user meant (``s3://b/capture`` for
    ``s3://b/capture/run-42``), whose own listing of rollouts is empty. At most ``limit`` URLs, in
    key order; empty when nothing under the root looks like another root, and when the LIST fails
    (a hint: a role allowed to list only ``ROOT/rollouts/`` gets none, and no error).
    """
    return await _roots_under(store, store.layout.root, limit)


async def roots_beside(store: RolloutObjects, limit: int = 5) -> list[str]:
    """``s3://`` URLs of s3capture roots beside ``store``'s root: other prefixes under its parent
    that hold a ``rollouts/`` folder, from one LIST page (the parent's first 1,000 keys).

    A hint for a URL with a typo in its last segment (``run-4`` for ``run-44``), whose listing of
    rollouts is empty. At most ``limit`` URLs, the closest to the root's last segment first
    (``difflib``'s ratio; a walkthrough, 2026-12-03: in key order the root a typo missed could be
    left out of the five named); empty for a root at the top of its bucket's own key space
    (``s3://b``) and when the LIST fails (a hint, never an error)."""
    root = store.layout.root
    if not root:
        return []
    parent = root[: root.rstrip("/").rfind("/") + 1]
    found = await _roots_under(store, parent, 1000, skip=root)
    mine = root[len(parent) :].rstrip("/")

    def closeness(url: str) -> float:
        return difflib.SequenceMatcher(None, mine, url.rsplit("/", 1)[-1]).ratio()

    return sorted(found, key=closeness, reverse=True)[:limit]  # a stable sort: key order among equals


async def _roots_under(store: RolloutObjects, prefix: str, limit: int, skip: str = "") -> list[str]:
    """``s3://`` URLs of the prefixes under ``prefix`` (but ``skip``) that hold a ``rollouts/``
    folder, among the first 1,000 keys; ``prefix``'s own rollouts (an id or call id named
    "rollouts" included) are not another root. ``[]`` when the LIST fails: a hint, never an error."""
    from s3capture.errors import StoreError

    try:
        page = await store._list_page(prefix, 1000)
    except StoreError:
        return []
    found: dict[str, None] = {}
    for item in page.objects:
        rel = item.key[len(prefix) :]
        if rel.startswith("rollouts/"):
            continue
        cut = rel.find("/rollouts/")
        if cut > 0 and prefix + rel[:cut] + "/" != skip:
            found.setdefault(rel[:cut], None)
            if len(found) >= limit:
                break
    return [f"s3://{store.bucket}/{prefix}{rel}" for rel in found]


def roots_hint(below: list[str], beside: list[str]) -> str:
    """The hint for a root without rollouts: the roots inside it (a URL one level too high), else
    the roots beside it (a typo in its last segment); ``""`` when there are neither."""
    if below:
        return f"roots inside this URL (among its first 1,000 keys): {', '.join(below)}"
    if beside:
        return f"roots beside this URL (among its parent's first 1,000 keys): {', '.join(beside)}"
    return ""


async def roots_near(store: RolloutObjects) -> str:
    """``roots_hint`` for ``store``'s root: one LIST page, two when nothing is inside it."""
    below = await roots_below(store)
    return roots_hint(below, [] if below else await roots_beside(store))
