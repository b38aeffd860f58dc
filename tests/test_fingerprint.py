"""Continuation fingerprints: s3capture's native port against NeMo Gym (no S3).

Two layers of proof that ``native_assistant_fingerprint`` / ``native_conversation_digest`` compute
Gym's FINGERPRINT_VERSION 2 hashes:

* a differential hypothesis test against ``nemo_gym.token_id_capture.fingerprint`` over generated
  Chat / Responses / Anthropic message lists (needs Gym: ``require_gym()``), including that both
  refuse the same malformed inputs;
* golden vectors in ``tests/golden/fingerprints.json`` (written by
  ``tools/make_golden_fingerprints.py`` from Gym's own functions), checked without Gym.

Hypothesis settings: ``deadline=None``, ``max_examples`` 150-300; each property runs in a few
seconds on a 2-core machine.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from gymcompat import require_gym, running_under_ci
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from s3capture import fingerprint as fp
from s3capture.records import TokenEntry, compute_digest


@pytest.fixture(scope="module")
def gym() -> Any:
    """``nemo_gym.token_id_capture`` via ``require_gym()``, resolved before hypothesis starts drawing."""
    return require_gym()


GOLDEN = Path(__file__).parent / "golden" / "fingerprints.json"
ROOT = Path(__file__).resolve().parent.parent
# The shared example data sits beside the checkout: <checkout>/../shared/data/gym-example-rollouts.
from helpers import EXAMPLE_DATA  # noqa: E402

EXAMPLE_ROLLOUTS = EXAMPLE_DATA

PROPERTY = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)

# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------
#
# Integers stay inside orjson's range [-2**63, 2**64 - 1] wherever a float can sit in the same
# value: the native canonical JSON misses out-of-range integers and non-string keys that follow a
# float (see test_out_of_range_content_after_a_float_is_refused_like_gym). Out-of-range integers
# are generated only in float-free argument strings, where both implementations refuse them.

SPECIAL_FLOATS = [
    1e16,
    1e17,
    1e21,
    1e22,
    1.5e300,
    1e-7,
    1e-5,
    1e-4,
    2.5e-5,
    5e-324,
    -0.0,
    0.1,
    1e15,
    123456789012345678.0,
    2.0**63,
    2.0**64,
]
floats = st.one_of(
    st.sampled_from(SPECIAL_FLOATS).flatmap(lambda x: st.sampled_from([x, -x])),
    st.floats(allow_nan=False, allow_infinity=False),
)
in_range_ints = st.one_of(st.integers(-1000, 1000), st.integers(-(2**63), 2**64 - 1))
unicode_text = st.text(max_size=10)
surrogate_text = st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=2)
# Mostly valid text; now and then a lone surrogate (no UTF-8 form: both implementations refuse it).
any_text = st.integers(0, 39).flatmap(lambda n: surrogate_text if n == 0 else unicode_text)
keys = st.one_of(unicode_text, st.sampled_from(["a", "B", "é", "日本", "😀", "ｚ", "", "type", "text"]))

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), in_range_ints, floats, unicode_text),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=4)),
    max_leaves=10,
)


@st.composite
def argument_values(draw: Any) -> Any:
    """Tool-call arguments: JSON strings (re-serialized, hand-written exponents), non-JSON strings, objects."""
    kind = draw(st.integers(0, 24))
    if kind > 8:  # weight: mostly well-formed JSON argument strings
        kind = 0 if kind < 20 else 6 if kind < 22 else 3
    if kind <= 2:
        value = draw(json_values)
        indent = draw(st.sampled_from([None, 0, 2]))
        separators = draw(st.sampled_from([None, (",", ":"), (" , ", " : ")]))
        return json.dumps(value, indent=indent, separators=separators, ensure_ascii=draw(st.booleans()))
    if kind == 3:  # numbers spelled the way JSON allows but Python never writes
        number = draw(
            st.sampled_from(
                [
                    "1e16",
                    "1E16",
                    "1e+16",
                    "1e-7",
                    "-2.5E-5",
                    "1.0e0",
                    "0e0",
                    "1e400",
                    "-1e400",
                    "12345678901234567890",
                    "-0",
                    "0.0",
                    "1E+2",
                ]
            )
        )
        key = draw(keys)
        return draw(st.sampled_from(["{{{k}: {n}}}", "[{n}, {{{k}: [{n}]}}]", "{n}", "  {{ {k} :\n {n} }}  "])).format(
            k=json.dumps(key), n=number
        )
    if kind == 4:  # out-of-range integers, float-free: both implementations refuse
        return draw(
            st.sampled_from(['{"n": 18446744073709551616}', "[-9223372036854775809]", "99999999999999999999999"])
        )
    if kind == 5:  # not JSON at all (kept stripped), or a JSON literal Python accepts
        return draw(
            st.one_of(any_text, st.sampled_from(["  ls -la  ", "{", "NaN", '{"a": Infinity}', "[1,]", "", "   "]))
        )
    if kind == 6:
        return draw(st.dictionaries(keys, json_values, max_size=3))
    if kind == 7:
        return draw(st.none() | st.lists(json_values, max_size=3) | in_range_ints | floats)
    # Escapes that decode to lone surrogates: valid JSON, refused by both (no UTF-8 form).
    return draw(st.sampled_from(['{"s": "\\ud800"}', '["\\udfff", 1.5]', '{"\\ud83d": 1}', '"\\ud83d\\ude00"']))


ids = st.one_of(st.none(), st.just(""), unicode_text, st.integers(0, 99))
text_block_types = st.sampled_from(["text", "input_text", "output_text", ""])


@st.composite
def content_blocks(draw: Any, allow_tools: bool) -> Any:
    kind = draw(st.integers(0, 9 if allow_tools else 7))
    if kind == 0:
        return draw(any_text)
    if kind in (1, 2):
        block = {"type": draw(text_block_types), "text": draw(any_text)}
        if draw(st.booleans()):
            block["annotations"] = []
            block["logprobs"] = None
        return block
    if kind == 3:
        return {"text": draw(unicode_text)}  # untyped text block
    if kind == 4:
        return draw(
            st.sampled_from(
                [
                    {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "auto"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}},
                    {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "low"}},
                    {"type": "input_file", "file_id": "f-1"},
                ]
            )
        )
    if kind == 5:  # a typed block with arbitrary (JSON) extra fields, or a non-str text
        block = {"type": draw(st.sampled_from(["text", "output_text", "refusal", "custom", "thinking"]))}
        block.update(draw(st.dictionaries(keys, json_values, max_size=3)))
        if draw(st.booleans()):
            block["text"] = draw(st.one_of(st.none(), in_range_ints, floats, st.lists(in_range_ints, max_size=2)))
        return block
    if kind == 6:
        return {"type": "thinking", "thinking": draw(unicode_text), "signature": "sig"}
    if kind == 7:
        return {"type": "redacted_thinking", "data": draw(unicode_text)}
    if kind == 8:
        block = {
            "type": "tool_use",
            "name": draw(unicode_text),
            "input": draw(st.one_of(st.dictionaries(keys, json_values, max_size=3), argument_values())),
        }
        if draw(st.booleans()):
            block["id"] = draw(ids)
        return block
    block = {
        "type": "tool_result",
        "content": draw(st.one_of(any_text, st.lists(content_blocks(False), max_size=2), json_values)),
    }
    block[draw(st.sampled_from(["tool_use_id", "id", "other"]))] = draw(ids)
    return block


def contents(allow_tools: bool = True) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), any_text, st.lists(content_blocks(allow_tools), max_size=4))


@st.composite
def chat_tool_calls(draw: Any) -> list:
    calls = []
    for _ in range(draw(st.integers(0, 3))):
        call: dict[str, Any] = {
            "type": "function",
            "function": {"name": draw(unicode_text), "arguments": draw(argument_values())},
        }
        if draw(st.booleans()):
            call["id"] = draw(ids)
        if draw(st.integers(0, 9)) == 0:
            call["function"] = draw(st.sampled_from([None, {}, {"name": "only"}]))
        calls.append(call)
    return calls


@st.composite
def items(draw: Any) -> Any:
    kind = draw(st.integers(0, 10))
    if kind == 0:
        return {"role": draw(st.sampled_from(["user", "system", "developer"])), "content": draw(contents())}
    if kind in (1, 2):
        item: dict[str, Any] = {"role": "assistant", "content": draw(contents())}
        if draw(st.booleans()):
            item["tool_calls"] = draw(chat_tool_calls())
        if draw(st.booleans()):
            item["type"] = "message"
        return item
    if kind == 3:
        item = {
            "role": "tool",
            "content": draw(st.one_of(any_text, st.lists(content_blocks(False), max_size=2), json_values)),
        }
        if draw(st.booleans()):
            item["tool_call_id"] = draw(ids)
        return item
    if kind == 4:
        role = draw(st.sampled_from(["user", "assistant", "system"]))
        return {"type": "message", "role": role, "content": draw(st.lists(content_blocks(True), max_size=3))}
    if kind in (5, 6):
        item = {"type": "function_call", "name": draw(unicode_text), "arguments": draw(argument_values())}
        for key in ("call_id", "id", "namespace", "status"):
            if draw(st.booleans()):
                item[key] = draw(ids if key != "namespace" else st.one_of(st.none(), st.just(""), unicode_text))
        return item
    if kind == 7:
        item = {
            "type": "function_call_output",
            "output": draw(st.one_of(any_text, json_values, st.lists(content_blocks(False), max_size=2))),
        }
        item[draw(st.sampled_from(["call_id", "id"]))] = draw(ids)
        return item
    if kind == 8:
        item = {"type": "reasoning", "summary": [{"type": "summary_text", "text": draw(unicode_text)}]}
        if draw(st.booleans()):
            item["encrypted_content"] = draw(unicode_text)
        if draw(st.booleans()):
            item["content"] = draw(contents(False))
        return item
    if kind == 9:  # Anthropic-style turns (tool_use in assistant content, tool_result in user content)
        return {
            "role": draw(st.sampled_from(["assistant", "user"])),
            "content": draw(st.lists(content_blocks(True), min_size=1, max_size=4)),
        }
    return {"type": draw(st.sampled_from(["message", "item_reference", "custom"])), "content": draw(contents())}


@st.composite
def malformed(draw: Any) -> Any:
    """Something Gym refuses (or chokes on) somewhere in a message list."""
    return draw(
        st.sampled_from(
            [
                "a string item",
                5,
                None,
                ["nested", "list"],
                {"role": "user", "content": 5},
                {"role": "user", "content": 1.5},
                {"role": "assistant", "content": {"text": "dict"}},
                {"role": "user", "content": [3]},
                {"role": "user", "content": [None]},
                {"role": "user", "content": [["x"]]},
                {"role": "assistant", "content": [{"image_url": "x"}]},
                {"role": "user", "content": [{"type": None, "text": None}]},
                {"role": "assistant", "content": None, "tool_calls": ["not-a-dict"]},
                {"role": "assistant", "content": None, "tool_calls": [{"function": "not-a-dict"}]},
                {"role": "assistant", "content": None, "tool_calls": 5},
                {"role": "tool", "content": "lone \ud800 surrogate"},
            ]
        )
    )


message_lists = st.lists(items(), max_size=6)


@st.composite
def maybe_malformed_lists(draw: Any) -> list:
    messages = draw(message_lists)
    if draw(st.integers(0, 4)) == 0:
        messages.insert(draw(st.integers(0, len(messages))), draw(malformed()))
    return messages


def _outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        return ("ok", fn(*args))
    except ValueError:  # includes UnicodeEncodeError: both refuse content with no UTF-8/JSON form
        return ("error", "ValueError")
    except Exception as error:  # noqa: BLE001 - any other failure must be the same class on both sides
        return ("error", type(error).__name__)


# ---------------------------------------------------------------------------------------------
# Differential tests against Gym
# ---------------------------------------------------------------------------------------------


@PROPERTY
@given(maybe_malformed_lists())
def test_native_matches_gym_over_generated_message_lists(gym: Any, messages: list) -> None:
    from nemo_gym.token_id_capture import fingerprint as gym_fp

    assert fp.FINGERPRINT_VERSION == gym_fp.FINGERPRINT_VERSION
    assert _outcome(fp.native_assistant_fingerprint, messages) == _outcome(gym_fp.assistant_fingerprint, messages)
    assert _outcome(fp.native_conversation_digest, messages) == _outcome(gym_fp.conversation_digest, messages)
    assert gym.assistant_fingerprint is gym_fp.assistant_fingerprint


@settings(max_examples=300, deadline=None)
@given(argument_values())
def test_canonicalize_tool_arguments_matches_gym(gym: Any, value: Any) -> None:
    from nemo_gym.token_id_capture import fingerprint as gym_fp

    assert _outcome(fp.canonicalize_tool_arguments, value) == _outcome(gym_fp.canonicalize_tool_arguments, value)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_canonical_json_is_sorted_orjson(value: Any) -> None:
    try:
        expected = ("ok", orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode())
    except (TypeError, orjson.JSONEncodeError):
        expected = ("error", "ValueError")
    assert _outcome(fp.canonical_json, value) == expected


@pytest.mark.parametrize(
    "messages",
    [
        [{"type": "function_call", "call_id": "a", "name": "f", "arguments": '{"n": 18446744073709551616, "x": 1.5}'}],
        [{"type": "function_call", "call_id": "a", "name": "f", "arguments": "[[-9223372036854775809], 0.5]"}],
        [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"n": 2**70, "x": 0.5}}],
            }
        ],
        [{"role": "assistant", "content": [{"type": "image", "meta": {1: "x"}, "w": 1.5}]}],
        [{"role": "assistant", "content": [{"type": "image", "data": b"raw", "w": 1.5}]}],
    ],
    ids=["u64_overflow_json_args", "i64_underflow_nested", "tool_use_input_big_int", "int_key_block", "bytes_block"],
)
def test_out_of_range_content_after_a_float_is_refused_like_gym(messages: list) -> None:
    """Gym raises ValueError for content orjson cannot encode; the native port must refuse it too."""
    assert _outcome(fp.native_assistant_fingerprint, messages) == ("error", "ValueError")
    assert _outcome(fp.native_conversation_digest, messages) == ("error", "ValueError")


def test_out_of_range_content_without_a_float_is_refused() -> None:
    """The same contents without a float: the native port refuses them (so the bug above is order-only)."""
    for messages in (
        [{"type": "function_call", "call_id": "a", "name": "f", "arguments": '{"n": 18446744073709551616}'}],
        [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"n": 2**70}}]}],
        [{"role": "assistant", "content": [{"type": "image", "meta": {1: "x"}}]}],
    ):
        with pytest.raises(ValueError):
            fp.native_assistant_fingerprint(messages)
        with pytest.raises(ValueError):
            fp.native_conversation_digest(messages)


def test_embedded_functions_are_gyms_when_gym_is_importable() -> None:
    require_gym()
    from nemo_gym.token_id_capture import fingerprint as gym_fp

    assert fp.USING_GYM is True
    assert fp.assistant_fingerprint is gym_fp.assistant_fingerprint
    assert fp.conversation_digest is gym_fp.conversation_digest


def test_native_functions_are_used_without_gym() -> None:
    """In a process where ``nemo_gym`` cannot be imported, the module falls back to the native port."""
    code = (
        "import sys; sys.modules['nemo_gym'] = None\n"
        "from s3capture import fingerprint as fp\n"
        "assert fp.USING_GYM is False\n"
        "assert fp.assistant_fingerprint is fp.native_assistant_fingerprint\n"
        "assert fp.conversation_digest is fp.native_conversation_digest\n"
        "print(fp.assistant_fingerprint([{'role': 'assistant', 'content': 'x'}]))\n"
    )
    assert _run_snippet(code) == fp.native_assistant_fingerprint([{"role": "assistant", "content": "x"}])


def test_gym_is_imported_on_first_use_of_the_matcher_not_by_the_store() -> None:
    """Importing the store or the export does not import Gym (half a second of CPU per process); the
    first use of the matcher, by attribute or by ``stamp_continuation``, binds Gym's functions."""
    require_gym()
    code = (
        "import sys\n"
        "import s3capture.store, s3capture.export, s3capture.cli\n"
        "assert 'nemo_gym' not in sys.modules, 'imported early'\n"
        "from s3capture import fingerprint as fp\n"
        "from s3capture.records import TokenEntry\n"
        "entry = TokenEntry(rollout_id='r', model_call_id='c', prompt_token_ids=[1], generation_token_ids=[2],"
        " generation_log_probs=[-0.5], output_items=[{'role': 'assistant', 'content': 'x'}])\n"
        "fp.stamp_continuation(entry, [{'role': 'user', 'content': 'q'}])\n"
        "assert 'nemo_gym' in sys.modules and fp.USING_GYM is True\n"
        "from nemo_gym.token_id_capture import fingerprint as gym\n"
        "assert fp.assistant_fingerprint is gym.assistant_fingerprint\n"
        "print(entry.continuation_fingerprint)\n"
    )
    printed = _run_snippet(code)
    expected = fp.native_assistant_fingerprint(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}]
    )
    assert printed == expected


def _run_snippet(code: str) -> str:
    """Run ``code`` in a fresh interpreter with this checkout's src on the path; its stripped stdout."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def _env() -> dict:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(message_lists, st.lists(items(), max_size=3))
def test_stamp_continuation_matches_gym(gym: Any, request_items: list, output_items: list) -> None:
    output_items = [item for item in output_items if isinstance(item, dict)]
    ours = TokenEntry(
        rollout_id="r",
        model_call_id="c",
        prompt_token_ids=[],
        generation_token_ids=[],
        generation_log_probs=[],
        output_items=output_items,
    )
    theirs = gym.TokenEntry(
        rollout_id="r",
        model_call_id="c",
        prompt_token_ids=[],
        generation_token_ids=[],
        generation_log_probs=[],
        output_items=output_items,
    )
    ours_outcome = _outcome(fp.stamp_continuation, ours, request_items)
    theirs_outcome = _outcome(gym.stamp_continuation, theirs, request_items)
    assert ours_outcome[0] == theirs_outcome[0]
    if ours_outcome[0] == "ok":
        for name in (
            "continuation_fingerprint",
            "continuation_context_len",
            "continuation_context_digest",
            "fingerprint_version",
        ):
            assert getattr(ours, name) == getattr(theirs, name), name


# ---------------------------------------------------------------------------------------------
# Properties that need no Gym
# ---------------------------------------------------------------------------------------------


def test_fingerprint_properties_without_gym() -> None:
    user = {"role": "user", "content": "hi"}
    assistant = {"role": "assistant", "content": "hello"}
    f = fp.native_assistant_fingerprint
    d = fp.native_conversation_digest
    assert f([]) == "" and f([user]) == "" and f(None) == ""  # no model-authored item
    assert f([{"type": "reasoning", "summary": []}]) == ""  # reasoning is not model-authored content
    assert len(f([assistant])) == 64
    assert f([user, assistant]) == f([assistant])  # user content is not in the fingerprint
    assert d([user, assistant]) != d([assistant])  # but it is in the context digest
    assert f([assistant, assistant]) != f([assistant])
    # Dialects normalize: a string, a text block and an output_text block hash alike.
    assert f([{"role": "assistant", "content": [{"type": "output_text", "text": "hello"}]}]) == f([assistant])
    # Re-serialized tool arguments match; different arguments do not.
    call = lambda args: {"type": "function_call", "call_id": "c", "name": "f", "arguments": args}  # noqa: E731
    assert f([call('{"a": 1, "b": [1.0, 2]}')]) == f([call('{"b":[1.0,2],"a":1}')])
    assert f([call('{"a": 1}')]) != f([call('{"a": 2}')])
    assert f([call("{}") | {"namespace": "fs"}]) != f([call("{}")])
    # Field boundaries are length-delimited: moving text between fields changes the hash.
    assert f([{"role": "assistant", "content": ["ab", "c"]}]) != f([{"role": "assistant", "content": ["a", "bc"]}])
    # Tool results are part of the context digest only.
    tool = lambda out: {"type": "function_call_output", "call_id": "c", "output": out}  # noqa: E731
    assert f([call("{}"), tool("x")]) == f([call("{}"), tool("y")])
    assert d([call("{}"), tool("x")]) != d([call("{}"), tool("y")])
    with pytest.raises(ValueError):
        f(["not an item"])
    with pytest.raises(ValueError):
        d([{"role": "user", "content": 5}])


# ---------------------------------------------------------------------------------------------
# Golden vectors (no Gym needed)
# ---------------------------------------------------------------------------------------------


def _golden() -> dict:
    return json.loads(GOLDEN.read_text(encoding="ascii"))


GOLDEN_BUGS: dict[str, str] = {}


def _golden_params() -> list:
    params = []
    for case in _golden()["fingerprints"]:
        marks = (
            [pytest.mark.xfail(strict=True, raises=AssertionError, reason=GOLDEN_BUGS[case["name"]])]
            if case["name"] in GOLDEN_BUGS
            else []
        )
        params.append(pytest.param(case, id=case["name"], marks=marks))
    return params


def _expected(outcome: dict) -> tuple[str, Any]:
    return ("ok", outcome["value"]) if "value" in outcome else ("error", outcome["error"])


def test_golden_file_is_small_diverse_and_current() -> None:
    golden = _golden()
    assert GOLDEN.stat().st_size < 200_000
    assert golden["fingerprint_version"] == fp.FINGERPRINT_VERSION
    names = [case["name"] for case in golden["fingerprints"]]
    assert len(names) >= 40 and len(set(names)) == len(names)
    assert any(name.startswith("anyterminal_hermes") for name in names)
    outcomes = [case["assistant_fingerprint"] for case in golden["fingerprints"]]
    assert sum("error" in o for o in outcomes) >= 5 and sum(o.get("value") == "" for o in outcomes) >= 3
    assert len({o["value"] for o in outcomes if o.get("value")}) >= 25
    assert golden["token_digests"] and golden["tool_arguments"]


@pytest.mark.parametrize("case", _golden_params())
def test_native_functions_match_golden_vectors(case: dict) -> None:
    messages = case["messages"]
    assert _outcome(fp.native_assistant_fingerprint, messages) == _expected(case["assistant_fingerprint"])
    assert _outcome(fp.native_conversation_digest, messages) == _expected(case["conversation_digest"])


def test_native_canonicalize_tool_arguments_matches_golden() -> None:
    for vector in _golden()["tool_arguments"]:
        assert _outcome(fp.canonicalize_tool_arguments, vector["input"]) == _expected(vector["canonical"]), vector


def test_compute_digest_matches_golden() -> None:
    for vector in _golden()["token_digests"]:
        assert compute_digest(vector["tokens"]) == vector["digest"], vector["tokens"]


def test_golden_vectors_still_match_gym() -> None:
    """Guards against a stale golden file: regenerate with tools/make_golden_fingerprints.py."""
    gym = require_gym()
    from nemo_gym.token_id_capture import fingerprint as gym_fp

    golden = _golden()
    for case in golden["fingerprints"]:
        assert _outcome(gym_fp.assistant_fingerprint, case["messages"]) == _expected(case["assistant_fingerprint"]), (
            case["name"]
        )
        assert _outcome(gym_fp.conversation_digest, case["messages"]) == _expected(case["conversation_digest"]), case[
            "name"
        ]
    for vector in golden["token_digests"]:
        assert gym.compute_digest(vector["tokens"]) == vector["digest"]


def test_golden_tool_regenerates_the_same_file(tmp_path: Path) -> None:
    require_gym()
    rollouts = EXAMPLE_ROLLOUTS / "anyterminal_hermes.jsonl"
    if not rollouts.exists():
        message = f"{rollouts} (the source of the rollout-prefix vectors; ../shared beside the checkout, or S3CAPTURE_EXAMPLE_DATA) is not available"
        if running_under_ci():
            pytest.fail(f"{message}; CI must provide it", pytrace=False)
        pytest.skip(message)
    out = tmp_path / "fingerprints.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "make_golden_fingerprints.py"),
            "--rollouts",
            str(rollouts),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text()) == _golden()


def test_golden_token_digests_follow_the_documented_layout() -> None:
    """Independent of both implementations: sha256(domain + version byte + u64 length + u64 ids)."""
    import struct

    for vector in _golden()["token_digests"]:
        tokens = vector["tokens"]
        body = b"" if not tokens else struct.pack(">BQ", 1, len(tokens)) + struct.pack(f">{len(tokens)}Q", *tokens)
        assert hashlib.sha256(b"nemo-gym-tokens" + body).hexdigest() == vector["digest"]
