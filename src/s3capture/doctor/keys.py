"""The key probes of ``s3capture doctor``: ``//`` and dot segments as the server stores them, and
keys shaped like the layout's through the probed transport (``transport-keys``, ``layout_keys``)."""

from __future__ import annotations

import hashlib
import os

from s3capture.doctor.framework import Probe, _code, _DoctorBase
from s3capture.errors import StoreError
from s3capture.layout import Layout
from s3capture.transport import gather_settled

KEY_ROOTS = ("", "plain", "a b/c+d", "x%y/\u00fc/z*!()@$", "t~/a=b&c/semi;colon", "quote\"s'/<a>/{b}|^`[c]")
KEY_IDS = ("r/with/slashes", "caf\u00e9 \u2603 ..", "~a%2Fb")
"""Roots and rollout ids (``tests/test_transport.py``'s ``ROOTS`` and ``IDS``) whose layout keys the
``transport-keys`` probe writes: characters a client could encode or refuse in the roots, escapes
(``.HH``, ``~``) in the ids."""


def layout_keys() -> list[str]:
    """Keys shaped as ``Layout`` builds them under every root of ``KEY_ROOTS``, one per id of
    ``KEY_IDS``: a fence, an entry (escaped fingerprint and call id) and a marker."""
    keys = []
    for root in KEY_ROOTS:
        layout = Layout(root)
        for rid, shape in zip(KEY_IDS, ("fence", "entry", "marker")):
            prefix = layout.rollout(rid)
            digest = hashlib.sha256(prefix.encode()).hexdigest()
            if shape == "fence":
                rel = "fence"
            elif shape == "entry":
                rel = layout.entry_rel(prefix, "fp \u2603", "c/1", digest)
            else:
                call = layout.marker_call_segment(prefix, "c:2 \u00e9")
                rel = f"log/x/{call}/{digest[:32]}"
            keys.append(prefix + rel)
    return keys


class _KeyProbes(_DoctorBase):
    """The probes of which keys the store (and the probed transport) keeps byte for byte."""

    async def _odd_keys(self, name: str, base: str, rels: tuple[str, ...], what: str) -> Probe:
        outcome: dict[str, str] = {}
        for rel in rels:
            try:
                await self.raw("put_object", Key=base + rel, Body=b"k")
            except Exception as error:  # noqa: BLE001 - refused keys are an outcome
                outcome[rel] = f"refused ({_code(error) or type(error).__name__})"
        listed = [k[len(base) :] for k in await self.raw_list(base)]
        for rel in rels:
            outcome.setdefault(rel, "kept verbatim" if rel in listed else "rewritten")
        data = {"put": list(rels), "listed": listed, "outcome": outcome}
        shown = "; ".join(f"{rel!r}: {how}" for rel, how in outcome.items())
        if listed and all(how.startswith("rewritten") for how in outcome.values()):
            shown += f" (listed as {', '.join(repr(k) for k in listed)})"
        if all(how == "kept verbatim" for how in outcome.values()):
            return Probe(name, "ok", f"keys with {what} are kept verbatim ({shown})", "", data)
        return Probe(
            name,
            "note",
            f"keys with {what} are not kept verbatim: {shown}",
            f"nothing to change: s3capture's layout never builds {what} (ids are escaped) and refuses a "
            "prefix that contains them",
            data,
        )

    async def double_slash(self) -> Probe:
        return await self._odd_keys("double-slash", self.k("dd/"), ("a//x",), "'//'")

    async def dot_segments(self) -> Probe:
        return await self._odd_keys("dot-segments", self.k("dot/"), ("s/./x", "s/t/../y"), "'.' or '..' segments")

    async def transport_keys(self) -> Probe:
        base = self.k("keys/")
        keys = layout_keys()
        bodies = {rel: rel.encode() + os.urandom(8) for rel in keys}
        refused: dict[str, str] = {}

        async def put(rel: str) -> None:
            try:
                await self.t.put(base + rel, bodies[rel])
            except Exception as error:  # noqa: BLE001 - a refused key is an outcome
                refused[rel] = str(error).split("\n", 1)[0][:200]

        await gather_settled(put(rel) for rel in keys)
        unread = []
        for rel in keys:
            if rel not in refused:
                try:
                    got = await self.t.get(base + rel)
                except StoreError:
                    got = None
                if got != bodies[rel]:
                    unread.append(rel)
        listed = [k[len(base) :] for k in await self.raw_list(base)]
        changed = [rel for rel in keys if rel not in refused and rel not in listed]
        instead = [rel for rel in listed if rel not in bodies]
        name = self.t.name
        data = {
            "transport": name,
            "keys": len(keys),
            "refused": refused,
            "changed": changed,
            "unread": unread,
            "listed_instead": instead,
        }
        if not (refused or changed or unread):
            return Probe(
                "transport-keys",
                "ok",
                f"{len(keys)} keys shaped like the layout's ({len(KEY_ROOTS)} roots with spaces, '%', '+', "
                f"non-ASCII and punctuation; escaped ids) written through the {name} transport reached the "
                "server byte for byte and read back through it",
                "",
                data,
            )
        problems = []
        if refused:
            rel = next(iter(refused))
            problems.append(f"{len(refused)} refused (first: {rel!r}: {refused[rel]})")
        if changed:
            problems.append(f"{len(changed)} stored under another key (first: {changed[0]!r})")
        if instead:
            problems.append(f"listed instead: {', '.join(repr(k) for k in instead[:3])}")
        if unread:
            problems.append(f"{len(unread)} not read back with the bytes written (first: {unread[0]!r})")
        if name == "aioboto3":
            advice = (
                "s3capture writes keys of these shapes and finds them again by listing: use a store (or a "
                "proxy in front of it) that keeps keys byte for byte"
            )
        else:
            advice = (
                f"the {name} transport does not carry s3capture's keys to this store unchanged: use the "
                "aioboto3 transport (S3CAPTURE_TRANSPORT=aioboto3, or transport='aioboto3'; check it with "
                "s3capture doctor --transport aioboto3)"
            )
        return Probe(
            "transport-keys",
            "fail",
            f"of {len(keys)} keys shaped like the layout's written through the {name} transport: "
            + "; ".join(problems),
            advice,
            data,
        )
