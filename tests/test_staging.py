"""Staging digests (``s3capture.staging``): equal to NeMo Gym's, values and refusals (no S3).

* Gym's published conformance vector and a few values computed by nemo-gym 0.7.0, checked without
  Gym;
* differential hypothesis tests against ``nemo_gym.token_id_capture.staging.digest`` (``require_gym()``:
  skipped without Gym, failing under ``CI``): every function returns the same digest, or raises the
  same exception type with the same message, on valid and on mutated inputs;
* ``stage_call``/``call_record`` build records Gym's ``StagedCallRecord`` and ``CallRecord`` accept,
  and Gym's ``verify_and_linearize`` rebuilds a staged chain from them.

Hypothesis settings: ``deadline=None`` (first calls import pydantic models), ``max_examples`` 150-300.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
from gymcompat import require_gym
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from s3capture import staging as ours
from s3capture.ledger_records import to_wire
from s3capture.protocols import LineageMatch

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
U64_MAX = 2**64 - 1


@pytest.fixture(scope="module")
def gym() -> Any:
    """``nemo_gym.token_id_capture.staging.digest`` via ``require_gym()``, resolved before hypothesis draws."""
    require_gym()
    from nemo_gym.token_id_capture.staging import digest

    return digest


def outcome(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple:
    """``("ok", value)`` or ``("error", exception type name, message)``."""
    try:
        return ("ok", fn(*args, **kwargs))
    except Exception as error:  # noqa: BLE001 - the comparison is the point
        return ("error", type(error).__name__, str(error))


# ---------------------------------------------------------------------------------------------
# Known values (no Gym needed)
# ---------------------------------------------------------------------------------------------

# nemo_gym/token_id_capture/staging/conformance/golden_vectors.json of nemo-gym 0.7.0 (Apache-2.0).
GYM_GOLDEN = {
    "extras": {"routed_experts": [[[1, 2]], [[3, 4]]]},
    "extras_digest": "032024e899456be6e9a78c6d0399c5112d2ca7fa18d4ea9cf0d8cb7d0094f3a3",
    "staged_call": {
        "schema_version": 2,
        "digest_version": 2,
        "extras_digest_version": 1,
        "rollout_id": "rollout-1",
        "model_call_id": "call-1",
        "parent_call_id": "parent-1",
        "mode": "token_in",
        "prev_len": 3,
        "delta_len": 2,
        "cum_len": 5,
        "weight_version": 7,
        "token_ids_delta": [10, 11],
        "token_mask_delta": [0.0, 1.0],
        "generation_log_probs_delta": [0.0, -0.25],
        "extras_digest": "032024e899456be6e9a78c6d0399c5112d2ca7fa18d4ea9cf0d8cb7d0094f3a3",
        "chain_hash": "1" * 64,
        "cumulative_hash": "2" * 64,
    },
    "staged_call_digest": "1122c7fe7e914c809eb9b1c09b26d94a50c1eb2790e7430fbcd8363b846ccf27",
}


def test_gym_published_golden_vector() -> None:
    assert ours.compute_extras_digest(GYM_GOLDEN["extras"]) == GYM_GOLDEN["extras_digest"]
    assert ours.compute_staging_digest(**GYM_GOLDEN["staged_call"]) == GYM_GOLDEN["staged_call_digest"]


def test_values_computed_by_gym() -> None:
    # Computed with nemo-gym 0.7.0's staging.digest functions.
    assert ours.hash_token_ids([]) == "17088fc6f8fd317bf02bd83e106f7ca2dfb7b9cfc63927c2387d4c87f29578ef"
    assert ours.hash_token_ids([0, 1, U64_MAX]) == "cc04ed6ae369fa90e74616ba6a6bf81277ff788804acc6f152272e5a69267755"
    assert (
        ours.compute_chain_hash(None, [5, 6, 7]) == "ebccb4279798822b793da7a290af5d7b17b559fd8c900c1c0b8ff8152c99161a"
    )
    assert ours.compute_chain_hash("ab" * 32, [8]) == "4c3f1a387404de81e12ce0d43f1419c6e94e0158e33cd38cc4462706292d0f6d"
    assert ours.EMPTY_EXTRAS_DIGEST == "a1edc33c107616cf344faf0103daa025cfb125f8e1c784ae5f6a49faf2b768b6"
    assert ours.compute_extras_digest({"b": [1, 2.5, None, True, "x"], "a": {}}) == (
        "349820900a6ea86f256d2fd90209771e9bd59fb75c3dec287adb5d7ee6184b2f"
    )


def test_constants_match_gym(gym: Any) -> None:
    for name in ("STAGING_SCHEMA_VERSION", "STAGING_DIGEST_VERSION", "EXTRAS_DIGEST_VERSION", "EMPTY_EXTRAS_DIGEST"):
        assert getattr(ours, name) == getattr(gym, name), name


# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------

token_ids = st.integers(0, 2**17) | st.integers(0, U64_MAX)
bad_token = st.sampled_from([-1, 2**64, True, False, 1.0, "1", None, 2**70, -(2**63)])
token_lists = st.lists(token_ids, max_size=40)
maybe_bad_token_lists = token_lists | st.lists(token_ids | bad_token, min_size=1, max_size=10)
digests = st.text("0123456789abcdef", min_size=64, max_size=64)
bad_digests = st.sampled_from(["", "A" * 64, "a" * 63, "a" * 65, "g" * 64, "a" * 63 + "\n", None, 5, b"a" * 64])
# Valid log probs (float32-representable; Gym refuses the rest, which ``weird_floats`` covers).
logprobs = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False) | st.floats(min_value=-1e30, max_value=1e30)
weird_floats = (
    st.sampled_from(
        [
            math.nan,
            math.inf,
            -math.inf,
            1e39,
            -3.5e38,
            3.4028235677973366e38,
            3.4028234663852886e38,
            1e-46,
            0,
            1,
            True,
            None,
            "0.0",
        ]
    )
    | st.floats()
)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
extras_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20,
)
bad_extras_leaves = st.sampled_from([math.nan, math.inf, 2**63, -(2**63) - 1, (1, 2), b"x", {1: "a"}, {1.5}])
maybe_bad_extras = st.recursive(
    json_scalars | bad_extras_leaves,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=10,
)


@st.composite
def staging_fields(draw: Any) -> dict:
    """Valid ``compute_staging_digest`` keyword arguments (root or child)."""
    child = draw(st.booleans())
    prompt_len = draw(st.integers(0, 8))
    gen = draw(st.lists(logprobs, max_size=8))
    if prompt_len + len(gen) == 0:
        gen = [-0.5]
    tokens = draw(st.lists(token_ids, min_size=prompt_len + len(gen), max_size=prompt_len + len(gen)))
    prev_len = draw(st.integers(1, 10_000)) if child else 0
    return dict(
        schema_version=2,
        digest_version=2,
        extras_digest_version=1,
        rollout_id=draw(st.text(min_size=1, max_size=12)),
        model_call_id=draw(st.text(min_size=1, max_size=12)),
        parent_call_id=draw(st.text(min_size=1, max_size=12)) if child else None,
        mode="token_in" if child else "text",
        prev_len=prev_len,
        delta_len=len(tokens),
        cum_len=prev_len + len(tokens),
        weight_version=draw(st.integers(0, 2**40)),
        token_ids_delta=tokens,
        token_mask_delta=[0.0] * prompt_len + [1.0] * len(gen),
        generation_log_probs_delta=[0.0] * prompt_len + gen,
        extras_digest=draw(digests | st.just(ours.EMPTY_EXTRAS_DIGEST)),
        chain_hash=draw(digests),
        cumulative_hash=draw(digests),
    )


junk = (
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.sampled_from([2**64, 2**64 - 1, 1.0, 2.0, "", "x", "text", "token_in", [], [1.0], [0.5], [-1], [True]])
    | digests
    | bad_digests
    | st.lists(token_ids | bad_token, max_size=3)
    | st.lists(st.sampled_from([0.0, 1.0]) | weird_floats, max_size=3)
)


# ---------------------------------------------------------------------------------------------
# Differential tests against Gym
# ---------------------------------------------------------------------------------------------


@SETTINGS
@given(maybe_bad_token_lists)
def test_token_hashes_equal_gym(gym: Any, tokens: list) -> None:
    assert outcome(ours.encode_token_ids, tokens) == outcome(gym.encode_token_ids, tokens)
    assert outcome(ours.hash_token_ids, tokens) == outcome(gym.hash_token_ids, tokens)
    assert outcome(ours.hash_token_ids, tuple(tokens)) == outcome(gym.hash_token_ids, tuple(tokens))


@SETTINGS
@given(st.none() | digests | bad_digests, maybe_bad_token_lists)
def test_chain_hash_equals_gym(gym: Any, parent: Any, tokens: list) -> None:
    assert outcome(ours.compute_chain_hash, parent, tokens) == outcome(gym.compute_chain_hash, parent, tokens)


@SETTINGS
@given(st.none() | st.dictionaries(st.text(max_size=6), extras_values, max_size=5))
def test_extras_digest_equals_gym(gym: Any, extras: Any) -> None:
    assert outcome(ours.compute_extras_digest, extras) == outcome(gym.compute_extras_digest, extras)


@SETTINGS
@given(maybe_bad_extras | st.dictionaries(st.text(max_size=4) | st.integers(0, 3), maybe_bad_extras, max_size=3))
def test_extras_digest_refusals_equal_gym(gym: Any, extras: Any) -> None:
    assert outcome(ours.compute_extras_digest, extras) == outcome(gym.compute_extras_digest, extras)


@SETTINGS
@given(staging_fields())
def test_staging_digest_equals_gym(gym: Any, fields: dict) -> None:
    got = outcome(ours.compute_staging_digest, **fields)
    assert got[0] == "ok", got
    assert got == outcome(gym.compute_staging_digest, **fields)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(staging_fields(), st.data())
def test_staging_digest_refusals_equal_gym(gym: Any, fields: dict, data: Any) -> None:
    for name in data.draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=2, unique=True)):
        if name in ("token_mask_delta", "generation_log_probs_delta") and fields[name] and data.draw(st.booleans()):
            values = list(fields[name])
            values[data.draw(st.integers(0, len(values) - 1))] = data.draw(weird_floats | logprobs)
            fields[name] = values
        else:
            fields[name] = data.draw(junk)
    assert outcome(ours.compute_staging_digest, **fields) == outcome(gym.compute_staging_digest, **fields)


@SETTINGS
@given(
    st.lists(token_ids, max_size=10),
    st.lists(token_ids, max_size=6),
    st.lists(logprobs | weird_floats, max_size=6),
    st.integers(-2, 12),
)
def test_build_staging_delta_equals_gym(
    gym: Any, prompt: list, generated: list, log_probs: list, prev_len: int
) -> None:
    if len(log_probs) > len(generated) and log_probs[0] == log_probs[0]:
        log_probs = log_probs[: len(generated)]  # mostly equal lengths; NaN first keeps a mismatch
    kwargs = dict(
        prompt_token_ids=prompt, generated_token_ids=generated, generated_log_probs=log_probs, prev_len=prev_len
    )
    ours_out, gym_out = outcome(ours.build_staging_delta, **kwargs), outcome(gym.build_staging_delta, **kwargs)
    assert repr(ours_out) == repr(gym_out)  # repr: NaN != NaN in a plain comparison


# ---------------------------------------------------------------------------------------------
# stage_call / call_record against Gym's models
# ---------------------------------------------------------------------------------------------


def _match(staged: ours.StagedCall, chain: tuple[str, ...]) -> LineageMatch:
    """What ``S3CaptureLedger.resolve`` returns for ``staged`` as the parent."""
    return LineageMatch(
        model_call_id=staged.model_call_id,
        cumulative_token_ids=(),
        digest=staged.cumulative_hash,
        staging_chain=chain,
        prev_len=staged.cum_len,
        chain_hash=staged.chain_hash,
    )


@st.composite
def conversations(draw: Any) -> list[tuple[list[int], list[int], list[float]]]:
    """A contiguous chain of calls: (full prompt, generation, log probs), each prompt extending the last."""
    calls = []
    cumulative: list[int] = []
    for _ in range(draw(st.integers(1, 4))):
        prompt = cumulative + draw(st.lists(token_ids, min_size=0 if cumulative else 1, max_size=6))
        generation = draw(st.lists(token_ids, min_size=1, max_size=6))
        log_probs = draw(st.lists(logprobs, min_size=len(generation), max_size=len(generation)))
        calls.append((prompt, generation, log_probs))
        cumulative = prompt + generation
    return calls


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations(), st.none() | st.dictionaries(st.text(max_size=5), extras_values, max_size=3), st.integers(0, 99))
def test_stage_call_chain_validates_and_linearizes_with_gym(
    gym: Any, calls: list, extras: Any, weight_version: int
) -> None:
    from nemo_gym.token_id_capture.staging import records as gym_records
    from nemo_gym.token_id_capture.staging.rebuild import verify_and_linearize

    staged_calls, rows = [], []
    parent, chain = None, ()
    for index, (prompt, generation, log_probs) in enumerate(calls):
        staged = ours.stage_call(
            rollout_id="r-1",
            model_call_id=f"c{index}",
            prompt_token_ids=prompt,
            generation_token_ids=generation,
            generation_log_probs=log_probs,
            parent=parent,
            weight_version=weight_version,
            extras=extras,
        )
        staged.verify()
        assert ours.StagedCall.decode(staged.encode()) == staged
        gym_staged = gym_records.StagedCallRecord.model_validate(staged.to_wire())  # recomputes both digests
        assert gym_staged.model_dump(mode="json") == staged.to_wire()
        assert staged.staging_key == gym_records.staging_key("r-1", f"c{index}")
        assert staged.cumulative_hash == gym.hash_token_ids(prompt + generation)
        record = ours.call_record(staged, response_id=f"resp-{index}", admitted_at=float(index))
        gym_records.CallRecord.model_validate(to_wire(record))
        staged_calls.append(gym_staged)
        rows.append(gym_records.CallRecord.model_validate(to_wire(record)))
        chain = chain + (staged.staging_key,)
        parent = _match(staged, chain)
    receipt = gym_records.RolloutReceipt(
        rollout_id="r-1", manifest=rows, terminal_model_call_id=rows[-1].model_call_id, terminal_selection="declared"
    )
    row = verify_and_linearize(receipt, staged_calls)
    prompt, generation, log_probs = calls[-1]
    assert row.token_ids == prompt + generation
    assert row.logprobs[len(prompt) :] == log_probs


def test_stage_call_refuses_a_prompt_that_does_not_extend_the_parent() -> None:
    root = ours.stage_call(
        rollout_id="r",
        model_call_id="c0",
        prompt_token_ids=[1, 2],
        generation_token_ids=[3],
        generation_log_probs=[-0.1],
    )
    parent = _match(root, (root.staging_key,))
    for prompt in ([1, 9, 3, 4], [1, 2], []):
        with pytest.raises(ValueError, match="does not begin with the 3 tokens of parent 'c0'"):
            ours.stage_call(
                rollout_id="r",
                model_call_id="c1",
                prompt_token_ids=prompt,
                generation_token_ids=[5],
                generation_log_probs=[-0.2],
                parent=parent,
            )
    child = ours.stage_call(
        rollout_id="r",
        model_call_id="c1",
        prompt_token_ids=[1, 2, 3],
        generation_token_ids=[5],
        generation_log_probs=[-1],
        parent=parent,
    )  # an int log prob is taken as a float
    assert (
        child.token_ids_delta == [5] and child.token_mask_delta == [1.0] and child.generation_log_probs_delta == [-1.0]
    )
    assert child.prev_len == 3 and child.cum_len == 4 and child.mode == "token_in" and child.parent_call_id == "c0"
    assert child.chain_hash == ours.compute_chain_hash(root.chain_hash, [5])
    with pytest.raises(ValueError, match="at least one token"):
        ours.stage_call(
            rollout_id="r", model_call_id="c0", prompt_token_ids=[], generation_token_ids=[], generation_log_probs=[]
        )
    with pytest.raises(ValueError, match="lengths differ"):
        ours.stage_call(
            rollout_id="r", model_call_id="c0", prompt_token_ids=[1], generation_token_ids=[2], generation_log_probs=[]
        )


def test_staged_call_decode_refuses_tampering() -> None:
    staged = ours.stage_call(
        rollout_id="r",
        model_call_id="c0",
        prompt_token_ids=[1, 2],
        generation_token_ids=[3, 4],
        generation_log_probs=[-0.5, -0.25],
        extras={"k": [1]},
    )
    body = staged.encode()
    assert ours.StagedCall.decode(body) == staged
    for old, new in (
        (b"[1,2,3,4]", b"[1,2,3,5]"),
        (b"-0.25", b"-0.5"),
        (b'"k":[1]', b'"k":[2]'),
        (b'"mode":"text"', b'"mode":"tok"'),
    ):
        assert old in body
        with pytest.raises(ValueError):
            ours.StagedCall.decode(body.replace(old, new))
    with pytest.raises(ValueError):
        ours.StagedCall.decode(b'{"rollout_id": "r"}')


def test_call_record_fingerprints_as_gym_external_capture(gym: Any) -> None:
    from nemo_gym.token_id_capture.fingerprint import FINGERPRINT_VERSION, assistant_fingerprint

    staged = ours.stage_call(
        rollout_id="r", model_call_id="c0", prompt_token_ids=[1], generation_token_ids=[2], generation_log_probs=[-0.5]
    )
    request = [{"role": "user", "content": "hi", "type": "message"}]
    response = [{"role": "assistant", "content": [{"type": "output_text", "text": "hello"}], "type": "message"}]
    record = ours.call_record(
        staged,
        response_id="resp-1",
        admitted_at=12.5,
        request_items=request,
        response_items=response,
        staging_key="elsewhere/c0",
    )
    assert record.output_fingerprint == assistant_fingerprint(response)
    assert record.continuation_fingerprint == assistant_fingerprint(request + response)
    assert record.fingerprint_version == FINGERPRINT_VERSION
    assert record.staging_key == "elsewhere/c0" and record.mode == "text" and record.parent_call_id is None
    bare = ours.call_record(staged, response_id="resp-1")
    assert bare.output_fingerprint is None and bare.fingerprint_version == 0 and bare.staging_key == "r/c0"
    with pytest.raises(ValueError):
        ours.call_record(staged, response_id="")


@pytest.mark.parametrize("depth", [400, 900, 2000])
def test_a_staged_record_with_extras_nested_past_the_stack_is_refused_with_value_error(depth: int) -> None:
    """``StagedCall.decode`` of extras nested 400-990 deep raised RecursionError from the extras
    digest (recursive), where its contract is ValueError: one hostile staged object crashed the
    demo's verification, which catches ValueError (a breaker, 2026-12-02). ``stage_call`` with
    such extras raises ValueError too."""
    staged = ours.stage_call(
        rollout_id="r",
        model_call_id="c",
        prompt_token_ids=[1],
        generation_token_ids=[2],
        generation_log_probs=[-0.5],
        extras={"k": "@@"},
    )
    data = staged.encode().replace(b'"@@"', b"[" * depth + b"1" + b"]" * depth)
    with pytest.raises(ValueError):
        ours.StagedCall.decode(data)
    deep: Any = 1
    for _ in range(depth):
        deep = [deep]
    with pytest.raises(ValueError, match="nest too deeply"):
        ours.stage_call(
            rollout_id="r",
            model_call_id="c",
            prompt_token_ids=[1],
            generation_token_ids=[2],
            generation_log_probs=[-0.5],
            extras={"k": deep},
        )
