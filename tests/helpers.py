"""Shared test helpers: entry builders, a request recorder on botocore events, process workers.

Only add functions here; other test files depend on the existing ones.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import zstandard

from s3capture.fingerprint import stamp_continuation
from s3capture.layout import Layout
from s3capture.records import ParentResolutionStatus, TokenEntry, encode_entry, stamp_lineage, store_prompt_as_delta

EXAMPLE_DATA = Path(
    os.environ.get("S3CAPTURE_EXAMPLE_DATA")
    or os.environ.get("S3CAPTURE_BENCH_DATA")
    or Path(__file__).resolve().parents[2] / "shared" / "data" / "gym-example-rollouts"
)
"""The shared NeMo Gym example rollouts the tests replay: ``<checkout>/../shared/data/gym-example-rollouts``
unless ``S3CAPTURE_EXAMPLE_DATA`` (or the tools' ``S3CAPTURE_BENCH_DATA``) names another folder."""

FIXED_CREATED_AT = 1700000000.0
"""A fixed ``created_at`` so that an identical retry re-sends byte-identical payloads."""


# --------------------------------------------------------------------------- messages and entries
def user(text: str) -> dict:
    """A user message item."""
    return {"role": "user", "content": text}


def system(text: str) -> dict:
    """A system message item."""
    return {"role": "system", "content": text}


def assistant_output(text: str) -> list[dict]:
    """The output items of one model call that answered with ``text`` (Responses-API message)."""
    return [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]


def function_call_output(call_id: str, name: str, arguments: str) -> list[dict]:
    """The output items of one model call that emitted a single function call."""
    return [{"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}]


def tool_result(call_id: str, output: str) -> dict:
    """A Responses-API tool result item answering ``call_id``."""
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def make_entry(
    rollout_id: str,
    model_call_id: str,
    request_items: list[dict],
    output_items: list[dict],
    prompt: list[int],
    generation: list[int],
    *,
    parent_call_id: str | None = None,
    parent_cumulative: list[int] | tuple[int, ...] | None = None,
    delta: bool = False,
    created_at: float = FIXED_CREATED_AT,
) -> TokenEntry:
    """Build a stamped ``TokenEntry`` the way ``s3capture.demo._serve_call`` does.

    ``prompt`` is always the FULL prompt. ``cum_len``/``digest`` cover ``prompt + generation``.
    With ``parent_call_id`` the entry is RESOLVED to that parent, else ROOT. With ``delta=True``
    (needs ``parent_cumulative``) only the prompt suffix after the parent's cumulative tokens is
    stored and ``prompt_is_delta`` is set.
    """
    full_prompt = list(prompt)
    entry = TokenEntry(
        rollout_id=rollout_id,
        model_call_id=model_call_id,
        model="test-model",
        prompt_token_ids=full_prompt,
        generation_token_ids=list(generation),
        generation_log_probs=[-0.25] * len(generation),
        output_items=[dict(item) for item in output_items],
        token_item_index=(len(output_items) - 1) if output_items else None,
        response_id=f"resp-{model_call_id}",
        created_at=created_at,
    )
    stamp_continuation(entry, list(request_items))
    status = ParentResolutionStatus.ROOT if parent_call_id is None else ParentResolutionStatus.RESOLVED
    stamp_lineage(entry, parent_call_id, parent_resolution=status)
    if delta:
        if parent_call_id is None or parent_cumulative is None:
            raise ValueError("a delta entry needs parent_call_id and parent_cumulative")
        store_prompt_as_delta(entry, parent_cumulative)
    return entry


@dataclass
class Turn:
    """One call of a synthetic multi-turn conversation (see ``build_conversation``)."""

    call_id: str
    request_items: list[dict]
    output_items: list[dict]
    prompt: list[int]
    generation: list[int]
    parent_call_id: str | None

    @property
    def cumulative(self) -> list[int]:
        return self.prompt + self.generation


def build_conversation(
    rollout_id: str, turns: int, *, call_prefix: str = "call", token_base: int = 1000, tools_every: int = 0
) -> list[Turn]:
    """A linear conversation of ``turns`` calls; each request extends the previous one.

    Call ``i``'s full prompt is call ``i-1``'s cumulative tokens plus a few tokens for the new user
    (or tool) item, so every call is a proven continuation of the one before. With
    ``tools_every=k`` every k-th call answers with a function call, and the next request carries
    its tool result.
    """
    out: list[Turn] = []
    items: list[dict] = [system("You are terse."), user(f"{rollout_id}: question 0")]
    cumulative: list[int] = [token_base, token_base + 1, token_base + 2]
    for i in range(turns):
        if tools_every and i % tools_every == tools_every - 1:
            output = function_call_output(f"fc-{i}", "lookup", f'{{"q": {i}, "b": "x"}}')
        else:
            output = assistant_output(f"answer {i} of {rollout_id}")
        prompt = list(cumulative)
        generation = [token_base + 10 * i + 5, token_base + 10 * i + 6, token_base + 10 * i + 7]
        out.append(
            Turn(f"{call_prefix}-{i:03d}", list(items), output, prompt, generation, out[-1].call_id if out else None)
        )
        items = items + output
        if output[0].get("type") == "function_call":
            items.append(tool_result(f"fc-{i}", f"result {i}"))
        else:
            items.append(user(f"question {i + 1}"))
        cumulative = prompt + generation + [token_base + 10 * i + 8, token_base + 10 * i + 9]
    return out


def next_request(turn: Turn, follow_up: str = "next") -> list[dict]:
    """The request that continues ``turn``: its request, its output and a new user item."""
    return list(turn.request_items) + list(turn.output_items) + [user(follow_up)]


def turn_entry(
    rollout_id: str, turn: Turn, *, delta: bool = False, parent_cumulative: list[int] | None = None
) -> TokenEntry:
    """``make_entry`` for a ``Turn`` (RESOLVED to the previous turn, or ROOT for the first)."""
    return make_entry(
        rollout_id,
        turn.call_id,
        turn.request_items,
        turn.output_items,
        turn.prompt,
        turn.generation,
        parent_call_id=turn.parent_call_id,
        parent_cumulative=parent_cumulative,
        delta=delta and turn.parent_call_id is not None,
    )


# --------------------------------------------------------------------------- request recording
def _key_of(url: str, bucket: str) -> str:
    path = unquote(urlparse(url).path)
    marker = f"/{bucket}/"
    if path.startswith(marker):
        return path[len(marker) :]
    return path.lstrip("/")


@dataclass
class RequestRecorder:
    """Records every S3 request a store sends, through its transport's request hooks (so it works
    on every transport: ``Transport.add_hook``).

    The ``before`` hook records ``(operation, key)`` and raises the in-flight count; the ``after``
    hook lowers it. ``sequence`` interleaves ``("send", op)`` and ``("recv", op)`` in the order the
    client saw them. A LIST's key is the listed prefix.
    """

    bucket: str
    sent: list[tuple[str, str, float]] = field(default_factory=list)
    sequence: list[tuple[str, str]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    @classmethod
    async def attach(cls, store: Any) -> "RequestRecorder":
        recorder = cls(store.bucket)
        store.transport.add_hook(before=recorder._before_send, after=recorder._response_received)
        return recorder

    def _before_send(self, operation: str, key: str, continuation: str | None = None) -> None:
        self.sent.append((operation, key, time.monotonic()))
        self.sequence.append(("send", operation))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _response_received(self, operation: str, key: str, continuation: str | None = None) -> None:
        self.sequence.append(("recv", operation))
        self.in_flight -= 1

    def reset(self) -> None:
        """Forget everything recorded so far (call between operations)."""
        self.sent.clear()
        self.sequence.clear()
        self.in_flight = 0
        self.max_in_flight = 0

    def counts(self) -> collections.Counter:
        """Requests sent since the last ``reset``, by operation name."""
        return collections.Counter(op for op, _, _ in self.sent)

    def keys(self, operation: str) -> list[str]:
        """Keys (relative to the bucket) of the ``operation`` requests since the last ``reset``."""
        return [key for op, key, _ in self.sent if op == operation]


def round_trips(rec: RequestRecorder) -> int:
    """Sequential round trips in what ``rec`` saw: the largest set of requests each sent after the
    previous one's response arrived (requests in flight together count once)."""
    spans: list[list[Any]] = []
    for position, (kind, operation) in enumerate(rec.sequence):
        if kind == "send":
            spans.append([operation, position, None])
            continue
        for span in spans:
            if span[2] is None and span[0] == operation:
                span[2] = position
                break
    count, last_end = 0, -1
    for _, start, end in sorted(spans, key=lambda s: s[2] if s[2] is not None else s[1]):
        if start > last_end:
            count += 1
            last_end = end if end is not None else start
    return count


# --------------------------------------------------------------------------- process workers
def forkserver_context() -> Any:
    """A ``multiprocessing`` context whose forkserver has imported ``killworkers`` (and so this
    module, the store, aioboto3 and S3's parsed models): a child starts within milliseconds instead
    of an interpreter start-up and those imports (1-2 s of CPU each on a loaded CI machine).

    Python 3.11's forkserver ignores the parent's ``sys.path``, so this folder is put on PYTHONPATH
    while the forkserver starts (once per process; later calls reuse it). Its children inherit the
    forkserver's environment, not the caller's: pass them the caller's (``run_put_processes`` does).
    """
    import multiprocessing
    from multiprocessing import forkserver as forkserver_module
    from pathlib import Path

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["killworkers"])
    saved = os.environ.get("PYTHONPATH")
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join([here, *([saved] if saved else [])])
    try:
        forkserver_module.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return ctx


def process_put_worker(
    worker: int,
    url: str,
    env: dict[str, str],
    payloads: list[bytes],
    barrier: Any,
    results: Any,
    concurrency: int = 32,
) -> None:
    """Entry point of a child process: put every payload (canonical entry JSON) through its own
    ``S3TokenStore``, all at once (bounded), after every process reached ``barrier``. ``env`` is
    the whole environment the child runs with.

    Puts ``(worker, [(model_call_id, outcome, detail), ...])`` on ``results``; outcome is ``"ok"``,
    ``"frozen"``, ``"retired"`` or ``"error"``.
    """
    os.environ.clear()
    os.environ.update(env)
    outcomes: list[tuple[str, str, str]] = []
    try:
        from s3capture.protocols import TokenCaptureFrozenError, TokenCaptureRetiredError
        from s3capture.records import decode_entry
        from s3capture.store import S3TokenStore

        entries = [decode_entry(p) for p in payloads]

        async def run() -> None:
            store = S3TokenStore(url, max_concurrency=concurrency)
            limit = asyncio.Semaphore(concurrency)
            try:
                await store._s3()

                async def one(entry: Any) -> None:
                    async with limit:
                        try:
                            await store.put(entry)
                            outcomes.append((entry.model_call_id, "ok", ""))
                        except TokenCaptureRetiredError as error:  # a subclass of the frozen error
                            outcomes.append((entry.model_call_id, "retired", str(error)))
                        except TokenCaptureFrozenError as error:
                            outcomes.append((entry.model_call_id, "frozen", str(error)))
                        except Exception as error:  # noqa: BLE001 - reported to the test
                            outcomes.append((entry.model_call_id, "error", f"{type(error).__name__}: {error}"))

                barrier.wait(timeout=120)
                await asyncio.gather(*(one(e) for e in entries))
            finally:
                await store.close()

        asyncio.run(run())
    except Exception as error:  # noqa: BLE001 - reported to the test
        outcomes.append(("", "error", f"worker {worker} crashed: {type(error).__name__}: {error}"))
    results.put((worker, outcomes))


def run_put_processes(
    url: str, env: dict[str, str], per_process: list[list[bytes]], timeout: float = 180.0
) -> dict[int, list]:
    """Start one process per payload list (``process_put_worker``) and return their outcomes.

    The processes start their puts together (a barrier), so their requests race at the server.
    They come from ``forkserver_context`` (fresh processes, not forks of this one), with this
    process's environment plus ``env``.
    """
    import queue as queue_module

    ctx = forkserver_context()
    child_env = {**os.environ, **env}
    barrier = ctx.Barrier(len(per_process))
    results = ctx.Queue()
    processes = [
        ctx.Process(target=process_put_worker, args=(w, url, child_env, payloads, barrier, results), daemon=True)
        for w, payloads in enumerate(per_process)
    ]
    for process in processes:
        process.start()
    out: dict[int, list] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < len(processes):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"put workers did not finish in {timeout} s ({len(out)}/{len(processes)} reported)")
            try:
                worker, outcomes = results.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"put worker(s) died: {[(p.pid, p.exitcode) for p in dead]}") from None
                continue
            out[worker] = outcomes
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
    return out


# --------------------------------------------------------------------------- source-test helpers
# (added for tests/test_store_source.py; plain-boto3 bucket access and a one-call entry builder)
DEFAULT_REQUEST: list[dict] = [{"role": "user", "content": "What is the weather in Paris?"}]


def simple_entry(
    rollout_id: str,
    model_call_id: str,
    *,
    prompt: list[int] | None = None,
    generation: list[int] | None = None,
    request_items: list[dict] | None = None,
    text: str = "a",
    log_probs: list[float] | None = None,
    created_at: float = FIXED_CREATED_AT,
) -> TokenEntry:
    """A stamped ROOT entry for one call (``make_entry`` with defaults: ``DEFAULT_REQUEST``,
    an assistant message ``text``, prompt ``[11, 12]``, generation ``[13, 14]``), validated.

    ``log_probs`` overrides ``generation_log_probs`` (e.g. to inject NaN); it is set after
    building, so non-finite values reach ``put`` unchanged.
    """
    entry = make_entry(
        rollout_id,
        model_call_id,
        DEFAULT_REQUEST if request_items is None else request_items,
        assistant_output(text),
        [11, 12] if prompt is None else list(prompt),
        [13, 14] if generation is None else list(generation),
        created_at=created_at,
    )
    if log_probs is not None:
        entry.generation_log_probs = list(log_probs)
    return entry.validate()


def canonical(entry: Any) -> bytes:
    """Canonical bytes (``encode_entry``) of an s3capture entry, a Gym pydantic entry or a dict."""
    from s3capture.records import coerce_entry, encode_entry

    return encode_entry(coerce_entry(entry))


def entry_sha(entry: Any) -> str:
    """SHA-256 hex of an entry's canonical bytes (the last segment of its object key)."""
    import hashlib

    return hashlib.sha256(canonical(entry)).hexdigest()


def require_gym() -> Any:
    """``nemo_gym.token_id_capture.records``: skip when absent, fail under CI (see ``gymcompat``)."""
    from gymcompat import require_gym as require_gym_package

    require_gym_package()
    import nemo_gym.token_id_capture.records as gym_records

    return gym_records


def gym_entry(entry: TokenEntry) -> Any:
    """The same entry as NeMo Gym's pydantic ``TokenEntry`` (skips/fails via ``require_gym``)."""
    import json

    from s3capture.records import encode_entry

    return require_gym().TokenEntry.model_validate(json.loads(encode_entry(entry)))


def split_bucket_url(url: str) -> tuple[str, str]:
    """``"s3://bucket/prefix"`` -> ``("bucket", "prefix/")`` (root with trailing slash, or "")."""
    parsed = urlparse(url)
    prefix = parsed.path.strip("/")
    return parsed.netloc, (prefix + "/" if prefix else "")


def list_keys(client: Any, bucket: str, prefix: str = "") -> list[str]:
    """Every key under ``prefix`` in ``bucket``, sorted, via a plain boto3 client."""
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys.extend(item["Key"] for item in page.get("Contents", []))
    return sorted(keys)


def get_bytes(client: Any, bucket: str, key: str) -> bytes:
    """The raw bytes of one object, via a plain boto3 client."""
    return client.get_object(Bucket=bucket, Key=key)["Body"].read()


def put_bytes(client: Any, bucket: str, key: str, body: bytes) -> None:
    """Place a raw object, via a plain boto3 client."""
    client.put_object(Bucket=bucket, Key=key, Body=body)


def put_bytes_at_folder_key(client: Any, bucket: str, key: str, body: bytes, *, read_timeout: float = 10.0) -> None:
    """PUT non-empty ``body`` at a ``key`` ending in "/", for tests of what a store keeps there.

    SeaweedFS 4.48 makes such a key a folder and keeps none of its bytes. Sent through a client whose
    pooled connection had served the test's earlier PUTs of empty folder keys, this PUT waited out
    the client's 60 s read timeout (urllib3 logged "Failed to parse headers ...
    MissingHeaderBodySeparatorDefect": the store's answers and the connection out of step), a minute
    of each such test in CI. A fresh copy of ``client`` (its own connections) with a short read
    timeout and no retries is answered at once; a timeout would be taken as the answer, and the
    caller's HEAD tells what the store kept."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import ReadTimeoutError

    credentials = client._request_signer._credentials.get_frozen_credentials()
    quick = boto3.session.Session().client(
        "s3",
        endpoint_url=client.meta.endpoint_url,
        region_name=client.meta.region_name,
        aws_access_key_id=credentials.access_key,
        aws_secret_access_key=credentials.secret_key,
        config=client.meta.config.merge(
            Config(read_timeout=read_timeout, retries={"mode": "standard", "max_attempts": 1})
        ),
    )
    try:
        quick.put_object(Bucket=bucket, Key=key, Body=body)
    except ReadTimeoutError:
        pass
    finally:
        quick.close()


# --------------------------------------------------------------------------- capture-ledger commits
def _hex(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def make_commit(
    rollout_id: str,
    call_id: str,
    request: list[dict],
    response: list[dict],
    *,
    parent: Any = None,
    delta: int = 4,
    weight_version: int = 0,
) -> dict:
    """A valid CaptureLedgerCommit wire dict; ``parent`` (a commit dict) makes a token_in child."""
    prev = parent["record"]["cum_len"] if parent else 0
    chain = (parent["staging_chain"] if parent else []) + [f"{rollout_id}/{call_id}"]
    return {
        "rollout_id": rollout_id,
        "record": {
            "model_call_id": call_id,
            "parent_call_id": parent["record"]["model_call_id"] if parent else None,
            "prev_len": prev,
            "delta_len": delta,
            "cum_len": prev + delta,
            "weight_version": weight_version,
            "digest": _hex("digest", rollout_id, call_id, delta, weight_version),
            "extras_digest": _hex("extras"),
            "staging_key": f"{rollout_id}/{call_id}",
            "mode": "token_in" if parent else "text",
            "chain_hash": _hex("chain", rollout_id, call_id, delta),
            "cumulative_hash": _hex("cumulative", rollout_id, call_id, delta),
            "response_id": f"resp-{call_id}",
            "admitted_at": 1700000000.0,
        },
        "staging_chain": chain,
        "request_items": list(request),
        "response_items": list(response),
    }


def continuation(commit: dict, text: str = "next") -> list[dict]:
    return [*commit["request_items"], *commit["response_items"], user(text)]


# --------------------------------------------------------------------------- delta chains on a server
def rollout_prefix(bucket_url: str, rollout_id: str) -> tuple[str, str]:
    bucket, root = split_bucket_url(bucket_url)
    return bucket, Layout(root.rstrip("/")).rollout(rollout_id)


def entry_key(prefix: str, entry: Any) -> str:
    sha = hashlib.sha256(encode_entry(entry)).hexdigest()
    return prefix + Layout("").entry_rel(prefix, entry.continuation_fingerprint, entry.model_call_id, sha)


def read_envelope(s3_client: Any, bucket: str, key: str) -> dict:
    body = s3_client.get_object(Bucket=bucket, Key=key)["Body"].read()
    return json.loads(zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 24))


def write_envelope(s3_client: Any, bucket: str, key: str, envelope: dict) -> None:
    """Rewrite an entry object's envelope, keeping its entry bytes exactly (so its key stays right)."""
    raw = zstandard.ZstdDecompressor().decompress(
        s3_client.get_object(Bucket=bucket, Key=key)["Body"].read(), max_output_size=1 << 24
    )
    entry = raw[raw.index(b',"entry":') + len(b',"entry":') : raw.rindex(b',"format":')]
    fields = {k: v for k, v in envelope.items() if k not in ("entry", "format")}
    body = b"{" + b",".join(
        json.dumps(k).encode() + b":" + json.dumps(v, separators=(",", ":")).encode() for k, v in sorted(fields.items())
    )
    body += b',"entry":' + entry + b',"format":"s3capture.entry/1"}'
    put_bytes(s3_client, bucket, key, zstandard.ZstdCompressor().compress(body))


async def put_chain(writer: Any, rollout_id: str, depth: int) -> tuple[list[Any], list[Any]]:
    """A linear chain: call 0 with its full prompt, every later call a delta (Gym's
    ``delta_records: true``), all put by one writer."""
    turns = build_conversation(rollout_id, depth)
    entries = []
    for index, turn in enumerate(turns):
        entry = turn_entry(
            rollout_id, turn, delta=bool(index), parent_cumulative=turns[index - 1].cumulative if index else None
        )
        await writer.put(entry)
        entries.append(entry)
    return turns, entries


async def capture_chains(url: str, ids: Any = ("r-0",), depth: int = 2, *, frozen: bool = True) -> dict[str, Any]:
    """``put_chain`` of each id through a new ``S3TokenStore`` at ``url``, then a freeze of each
    when ``frozen``; the store is closed. Returns ``{rollout_id: FrozenSnapshot}`` (empty when not
    frozen)."""
    from s3capture.store import S3TokenStore

    snapshots = {}
    writer = S3TokenStore(url)
    try:
        for rollout_id in ids:
            await put_chain(writer, rollout_id, depth)
            if frozen:
                snapshots[rollout_id] = await writer.freeze(rollout_id)
    finally:
        await writer.close()
    return snapshots


def example_entries(path: Any) -> list[TokenEntry]:
    """One ``simple_entry`` per model call of a shared Gym example file (its real token ids and
    log probabilities, when it has them)."""
    from s3capture.replay import load_rollouts

    return [
        simple_entry(
            rollout.rollout_id,
            call.model_call_id,
            prompt=list(call.prompt_token_ids),
            generation=list(call.generation_token_ids),
            log_probs=list(call.generation_log_probs),
            request_items=call.request_items,
        )
        for rollout in load_rollouts([path])
        for call in rollout.calls
    ]


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (Linux ``/proc``; a zombie counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
