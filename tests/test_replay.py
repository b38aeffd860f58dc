"""Tests for s3capture.replay against the NeMo Gym example rollout files."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from gymcompat import require_gym, running_under_ci

from s3capture.layout import Layout
from s3capture.replay import (
    TOKEN_KEYS,
    MAX_REPLAY_ID_CHARS,
    ReplayRollout,
    is_model_authored,
    iter_rollouts,
    load_rollouts,
    synthetic_rollouts,
)

# The shared example data sits beside the checkout: <checkout>/../shared/data/gym-example-rollouts.
from helpers import EXAMPLE_DATA

DATA_DIR = EXAMPLE_DATA

ID_RE = re.compile(r"^[A-Za-z0-9._-]+$")


def _require_data(path: Path) -> Path:
    """``path`` (shared example data); skip when it is missing, but fail under ``CI`` like ``require_gym``."""
    if path.exists():
        return path
    message = f"example rollouts not found at {path} (expected ../shared/data/gym-example-rollouts next to the checkout, or S3CAPTURE_EXAMPLE_DATA)"
    if running_under_ci():
        pytest.fail(f"{message}; CI must provide them", pytrace=False)
    pytest.skip(message)


@pytest.fixture
def example_data() -> Path:
    return _require_data(DATA_DIR)


needs_data = pytest.mark.usefixtures("example_data")


def _data(name: str) -> Path:
    return _require_data(DATA_DIR / name)


def _gym_fingerprint():
    """``nemo_gym.token_id_capture.fingerprint``: skip without Gym, fail under ``CI`` (``require_gym``)."""
    require_gym()
    from nemo_gym.token_id_capture import fingerprint

    return fingerprint


def _raw_lines(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _model_authored(item: dict) -> bool:
    # Independent restatement of the rule, so the tests do not just mirror the module.
    kind = item.get("type")
    return kind in ("reasoning", "function_call") or (kind == "message" and item.get("role") == "assistant")


def _runs(output: list[dict]) -> list[list[dict]]:
    runs: list[list[dict]] = []
    previous = False
    for item in output:
        current = _model_authored(item)
        if current:
            if not previous:
                runs.append([])
            runs[-1].append(item)
        previous = current
    return runs


def _assert_contiguous(rollout: ReplayRollout) -> None:
    for k in range(1, len(rollout.calls)):
        before, call = rollout.calls[k - 1], rollout.calls[k]
        cumulative = before.prompt_token_ids + before.generation_token_ids
        assert call.prompt_token_ids[: len(cumulative)] == cumulative, f"{call.model_call_id} breaks the chain"
        assert len(call.prompt_token_ids) > len(cumulative), f"{call.model_call_id} adds no environment tokens"


def _assert_request_chain(rollout: ReplayRollout) -> None:
    for k in range(1, len(rollout.calls)):
        before, call = rollout.calls[k - 1], rollout.calls[k]
        parent = before.request_items + before.output_items
        assert call.request_items[: len(parent)] == parent, f"{call.model_call_id} is not a prefix extension"
        for item in call.request_items[len(parent) :]:
            assert not _model_authored(item), "items between runs must come from the environment"


def _assert_well_formed(rollout: ReplayRollout) -> None:
    assert ID_RE.match(rollout.rollout_id), rollout.rollout_id
    for k, call in enumerate(rollout.calls):
        assert call.index == k
        assert call.model_call_id == f"{rollout.rollout_id}-c{k:04d}"
        assert ID_RE.match(call.model_call_id)
        assert call.output_items and all(_model_authored(item) for item in call.output_items)
        for item in call.request_items + call.output_items:
            assert TOKEN_KEYS.isdisjoint(item), f"token keys left in {call.model_call_id}"
        assert call.prompt_token_ids and call.generation_token_ids
        for token in call.prompt_token_ids + call.generation_token_ids:
            assert type(token) is int and 0 <= token < 2**31
        assert len(call.generation_log_probs) == len(call.generation_token_ids)
        assert all(math.isfinite(value) and value <= 0.0 for value in call.generation_log_probs)
        if call.synthetic_tokens:
            assert all(value < 0.0 for value in call.generation_log_probs)


# ---------------------------------------------------------------------------
# Real files
# ---------------------------------------------------------------------------


@needs_data
def test_competitive_coding_keeps_real_arrays() -> None:
    path = _data("competitive_coding.jsonl")
    raw = _raw_lines(path)
    rollouts = load_rollouts([path])
    assert len(rollouts) == 5
    for rollout, line in zip(rollouts, raw, strict=True):
        _assert_well_formed(rollout)
        assert len(rollout.calls) == 1
        (call,) = rollout.calls
        carrier = next(item for item in line["response"]["output"] if item.get("generation_token_ids"))
        assert call.synthetic_tokens is False
        assert call.prompt_token_ids == carrier["prompt_token_ids"]
        assert call.generation_token_ids == carrier["generation_token_ids"]
        # Bit-exact log probs (msgspec and json must agree on every float).
        assert [v.hex() for v in call.generation_log_probs] == [v.hex() for v in carrier["generation_log_probs"]]
        assert len(call.generation_token_ids) == len(call.generation_log_probs)
        assert len(call.prompt_token_ids) == line["response"]["usage"]["input_tokens"] == 109
        assert len(call.generation_token_ids) == line["response"]["usage"]["output_tokens"]
        assert [item["type"] for item in call.output_items] == ["reasoning", "message"]
        # The input is a plain string in this file.
        assert isinstance(line["responses_create_params"]["input"], str)
        assert call.request_items == [
            {"role": "user", "content": line["responses_create_params"]["input"], "type": "message"}
        ]
    assert [len(r.calls[0].generation_token_ids) for r in rollouts] == [785, 959, 1038, 964, 1277]


@needs_data
def test_anyterminal_hermes_calls_requests_and_synthetic_chains() -> None:
    path = _data("anyterminal_hermes.jsonl")
    raw = _raw_lines(path)
    rollouts = load_rollouts([path])
    assert len(rollouts) == 5
    for rollout, line in zip(rollouts, raw, strict=True):
        runs = _runs(line["response"]["output"])
        assert len(rollout.calls) == len(runs)
        for call, run in zip(rollout.calls, runs, strict=True):
            assert len(call.output_items) == len(run)
            assert call.synthetic_tokens  # the file's arrays are present but empty
        _assert_well_formed(rollout)
        _assert_request_chain(rollout)
        _assert_contiguous(rollout)
        assert rollout.calls[0].request_items == line["responses_create_params"]["input"]
        last = rollout.calls[-1]
        assert last.request_items + last.output_items == (
            line["responses_create_params"]["input"]
            + [{k: v for k, v in item.items() if k not in TOKEN_KEYS} for item in line["response"]["output"]]
        )
    assert [len(r.calls) for r in rollouts] == [7, 14, 18, 17, 91]


@needs_data
def test_hermes_math() -> None:
    path = _data("hermes_math.jsonl")
    raw = _raw_lines(path)
    rollouts = load_rollouts([path])
    assert len(rollouts) == 5
    assert [len(r.calls) for r in rollouts] == [len(_runs(line["response"]["output"])) for line in raw]
    assert [len(r.calls) for r in rollouts] == [1, 1, 1, 1, 4]
    for rollout in rollouts:
        _assert_well_formed(rollout)
        _assert_request_chain(rollout)
        _assert_contiguous(rollout)
        assert all(call.synthetic_tokens for call in rollout.calls)
    tool_rollout = rollouts[4]
    assert [item["type"] for item in tool_rollout.calls[1].request_items[-3:]] == [
        "message",
        "function_call",
        "function_call_output",
    ]


@needs_data
def test_directory_loading_ids_and_sources() -> None:
    rollouts = load_rollouts([DATA_DIR])
    assert len(rollouts) == 15  # three .jsonl files; vllm_round_trip.json is not a rollout file
    ids = [r.rollout_id for r in rollouts]
    assert len(set(ids)) == len(ids)
    call_ids = [c.model_call_id for r in rollouts for c in r.calls]
    assert len(set(call_ids)) == len(call_ids)
    assert rollouts[0].rollout_id == "anyterminal_hermes-L1-t1-r0"
    assert rollouts[0].source == "anyterminal_hermes.jsonl:1"
    with pytest.raises(ValueError, match="duplicate rollout id"):
        load_rollouts([_data("hermes_math.jsonl"), _data("hermes_math.jsonl")])


@needs_data
def test_loading_is_deterministic_and_streaming_matches() -> None:
    first = load_rollouts([DATA_DIR])
    second = load_rollouts([DATA_DIR])
    assert first == second
    streamed = [
        r
        for name in ("anyterminal_hermes", "competitive_coding", "hermes_math")
        for r in iter_rollouts(DATA_DIR / f"{name}.jsonl")
    ]
    assert streamed == first


@needs_data
def test_assistant_fingerprint_finds_parent_in_real_files() -> None:
    fingerprint = _gym_fingerprint()
    failures: list[str] = []
    ambiguous: list[str] = []
    for rollout in load_rollouts([DATA_DIR]):
        for k in range(1, len(rollout.calls)):
            before, call = rollout.calls[k - 1], rollout.calls[k]
            expected = fingerprint.assistant_fingerprint(before.request_items + before.output_items)
            actual = fingerprint.assistant_fingerprint(call.request_items)
            if actual != expected:
                failures.append(call.model_call_id)
            # The parent is only identifiable if its output changed the fingerprint; a run made
            # only of reasoning items would leave it equal to the grandparent's.
            if actual == fingerprint.assistant_fingerprint(before.request_items):
                ambiguous.append(call.model_call_id)
    assert not failures, f"assistant_fingerprint does not link these calls to their parent: {failures}"
    assert not ambiguous, f"parent output invisible to assistant_fingerprint (reasoning-only run?): {ambiguous}"


# ---------------------------------------------------------------------------
# vllm_round_trip.json: real arrays whose chain is not contiguous, and a reasoning-only call
# ---------------------------------------------------------------------------


def _vllm_rollout(tmp_path: Path) -> ReplayRollout:
    payload = json.loads(_data("vllm_round_trip.json").read_text(encoding="utf-8"))
    line = {"responses_create_params": {"input": "hello!"}, "response": {"output": payload["input"]["output"]}}
    path = tmp_path / "vllm_round_trip.jsonl"
    path.write_text(json.dumps(line) + "\n", encoding="utf-8")
    (rollout,) = list(iter_rollouts(path))
    return rollout


@needs_data
def test_real_non_contiguous_arrays_are_kept(tmp_path: Path) -> None:
    rollout = _vllm_rollout(tmp_path)
    first, second = rollout.calls
    assert [item["type"] for item in first.output_items] == [
        "reasoning",
        "function_call",
        "function_call",
        "function_call",
    ]
    assert [item["type"] for item in second.output_items] == ["reasoning"]
    assert not first.synthetic_tokens and not second.synthetic_tokens
    assert (len(first.prompt_token_ids), len(first.generation_token_ids)) == (3088, 495)
    assert (len(second.prompt_token_ids), len(second.generation_token_ids)) == (3637, 207)
    cumulative = first.prompt_token_ids + first.generation_token_ids
    # The chat template re-renders the previous turn without its reasoning text, so the second
    # real prompt diverges right after "<think>" (151667); the arrays are kept, not patched.
    assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
    assert second.prompt_token_ids[: len(cumulative)] != cumulative
    _assert_well_formed(rollout)
    _assert_request_chain(rollout)


@needs_data
def test_reasoning_only_call_is_invisible_to_assistant_fingerprint(tmp_path: Path) -> None:
    """Documents a limitation: assistant_fingerprint ignores reasoning items by design.

    The second call of the vLLM round trip produced only a reasoning item, so a request built
    on top of it has the same fingerprint as the call's own request: a lineage resolver would
    attribute a child of that call to its parent (call 0) instead.
    """
    fingerprint = _gym_fingerprint()
    _, second = _vllm_rollout(tmp_path).calls
    child_request = second.request_items + second.output_items
    assert fingerprint.assistant_fingerprint(child_request) == fingerprint.assistant_fingerprint(second.request_items)
    assert fingerprint.conversation_digest(child_request) != fingerprint.conversation_digest(second.request_items)


# ---------------------------------------------------------------------------
# Crafted lines
# ---------------------------------------------------------------------------


def _message(role: str, text: str, **extra) -> dict:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"role": role, "content": [{"type": kind, "text": text}], "type": "message", **extra}


def _write(tmp_path: Path, name: str, lines: list) -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def test_plain_string_input_and_mixed_real_then_synthetic(tmp_path: Path) -> None:
    real = {
        "prompt_token_ids": [1, 2, 3],
        "generation_token_ids": [7, 8],
        "generation_log_probs": [-0.5, 0.0],
        "routed_experts": "opaque",
    }
    line = {
        "responses_create_params": {"input": "What is 2+2?"},
        "response": {
            "output": [
                {"id": "rs_1", "type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
                {
                    "id": "fc_1",
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "calc",
                    "arguments": '{"x": 1}',
                    **real,
                },
                {"type": "function_call_output", "call_id": "c1", "output": "4"},
                _message(
                    "assistant",
                    "It is 4.",
                    id="m2",
                    prompt_token_ids=[],
                    generation_token_ids=[],
                    generation_log_probs=[],
                ),
                _message("user", "thanks"),  # trailing environment item: belongs to no call
            ]
        },
        "_ng_task_index": 3,
        "_ng_rollout_index": 1,
    }
    path = _write(tmp_path, "my rollouts.jsonl", [line])
    (rollout,) = load_rollouts(path)  # a single path is accepted too
    assert rollout.rollout_id == "my_rollouts-L1-t3-r1"
    assert rollout.source == "my rollouts.jsonl:1"
    first, second = rollout.calls
    assert first.request_items == [{"role": "user", "content": "What is 2+2?", "type": "message"}]
    assert (first.prompt_token_ids, first.generation_token_ids, first.generation_log_probs) == (
        [1, 2, 3],
        [7, 8],
        [-0.5, 0.0],
    )
    assert not first.synthetic_tokens and second.synthetic_tokens
    assert "routed_experts" not in first.output_items[1]
    assert second.prompt_token_ids[:5] == [1, 2, 3, 7, 8]  # synthetic call extends the real one
    assert [item["type"] for item in second.request_items] == [
        "message",
        "reasoning",
        "function_call",
        "function_call_output",
    ]
    _assert_well_formed(rollout)
    _assert_request_chain(rollout)
    _assert_contiguous(rollout)


def test_typeless_assistant_message_is_model_authored(tmp_path: Path) -> None:
    assert is_model_authored({"role": "assistant", "content": "hi"})
    assert not is_model_authored({"role": "user", "content": "hi"})
    assert not is_model_authored({"type": "function_call_output", "call_id": "c", "output": ""})
    line = {
        "responses_create_params": {"input": [{"role": "user", "content": "hi"}]},
        "response": {
            "output": [
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "again"},
                {"role": "assistant", "content": "hello again"},
            ]
        },
    }
    (rollout,) = load_rollouts([_write(tmp_path, "typeless.jsonl", [line])])
    assert len(rollout.calls) == 2
    _assert_contiguous(rollout)


def test_no_model_items_blank_lines_and_errors(tmp_path: Path) -> None:
    empty = {"responses_create_params": {"input": "hi"}, "response": {"output": []}}
    path = tmp_path / "edge.jsonl"
    path.write_text("\n" + json.dumps(empty) + "\n\n", encoding="utf-8")
    (rollout,) = list(iter_rollouts(path))
    assert rollout.calls == [] and rollout.source == "edge.jsonl:2"

    bad = _write(tmp_path, "bad.jsonl", [empty, {"response": {"output": []}}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_rollouts([bad])
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("{not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"garbage\.jsonl:1"):
        load_rollouts([garbage])


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("prompt_token_ids", ["1", 2], "[0] is '1': token ids are integers from 0 to 2**64 - 1"),
        ("prompt_token_ids", [1.5, 2], "[0] is 1.5: token ids are integers"),
        ("generation_token_ids", [5, -1], "[1] is -1: token ids are integers"),
        ("generation_token_ids", [5, 2**64], "[1] is 18446744073709551616: token ids are integers"),
        ("generation_token_ids", [5, True], "[1] is True: token ids are integers"),
        ("generation_log_probs", None, ": one log probability per generated token needed (2), got none"),
        ("generation_log_probs", [-0.5], ": one log probability per generated token needed (2), got 1 of them"),
        ("generation_log_probs", [-0.5, None], "[1] is None, not a finite number"),
        ("generation_log_probs", [-0.5, "NaN"], "[1] is 'NaN', not a finite number"),
    ],
)
def test_token_arrays_a_token_entry_cannot_hold_fail_at_load_naming_file_line_and_field(
    tmp_path: Path, field: str, value, message: str
) -> None:
    """A demo breaker's files with bad token arrays loaded fine and failed only once the servers and
    workers ran, with no file or line named; now the load refuses them like malformed JSON."""
    item = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "a"}],
        "prompt_token_ids": [1, 2],
        "generation_token_ids": [5, 6],
        "generation_log_probs": [-0.5, -0.25],
    }
    good = {"responses_create_params": {"input": "hi"}, "response": {"output": [dict(item)]}}
    if value is None:
        del item[field]
    else:
        item[field] = value
    bad = {"responses_create_params": {"input": "hi"}, "response": {"output": [item]}}
    with pytest.raises(ValueError) as error:
        load_rollouts([_write(tmp_path, "tokens.jsonl", [good, bad])])
    assert str(error.value).startswith(f"tokens.jsonl:2: response.output[0].{field}{message}"), error.value
    (rollout,) = load_rollouts([_write(tmp_path, "fine.jsonl", [good])])
    assert rollout.calls[0].generation_log_probs == [-0.5, -0.25] and not rollout.calls[0].synthetic_tokens


def test_a_byte_order_mark_is_skipped_and_a_gzip_file_is_named(tmp_path: Path) -> None:
    """A demo breaker got "invalid JSON ... (byte 0)" for both, with no hint."""
    import gzip

    line = json.dumps({"responses_create_params": {"input": "hi"}, "response": {"output": []}}) + "\n"
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + line.encode())
    (rollout,) = load_rollouts([bom])
    assert rollout.source == "bom.jsonl:1"
    packed = tmp_path / "packed.jsonl"
    packed.write_bytes(gzip.compress(line.encode()))
    with pytest.raises(ValueError, match=r"^packed\.jsonl: gzip-compressed; decompress it first"):
        load_rollouts([packed])


def test_a_long_rollout_id_is_shortened_so_the_demo_suffix_and_call_ids_still_fit(tmp_path: Path) -> None:
    # Found by a breaker (2026-12-03): ids of 231-255 bytes passed a load check and failed in the
    # demo's workers, after the servers had started, once "@<run>" and "-c0000" were appended.
    def line(task: str) -> dict:
        return {
            "responses_create_params": {"input": "hi"},
            "response": {"output": [{"type": "message", "role": "assistant", "content": "ok"}]},
            "_ng_task_index": task,
        }

    tasks = ["x" * 400, "x" * 399 + "y", "x" * 230, "x" * 10]
    loaded = load_rollouts([_write(tmp_path, "long.jsonl", [line(task) for task in tasks])])
    ids = [rollout.rollout_id for rollout in loaded]
    assert len(set(ids)) == 4, ids  # distinct although their first 182 characters agree
    assert ids[3] == "long-L4-tx" + "x" * 9  # short ids are unchanged
    assert all(len(rollout_id) <= MAX_REPLAY_ID_CHARS for rollout_id in ids)
    assert ids == [rollout.rollout_id for rollout in load_rollouts([tmp_path / "long.jsonl"])]  # deterministic
    layout = Layout("")
    for rollout in loaded:
        demo_id = f"{rollout.rollout_id}@20261203T120000-abcdef"  # the demo's attempt suffix
        prefix = layout.rollout(demo_id, writing=True)
        for call in rollout.calls:
            layout.entry_rel(prefix, "", call.model_call_id, "0" * 64)
        layout.entry_rel(prefix, "", f"{rollout.rollout_id}-c99999", "0" * 64)  # a 100,000-call rollout


def test_synthetic_ids_depend_on_content(tmp_path: Path) -> None:
    def line(answer: str) -> dict:
        return {"responses_create_params": {"input": "q"}, "response": {"output": [_message("assistant", answer)]}}

    a, b, c = load_rollouts([_write(tmp_path, "content.jsonl", [line("x" * 40), line("x" * 40), line("y" * 400)])])
    assert a.calls[0].generation_token_ids == b.calls[0].generation_token_ids
    assert a.calls[0].prompt_token_ids == c.calls[0].prompt_token_ids
    assert len(c.calls[0].generation_token_ids) > len(a.calls[0].generation_token_ids)


# ---------------------------------------------------------------------------
# synthetic_rollouts
# ---------------------------------------------------------------------------


def test_synthetic_rollouts_shape_and_determinism() -> None:
    rollouts = synthetic_rollouts(6, 5, seed=7, prompt_len=40, gen_len=10)
    assert rollouts == synthetic_rollouts(6, 5, seed=7, prompt_len=40, gen_len=10)
    assert rollouts != synthetic_rollouts(6, 5, seed=8, prompt_len=40, gen_len=10)
    assert len(rollouts) == 6
    kinds = set()
    for rollout in rollouts:
        assert len(rollout.calls) == 5
        _assert_well_formed(rollout)
        _assert_request_chain(rollout)
        _assert_contiguous(rollout)
        for k, call in enumerate(rollout.calls):
            assert call.synthetic_tokens
            assert len(call.prompt_token_ids) == 40 + k * (10 + 5)
            assert len(call.generation_token_ids) == 10
            assert call.output_items[0]["role"] == "assistant"
            assert call.output_items[0]["content"][0]["type"] == "output_text"
            kinds.update(item["type"] for item in call.request_items)
        assert [item["type"] for item in rollout.calls[-1].output_items] == ["message"]
    assert {"function_call", "function_call_output"} <= kinds
    ids = [r.rollout_id for r in rollouts] + [r.rollout_id for r in synthetic_rollouts(2, 1, seed=8)]
    assert len(set(ids)) == len(ids)
    assert synthetic_rollouts(0, 3) == []
    with pytest.raises(ValueError):
        synthetic_rollouts(1, 0)


def test_synthetic_rollouts_fingerprint_lineage() -> None:
    fingerprint = _gym_fingerprint()
    for rollout in synthetic_rollouts(3, 4, seed=1):
        for k in range(1, len(rollout.calls)):
            before, call = rollout.calls[k - 1], rollout.calls[k]
            assert fingerprint.assistant_fingerprint(call.request_items) == fingerprint.assistant_fingerprint(
                before.request_items + before.output_items
            )
            assert fingerprint.assistant_fingerprint(call.request_items) != fingerprint.assistant_fingerprint(
                before.request_items
            )
