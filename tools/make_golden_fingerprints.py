#!/usr/bin/env python3
"""Regenerate ``tests/golden/fingerprints.json`` from NeMo Gym's own hashing functions.

The golden file lets ``tests/test_fingerprint.py`` check s3capture's native (Gym-free)
``native_assistant_fingerprint``, ``native_conversation_digest``, ``canonicalize_tool_arguments`` and
``records.compute_digest`` where ``nemo_gym`` is not installed. Every expected value is computed
here by Gym 0.7.0 (``nemo_gym.token_id_capture.fingerprint`` / ``records``), never by s3capture.

Inputs: a fixed, diverse set of hand-written message lists (Chat, Responses and Anthropic shapes,
tool calls and results, content blocks, float/unicode/non-JSON tool arguments, malformed items
that Gym refuses) plus the first request prefixes of the Gym example rollouts in
``/work/shared/data/gym-example-rollouts/anyterminal_hermes.jsonl`` (long strings truncated so the
file stays small).

Usage (needs ``pydantic``, ``orjson`` and ``nemo-gym==0.7.0`` installed with ``--no-deps``)::

    python tools/make_golden_fingerprints.py [--rollouts PATH] [--out tests/golden/fingerprints.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ROLLOUTS = Path("/work/shared/data/gym-example-rollouts/anyterminal_hermes.jsonl")
DEFAULT_OUT = ROOT / "tests" / "golden" / "fingerprints.json"
MAX_STRING = 600  # characters kept of any string taken from the example rollouts
ROLLOUT_LINES = 2  # example rollouts used
PREFIXES_PER_ROLLOUT = 4  # request prefixes taken from each


def _user(text: Any) -> dict:
    return {"role": "user", "content": text}


def _assistant(content: Any, **extra: Any) -> dict:
    return {"role": "assistant", "content": content, **extra}


def _chat_call(call_id: str, name: str, arguments: Any) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _fc(call_id: str, name: str, arguments: Any, **extra: Any) -> dict:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments, **extra}


def _fco(call_id: str, output: Any) -> dict:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def _resp_msg(role: str, text: str, kind: str = "output_text") -> dict:
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


def handwritten_cases() -> list[tuple[str, Any]]:
    """(name, messages) pairs; messages must be JSON-representable (the golden file is JSON)."""
    return [
        ("empty", []),
        ("user_only", [_user("hello")]),
        ("chat_simple", [_user("hi"), _assistant("hello there")]),
        ("chat_empty_string_content", [_user(""), _assistant(""), _user("x")]),
        ("chat_none_content", [_user("q"), _assistant(None, tool_calls=[_chat_call("c1", "f", "{}")])]),
        (
            "system_and_developer",
            [{"role": "system", "content": "be nice"}, {"role": "developer", "content": "rules"}, _user("q")],
        ),
        ("unicode_text", [_user("héllo wörld ✓ 漢字 😀"), _assistant("réponse — ok \u2028 \u0000 end")]),
        (
            "chat_tool_calls_and_tool_result",
            [
                _user("weather?"),
                _assistant("", tool_calls=[_chat_call("call_1", "get_weather", '{"city": "Paris", "units": "c"}')]),
                {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"},
                _assistant("It is 18C."),
            ],
        ),
        (
            "chat_tool_result_list_content",
            [
                _assistant(None, tool_calls=[_chat_call("t", "ls", "{}")]),
                {"role": "tool", "tool_call_id": "t", "content": [{"type": "text", "text": "a.txt"}]},
            ],
        ),
        (
            "chat_tool_args_reordered_whitespace",
            [
                _assistant(
                    None, tool_calls=[_chat_call("c", "f", '{ "b" : 2,\n "a": [1, 2.5, {"z": null, "y": true}] }')]
                )
            ],
        ),
        (
            "tool_args_float_exponents",
            [
                _assistant(
                    None,
                    tool_calls=[
                        _chat_call(
                            "c",
                            "f",
                            '{"big": 1e16, "bigger": 1.5e300, "small": 1e-7, "neg": -2.5E-5, "x": 1e15, "y": 123456789012345678901234.0}',
                        )
                    ],
                )
            ],
        ),
        (
            "tool_args_unicode_keys_nested",
            [
                _fc(
                    "fc1",
                    "edit",
                    '{"ключ": {"日本": [1, {"é": 0.1, "a": "😀"}], "Z": -0.0}, "A": {"b": {"c": {"d": []}}}}',
                )
            ],
        ),
        ("tool_args_non_json_string", [_fc("fc1", "shell", "  ls -la /tmp  \n")]),
        ("tool_args_empty_string", [_fc("fc1", "noop", "")]),
        (
            "tool_args_json_scalar",
            [_fc("a", "f", "42"), _fc("b", "g", '"text"'), _fc("c", "h", "null"), _fc("d", "k", "true")],
        ),
        ("tool_args_nan_literal", [_fc("a", "f", '{"v": NaN, "w": Infinity, "u": -Infinity}')]),
        ("tool_args_dict_not_string", [_fc("a", "f", {"b": 1, "a": [2.0, 1e16]})]),
        ("tool_args_none", [_fc("a", "f", None)]),
        ("tool_args_u64_edge", [_fc("a", "f", '{"max": 18446744073709551615, "min": -9223372036854775808}')]),
        ("tool_args_65_bit_int_refused", [_fc("a", "f", '{"n": 18446744073709551616}')]),
        ("tool_args_negative_65_bit_int_refused", [_fc("a", "f", "[-9223372036854775809]")]),
        # The same out-of-range integers next to a float (Gym refuses these too).
        ("tool_args_65_bit_int_before_float_refused", [_fc("a", "f", '{"n": 18446744073709551616, "x": 1.5}')]),
        ("tool_args_nested_65_bit_int_before_float_refused", [_fc("a", "f", "[[-9223372036854775809], 0.5]")]),
        (
            "responses_turn",
            [
                _resp_msg("user", "list files", "input_text"),
                {
                    "type": "reasoning",
                    "summary": [{"type": "summary_text", "text": "I should call ls"}],
                    "encrypted_content": "abc",
                },
                _fc("call_a", "ls", '{"path": "/"}', id="fc_1", status="completed"),
                _fco("call_a", "bin\netc\n"),
                _resp_msg("assistant", "Done."),
            ],
        ),
        ("function_call_namespace", [_fc("c", "read", "{}", namespace="fs"), _fc("d", "read", "{}")]),
        ("function_call_id_fallback", [{"type": "function_call", "id": "fc_9", "name": "x", "arguments": "{}"}]),
        (
            "function_call_output_structured",
            [_fco("c", [{"type": "input_text", "text": "out"}, {"k": 1.25}]), _fco("d", None)],
        ),
        ("reasoning_only", [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]}]),
        (
            "content_blocks_mixed",
            [
                {
                    "role": "user",
                    "content": [
                        "plain string block",
                        "",
                        {"type": "input_text", "text": "typed"},
                        {"text": "untyped text block"},
                        {"type": "text", "text": ""},
                        {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "auto"},
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"}},
                        {"type": "text", "text": None, "extra": 1.0},
                    ],
                },
                _assistant([{"type": "output_text", "text": "seen", "annotations": [], "logprobs": None}]),
            ],
        ),
        (
            "anthropic_tool_use_and_result",
            [
                _user([{"type": "text", "text": "what's 2+2"}]),
                _assistant(
                    [
                        {"type": "text", "text": "Let me compute."},
                        {"type": "tool_use", "id": "tu_1", "name": "calc", "input": {"expr": "2+2", "prec": 0.5}},
                    ]
                ),
                _user(
                    [
                        {"type": "tool_result", "tool_use_id": "tu_1", "content": "4"},
                        {"type": "tool_result", "id": "tu_2", "content": [{"type": "text", "text": "x"}]},
                    ]
                ),
                _assistant([{"type": "text", "text": "4"}]),
            ],
        ),
        (
            "anthropic_thinking_block",
            [
                _assistant(
                    [{"type": "thinking", "thinking": "hmm", "signature": "sig"}, {"type": "text", "text": "answer"}]
                )
            ],
        ),
        (
            "chat_and_responses_tool_call_same_call",
            [_assistant(None, tool_calls=[_chat_call("c1", "f", '{"a":1}')]), _fc("c1", "f", '{"a": 1}')],
        ),
        ("tool_call_missing_fields", [_assistant("x", tool_calls=[{}, {"function": {}}, {"id": "only-id"}])]),
        ("role_missing_type_message", [{"type": "message", "content": "no role"}, {"content": "nothing"}]),
        (
            "numeric_ids",
            [
                {"type": "function_call", "call_id": 17, "name": 3, "arguments": "{}"},
                {"type": "function_call_output", "call_id": 17, "output": 5},
            ],
        ),
        ("lone_surrogate_in_args_refused", [_fc("a", "f", '{"s": "\\ud800"}')]),
        ("malformed_item_string", [_user("ok"), "not a dict"]),
        ("malformed_item_null", [None]),
        ("malformed_content_int", [_user(5)]),
        ("malformed_content_object", [_assistant({"text": "dict content"})]),
        ("malformed_block_int", [_assistant(["ok", 3])]),
        ("malformed_block_without_type", [_user([{"image_url": "x"}])]),
    ]


def _truncate(value: Any) -> Any:
    if isinstance(value, str):
        return value if len(value) <= MAX_STRING else value[:MAX_STRING] + "…[truncated]"
    if isinstance(value, list):
        return [_truncate(v) for v in value]
    if isinstance(value, dict):
        return {k: _truncate(v) for k, v in value.items()}
    return value


def rollout_prefix_cases(path: Path) -> list[tuple[str, Any]]:
    """Request prefixes of the first rollouts: the input plus the output items before each model turn."""
    cases: list[tuple[str, Any]] = []
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle):
            if line_no >= ROLLOUT_LINES:
                break
            record = json.loads(line)
            request = record["responses_create_params"]["input"]
            output = record["response"]["output"]
            starts = [
                i for i, item in enumerate(output) if item.get("type") == "message" and item.get("role") == "assistant"
            ]
            for turn, cut in enumerate(starts[:PREFIXES_PER_ROLLOUT]):
                items = _truncate(list(request) + list(output[:cut]))
                cases.append((f"{path.stem}[{line_no}].call{turn}", items))
    return cases


def _outcome(fn: Any, value: Any) -> dict:
    try:
        return {"value": fn(value)}
    except Exception as error:  # noqa: BLE001 - record the refusal; the test expects the same class
        return {"error": "ValueError" if isinstance(error, ValueError) else type(error).__name__}


TOKEN_VECTORS = [
    [],
    [0],
    [1],
    [1, 2, 3],
    [3, 2, 1],
    [2**32],
    [2**63],
    [2**64 - 1],
    list(range(50)),
    [151643, 872, 198, 9707, 0, 2**31 - 1],
]
ARGUMENT_VECTORS = [
    None,
    "",
    "   padded   ",
    "{}",
    '{"b":1,"a":2}',
    '{"x": 1e16, "y": 1e-7, "z": 12.5, "w": 1E+2}',
    '{"é": "ü", "a": ["😀", null, false]}',
    "not json {",
    "[1, 2.0, -0.0]",
    {"b": [1.5, {"d": None}], "a": "s"},
    [1, "two", 3.25e20],
]


def build(rollouts: Path) -> dict:
    from importlib.metadata import version

    from nemo_gym.token_id_capture import fingerprint as gym_fp
    from nemo_gym.token_id_capture import records as gym_records

    cases = handwritten_cases() + (rollout_prefix_cases(rollouts) if rollouts.exists() else [])
    if not rollouts.exists():
        print(f"warning: {rollouts} not found; golden file has hand-written cases only", file=sys.stderr)
    names = [name for name, _ in cases]
    assert len(names) == len(set(names)), "duplicate case names"
    fingerprints = []
    for name, messages in cases:
        fingerprints.append(
            {
                "name": name,
                "messages": messages,
                "assistant_fingerprint": _outcome(gym_fp.assistant_fingerprint, messages),
                "conversation_digest": _outcome(gym_fp.conversation_digest, messages),
            }
        )
    return {
        "comment": "Generated by tools/make_golden_fingerprints.py from NeMo Gym; do not edit by hand.",
        "nemo_gym_version": version("nemo-gym"),
        "fingerprint_version": gym_fp.FINGERPRINT_VERSION,
        "fingerprints": fingerprints,
        "tool_arguments": [
            {"input": value, "canonical": _outcome(gym_fp.canonicalize_tool_arguments, value)}
            for value in ARGUMENT_VECTORS
        ],
        "token_digests": [{"tokens": tokens, "digest": gym_records.compute_digest(tokens)} for tokens in TOKEN_VECTORS],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=Path, default=DEFAULT_ROLLOUTS)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    golden = build(args.rollouts)
    text = json.dumps(golden, indent=1, ensure_ascii=True, allow_nan=False) + "\n"
    os.makedirs(args.out.parent, exist_ok=True)
    args.out.write_text(text, encoding="ascii")
    print(f"wrote {args.out} ({len(text.encode())} bytes, {len(golden['fingerprints'])} message lists)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
