"""Turn NeMo Gym rollout files into a call-by-call replay workload.

Format understanding
====================

A NeMo Gym rollout file is JSON Lines: each non-blank line is one finished rollout, a JSON
object with (at least)

* ``responses_create_params`` -- the Responses API request that started the rollout.
  ``input`` is either a list of input items or a plain string.  A plain string is the
  Responses shorthand for one user message; it is expanded to
  ``{"role": "user", "content": <string>, "type": "message"}``.
  ``instructions`` and ``tools`` may also be present (both unused in the example files).
* ``response`` -- the final, aggregated Responses object.  ``response.output`` holds every
  item the rollout produced, in order, across *all* model calls: the model's items and the
  environment's items interleaved.
* Agent / verifier fields (``reward``, ``_ng_task_index``, ``_ng_rollout_index``, ...), ignored
  here except for the two ``_ng_*`` indices, which go into the rollout id.

Model-authored items are ``type == "reasoning"``, ``type == "message"`` with
``role == "assistant"``, and ``type == "function_call"``.  (An item with a ``role`` but no
``type`` is an easy-input message, as in Gym's own converter.)  A *model call* is a maximal
run of consecutive model-authored items in ``response.output``; everything between runs
(``function_call_output``, user messages, ...) was supplied by the environment.  Call ``k``'s
request is the original input followed by every output item before run ``k``; hence, for
``k > 0``::

    request[k] == request[k-1] + output[k-1] + <environment items between run k-1 and run k>

Environment items after the last run belong to no call and are dropped; a rollout without
model-authored items yields a :class:`ReplayRollout` with no calls.

Token arrays.  Gym attaches ``prompt_token_ids``, ``generation_token_ids``,
``generation_log_probs`` (and optionally ``routed_experts``) to one model-authored item per
call -- in the example files the assistant message, in ``vllm_round_trip.json`` the last
function call of a run or a lone reasoning item.  These arrays describe the whole call (the
generation includes the reasoning tokens, e.g. ``<think>``), not just the carrying item.  If
several items of a run carry arrays, the last one wins, as in Gym's ``ResponsesConverter``.
The arrays are *real* when both ``prompt_token_ids`` and ``generation_token_ids`` are
non-empty; real arrays (including the log probs, bit-exact) are used as they are, even when
a later call's real prompt does not extend the previous call's prompt + generation (the chain
is then non-contiguous; nothing is fabricated to hide that).  The token keys are stripped
from every item this module returns (``output_items`` *and* ``request_items``).

Otherwise (keys absent or empty, as in ``anyterminal_hermes.jsonl`` and ``hermes_math.jsonl``)
deterministic synthetic ids are derived and the call is flagged ``synthetic_tokens=True``.
Synthetic chains are contiguous by construction::

    prompt[0]   = frame(instructions, tools, input items, env items before run 0) + HEADER
    prompt[k]   = prompt[k-1] + generation[k-1] + frame(env items between runs) + HEADER
    generation  = text_ids(text of the run's items) + [IM_END]

``frame(item)`` is ``[IM_START, role id] + text_ids(item text) + [IM_END]`` and ``HEADER`` is
``[IM_START, role id of "assistant"]`` (a chat-template look-alike).  ``text_ids`` hashes
each 4-character chunk of the text with BLAKE2b (so equal text gives equal ids, roughly one
id per 4 characters like a real tokenizer) and keeps at most :data:`MAX_ITEM_TOKENS` ids per
item.  Text ids lie in ``[0, SYNTHETIC_VOCAB)``, special ids just above it, all ``< 2**31``.
Synthetic log probs are ``-0.01 * (1 + id % 7)``.  A synthetic call that follows a real call
extends the real call's arrays, so the chain stays contiguous at that step too.

Sharing.  Item dicts are shared between the ``request_items`` of successive calls (a
91-call rollout would otherwise hold ~N^2 copies); treat every returned item as read-only.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence


try:  # msgspec is a declared dependency; fall back to json so this module stays stdlib-only.
    import msgspec as _msgspec

    _decode_line: Callable[[bytes | str], Any] = _msgspec.json.Decoder().decode
    _DecodeError: tuple[type[BaseException], ...] = (_msgspec.DecodeError,)
except ImportError:  # pragma: no cover - exercised only without msgspec
    _decode_line = json.loads
    _DecodeError = (ValueError,)

__all__ = [
    "ReplayCall",
    "ReplayRollout",
    "load_rollouts",
    "iter_rollouts",
    "synthetic_rollouts",
    "is_model_authored",
    "TOKEN_KEYS",
    "SYNTHETIC_VOCAB",
    "MAX_ITEM_TOKENS",
]

#: Keys carrying per-call token metadata; stripped from every returned item.
TOKEN_KEYS = frozenset({"prompt_token_ids", "generation_token_ids", "generation_log_probs", "routed_experts"})

#: Synthetic text ids are drawn from ``[0, SYNTHETIC_VOCAB)``; special ids sit just above.
SYNTHETIC_VOCAB = 150_000
#: At most this many text ids are derived for one item (or one run's generation).
MAX_ITEM_TOKENS = 4096
_CHARS_PER_TOKEN = 4

_IM_START = SYNTHETIC_VOCAB + 1
_IM_END = SYNTHETIC_VOCAB + 2
_ROLE_BASE = SYNTHETIC_VOCAB + 16
_ROLE_SLOTS = 64

_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
#: A replayed rollout id is at most this many characters (all of them key-safe), so that the
#: suffixes added to it still fit S3's 255-byte key segment: the demo's ``@<run>`` (23 bytes
#: escaped) and a call id's ``-cNNNNN``. A longer id keeps its first characters and ends in
#: ``-h`` and 16 hex digits of its SHA-256, so ids stay distinct and deterministic.
MAX_REPLAY_ID_CHARS = 200


@dataclass(frozen=True)
class ReplayCall:
    """One model call of a rollout, ready to be replayed."""

    model_call_id: str
    """Deterministic: ``f"{rollout_id}-c{index:04d}"``."""
    index: int
    """0-based position of the call in its rollout."""
    request_items: list[dict]
    """The request sent for this call: input items plus every output item before this call's run."""
    output_items: list[dict]
    """This call's run of model-authored items, token arrays stripped."""
    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    synthetic_tokens: bool
    """True when the ids were derived because the file's arrays were absent or empty."""


@dataclass(frozen=True)
class ReplayRollout:
    """One rollout (one JSONL line) as an ordered list of model calls."""

    rollout_id: str
    """Deterministic from file stem + line number (+ ``_ng_task_index``/``_ng_rollout_index``);
    at most ``MAX_REPLAY_ID_CHARS`` characters (a longer one ends in a hash of the whole)."""
    source: str
    """``"file.jsonl:LINE"`` (1-based line number)."""
    calls: list[ReplayCall]


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


def load_rollouts(paths: Sequence[str | os.PathLike]) -> list[ReplayRollout]:
    """Load every rollout of the given JSONL files, in order.

    A directory stands for its ``*.jsonl`` files in sorted name order.  A single path (not in
    a list) is accepted too.  Raises ``ValueError`` on malformed lines and on duplicate rollout
    ids (e.g. the same file given twice, or two files with the same stem).
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    rollouts: list[ReplayRollout] = []
    seen: dict[str, str] = {}
    for path in _expand_paths(paths):
        for rollout in iter_rollouts(path):
            previous = seen.get(rollout.rollout_id)
            if previous is not None:
                raise ValueError(
                    f"duplicate rollout id {rollout.rollout_id!r} ({previous} and {rollout.source}); "
                    "rollout ids are built from the file stem, so load each file once and keep stems distinct"
                )
            seen[rollout.rollout_id] = rollout.source
            rollouts.append(rollout)
    return rollouts


def iter_rollouts(path: str | os.PathLike) -> Iterator[ReplayRollout]:
    """Stream the rollouts of one JSONL file, decoding one line at a time.

    Blank lines are skipped (line numbers still count them).  Raises ``ValueError`` naming
    ``file:LINE`` for a line that is not a rollout object.
    """
    path = Path(path)
    stem = _ID_UNSAFE.sub("_", path.stem) or "rollouts"
    with path.open("rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            if line_number == 1:
                if raw.startswith(b"\x1f\x8b"):
                    raise ValueError(
                        f"{path.name}: gzip-compressed; decompress it first (gunzip -c {path.name} > FILE.jsonl)"
                    )
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark, as some editors write
            if not raw.strip():
                continue
            source = f"{path.name}:{line_number}"
            try:
                record = _decode_line(raw)
            except _DecodeError as error:
                raise ValueError(f"{source}: invalid JSON: {error}") from error
            yield _rollout_from_record(record, stem=stem, line_number=line_number, source=source)


def _expand_paths(paths: Iterable[str | os.PathLike]) -> Iterator[Path]:
    for entry in paths:
        entry = Path(entry)
        if entry.is_dir():
            yield from sorted(p for p in entry.iterdir() if p.suffix == ".jsonl" and p.is_file())
        else:
            yield entry


def _rollout_id(stem: str, line_number: int, record: dict) -> str:
    parts = [stem, f"L{line_number}"]
    for key, tag in (("_ng_task_index", "t"), ("_ng_rollout_index", "r")):
        value = record.get(key)
        if value is not None and not isinstance(value, (dict, list)):
            parts.append(f"{tag}{value}")
    rollout_id = _ID_UNSAFE.sub("_", "-".join(parts))
    if len(rollout_id) > MAX_REPLAY_ID_CHARS:
        digest = hashlib.sha256(rollout_id.encode()).hexdigest()[:16]
        rollout_id = f"{rollout_id[: MAX_REPLAY_ID_CHARS - 18]}-h{digest}"
    return rollout_id


def _rollout_from_record(record: Any, *, stem: str, line_number: int, source: str) -> ReplayRollout:
    if not isinstance(record, dict):
        raise ValueError(f"{source}: a rollout line must be a JSON object, got {type(record).__name__}")
    params = record.get("responses_create_params")
    response = record.get("response")
    if not isinstance(params, dict) or "input" not in params:
        raise ValueError(f"{source}: missing responses_create_params.input")
    if not isinstance(response, dict) or not isinstance(response.get("output"), list):
        raise ValueError(f"{source}: missing response.output list")
    input_items = _normalize_input(params["input"], source=source)
    output = response["output"]
    for position, item in enumerate(output):
        if not isinstance(item, dict):
            raise ValueError(f"{source}: response.output[{position}] is not an object")
    rollout_id = _rollout_id(stem, line_number, record)
    prefix: list[dict] = []
    prompt_instructions = params.get("instructions")
    if isinstance(prompt_instructions, str) and prompt_instructions:
        prefix.append({"role": "system", "content": prompt_instructions, "type": "message"})
    tools = params.get("tools")
    if tools:
        prefix.append({"type": "tools", "tools": tools})
    calls = _build_calls(rollout_id, input_items, output, synthetic_prefix=prefix, source=source)
    return ReplayRollout(rollout_id=rollout_id, source=source, calls=calls)


def _normalize_input(value: Any, *, source: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value, "type": "message"}]
    if not isinstance(value, list):
        raise ValueError(f"{source}: responses_create_params.input must be a list or a string")
    items: list[dict] = []
    for position, item in enumerate(value):
        if not isinstance(item, dict):
            raise ValueError(f"{source}: responses_create_params.input[{position}] is not an object")
        items.append(_strip_tokens(item))
    return items


def is_model_authored(item: dict) -> bool:
    """Whether a Responses item was produced by the model (reasoning, assistant message, function call)."""
    item_type = item.get("type")
    if item_type is None and item.get("role") is not None:
        item_type = "message"  # easy-input message shape, as Gym's converter treats it
    if item_type in ("reasoning", "function_call"):
        return True
    return item_type == "message" and item.get("role") == "assistant"


def _strip_tokens(item: dict) -> dict:
    if TOKEN_KEYS.isdisjoint(item):
        return item
    return {key: value for key, value in item.items() if key not in TOKEN_KEYS}


def _real_arrays(run: list[dict], source: str, start: int) -> tuple[list[int], list[int], list[float]] | None:
    """The arrays of the run's last token-bearing item, or None when absent/empty.

    Raises ``ValueError`` naming ``file:LINE: response.output[i]`` (``source``; ``start``: the run's
    first position in ``response.output``) for arrays a token
    entry cannot hold (what ``put`` would refuse only after the servers started): token ids that are
    not integers from 0 to 2**64 - 1, log probabilities that are missing, not finite numbers, or not
    one per generated token.
    """
    for offset, item in enumerate(reversed(run)):
        prompt = item.get("prompt_token_ids")
        generation = item.get("generation_token_ids")
        if isinstance(prompt, list) and isinstance(generation, list) and prompt and generation:
            at = f"{source}: response.output[{start + len(run) - 1 - offset}]"
            _check_token_ids(prompt, f"{at}.prompt_token_ids")
            _check_token_ids(generation, f"{at}.generation_token_ids")
            log_probs = item.get("generation_log_probs")
            if not isinstance(log_probs, list) or len(log_probs) != len(generation):
                got = (
                    f"{len(log_probs)} of them"
                    if isinstance(log_probs, list)
                    else ("none" if log_probs is None else type(log_probs).__name__)
                )
                raise ValueError(
                    f"{at}.generation_log_probs: one log probability per generated token needed "
                    f"({len(generation)}), got {got}"
                )
            for index, value in enumerate(log_probs):
                if type(value) not in (int, float) or not math.isfinite(value):
                    raise ValueError(f"{at}.generation_log_probs[{index}] is {value!r}, not a finite number")
            return list(prompt), list(generation), list(log_probs)
    return None


def _check_token_ids(ids: list, where: str) -> None:
    if all(type(x) is int for x in ids) and min(ids) >= 0 and max(ids) < 2**64:
        return
    bad = next((i, x) for i, x in enumerate(ids) if type(x) is not int or not 0 <= x < 2**64)
    raise ValueError(f"{where}[{bad[0]}] is {bad[1]!r}: token ids are integers from 0 to 2**64 - 1")


def _build_calls(
    rollout_id: str, input_items: list[dict], output: list[dict], *, synthetic_prefix: list[dict], source: str = "?"
) -> list[ReplayCall]:
    # Split response.output into runs of model-authored items and the environment items before each.
    calls: list[ReplayCall] = []
    history: list[dict] = list(input_items)  # request so far, token keys stripped
    pending_env: list[dict] = list(synthetic_prefix) + list(input_items)  # not yet framed into tokens
    cumulative: list[int] = []  # previous prompt + previous generation
    position = 0
    while position < len(output):
        if not is_model_authored(output[position]):
            item = _strip_tokens(output[position])
            history.append(item)
            pending_env.append(item)
            position += 1
            continue
        end = position
        while end < len(output) and is_model_authored(output[end]):
            end += 1
        run = output[position:end]
        output_items = [_strip_tokens(item) for item in run]
        index = len(calls)
        real = _real_arrays(run, source, position)
        if real is not None:
            prompt, generation, log_probs = real
            synthetic = False
        else:
            prompt = cumulative + _frame_items(pending_env) + _HEADER
            generation = _text_ids(_run_text(output_items), MAX_ITEM_TOKENS) + [_IM_END]
            log_probs = [_synthetic_log_prob(token) for token in generation]
            synthetic = True
        calls.append(
            ReplayCall(
                model_call_id=f"{rollout_id}-c{index:04d}",
                index=index,
                request_items=list(history),
                output_items=output_items,
                prompt_token_ids=prompt,
                generation_token_ids=generation,
                generation_log_probs=log_probs,
                synthetic_tokens=synthetic,
            )
        )
        history.extend(output_items)
        pending_env = []
        cumulative = prompt + generation
        position = end
    return calls


# ---------------------------------------------------------------------------
# Synthetic token derivation
# ---------------------------------------------------------------------------


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for block in content:
            if isinstance(block, str):
                parts.append(block)
            elif isinstance(block, dict) and isinstance(block.get("text"), str):
                parts.append(block["text"])
            elif isinstance(block, dict) and isinstance(block.get("refusal"), str):
                parts.append(block["refusal"])
            else:
                parts.append(_canonical_json(block))
        return "\n".join(parts)
    return _canonical_json(content)


def _item_text(item: dict) -> str:
    """The text a chat template would render for one item (roughly)."""
    item_type = item.get("type") or ("message" if item.get("role") else None)
    if item_type == "message":
        return _content_text(item.get("content"))
    if item_type == "function_call":
        return f"{item.get('name', '')}\n{_content_text(item.get('arguments'))}"
    if item_type == "function_call_output":
        return _content_text(item.get("output"))
    if item_type == "reasoning":
        texts = [_content_text(item.get("summary")), _content_text(item.get("content"))]
        return "\n".join(text for text in texts if text)
    return _canonical_json(_strip_tokens(item))


def _run_text(items: list[dict]) -> str:
    return "\n".join(_item_text(item) for item in items)


@functools.lru_cache(maxsize=1 << 16)
def _chunk_id(chunk: str) -> int:
    digest = hashlib.blake2b(chunk.encode("utf-8"), digest_size=8, person=b"s3cap-tok").digest()
    return int.from_bytes(digest, "little") % SYNTHETIC_VOCAB


def _text_ids(text: str, cap: int) -> list[int]:
    """About one id per 4 characters, each a hash of its chunk; at most ``cap`` ids."""
    count = min(cap, math.ceil(len(text) / _CHARS_PER_TOKEN))
    return [_chunk_id(text[i * _CHARS_PER_TOKEN : (i + 1) * _CHARS_PER_TOKEN]) for i in range(count)]


def _role_id(role: str) -> int:
    digest = hashlib.blake2b(role.encode("utf-8"), digest_size=8, person=b"s3cap-role").digest()
    return _ROLE_BASE + int.from_bytes(digest, "little") % _ROLE_SLOTS


_HEADER = [_IM_START, _role_id("assistant")]


def _frame_items(items: list[dict]) -> list[int]:
    ids: list[int] = []
    for item in items:
        role = str(item.get("role") or item.get("type") or "item")
        ids.append(_IM_START)
        ids.append(_role_id(role))
        ids.extend(_text_ids(_item_text(item), MAX_ITEM_TOKENS))
        ids.append(_IM_END)
    return ids


def _synthetic_log_prob(token: int) -> float:
    return -0.01 * (1 + token % 7)


# ---------------------------------------------------------------------------
# Purely synthetic workloads
# ---------------------------------------------------------------------------

_WORDS = (
    "alpha beta gamma delta epsilon zeta theta lambda sigma omega vector tensor shard bucket "
    "object token rollout policy reward gradient batch epoch kernel cache prefix suffix chunk "
    "stream commit ledger replay verify digest manifest lineage parent child"
).split()


def synthetic_rollouts(
    n_rollouts: int,
    calls_per_rollout: int,
    *,
    seed: int = 0,
    prompt_len: int = 64,
    gen_len: int = 32,
) -> list[ReplayRollout]:
    """Generate deterministic multi-turn chat rollouts with contiguous token chains.

    Each rollout starts with a user message.  Every call emits an assistant message
    (``output_text`` content); non-final calls sometimes also emit a ``function_call``, answered
    by a ``function_call_output`` from the environment, otherwise the environment replies with a
    user message.  Call 0's prompt has ``prompt_len`` ids, each generation ``gen_len`` ids, and
    each environment turn adds ``max(1, gen_len // 2)`` ids, so call ``k``'s prompt is
    ``prompt_len + k * (gen_len + max(1, gen_len // 2))`` ids long.  Same arguments, same result.
    """
    if n_rollouts < 0:
        raise ValueError("n_rollouts must be >= 0")
    if calls_per_rollout < 1:
        raise ValueError("calls_per_rollout must be >= 1")
    if prompt_len < 1 or gen_len < 1:
        raise ValueError("prompt_len and gen_len must be >= 1")
    rng = random.Random(f"s3capture.replay.synthetic:{seed}")
    env_len = max(1, gen_len // 2)

    def words(n: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    def ids(n: int) -> list[int]:
        return [rng.randrange(SYNTHETIC_VOCAB) for _ in range(n)]

    rollouts: list[ReplayRollout] = []
    for r in range(n_rollouts):
        rollout_id = _ID_UNSAFE.sub("_", f"synthetic-s{seed}-r{r:05d}")
        history: list[dict] = [
            {"role": "user", "content": f"Task {r}: {words(8)}?", "type": "message"},
        ]
        cumulative: list[int] = []
        next_env: list[int] = ids(prompt_len)
        calls: list[ReplayCall] = []
        for k in range(calls_per_rollout):
            last = k == calls_per_rollout - 1
            output_items: list[dict] = [
                {
                    "id": f"msg-{rollout_id}-{k}",
                    "content": [{"annotations": [], "text": words(6), "type": "output_text", "logprobs": None}],
                    "role": "assistant",
                    "status": "completed",
                    "type": "message",
                }
            ]
            tool_call = not last and rng.random() < 0.5
            call_id = f"call-{rollout_id}-{k}"
            if tool_call:
                output_items.append(
                    {
                        "arguments": json.dumps({"query": words(3)}),
                        "call_id": call_id,
                        "name": rng.choice(("search", "read_file", "terminal")),
                        "type": "function_call",
                        "id": call_id,
                        "status": "completed",
                    }
                )
            prompt = cumulative + next_env
            generation = ids(gen_len)
            log_probs = [-round(0.001 + 2.0 * rng.random() ** 3, 6) for _ in generation]
            calls.append(
                ReplayCall(
                    model_call_id=f"{rollout_id}-c{k:04d}",
                    index=k,
                    request_items=list(history),
                    output_items=output_items,
                    prompt_token_ids=prompt,
                    generation_token_ids=generation,
                    generation_log_probs=log_probs,
                    synthetic_tokens=True,
                )
            )
            history.extend(output_items)
            cumulative = prompt + generation
            if not last:
                if tool_call:
                    env_item = {
                        "call_id": call_id,
                        "output": json.dumps({"result": words(5)}),
                        "type": "function_call_output",
                        "status": "completed",
                    }
                else:
                    env_item = {"role": "user", "content": words(7), "type": "message"}
                history.append(env_item)
                next_env = ids(env_len)
        rollouts.append(ReplayRollout(rollout_id=rollout_id, source=f"synthetic-seed{seed}:{r + 1}", calls=calls))
    return rollouts
