"""NeMo Gym's real model-server capture path writing into s3capture, read back by Gym's consumer.

A stub Gym model server (a ``SimpleResponsesAPIModel`` subclass whose ``responses()`` returns token
ids from a toy tokenizer) is built the way Gym builds every model server: ``setup_webserver()``
installs Gym's own capture middleware (``install_model_call_capture``) from the global config, whose
``token_id_capture`` block names s3capture's store (README, "NeMo Gym YAML configuration"). The
app runs in-process behind httpx's ASGI transport (no port), inside its lifespan, so Gym closes the
stores it built. Three rollouts of four turns each go through
``/ng-rollout/<id>/training-token-capture/v1/responses`` concurrently, echoing each response's
output back as the next request's input, as Gym's agents do. Then Gym's consumer
(``trajectories_from_source``) builds the trajectories from a fresh ``S3TokenStore``.

The toy tokenizer is consistent (an assistant message re-encodes to exactly the tokens generated
for it), so every turn's prompt extends its parent's cumulative tokens and one unmasked trajectory
per rollout is the only correct outcome. What does not run here: uvicorn workers and Gym's process
launcher (``ng_run``); see docs/gym.md.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest

from gymcompat import require_gym

ROLLOUTS = 3
TURNS = 4
EOS = 2
USER = 1


def encode(text: str) -> list[int]:
    """The toy tokenizer: one token per byte, ids 100..249."""
    return [100 + byte % 150 for byte in text.encode()]


def _role_and_text(item: Any) -> tuple[str, str]:
    if hasattr(item, "model_dump"):
        item = item.model_dump()
    content = item.get("content")
    if isinstance(content, str):
        return str(item.get("role")), content
    return str(item.get("role") or "assistant"), "".join(part.get("text", "") for part in content or [])


def prompt_tokens(items: list[Any]) -> list[int]:
    """A user turn is ``[USER] + encode(text)``; an assistant turn re-encodes to its generation."""
    tokens: list[int] = []
    for item in items:
        role, text = _role_and_text(item)
        tokens += encode(text) + [EOS] if role == "assistant" else [USER, *encode(text)]
    return tokens


def stub_server(global_config: dict) -> tuple[Any, list[str]]:
    """A Gym model server (``SimpleResponsesAPIModel``) whose backend is the toy tokenizer, and the
    list of response ids its backend served."""
    from omegaconf import OmegaConf

    from nemo_gym.base_responses_api_model import BaseResponsesAPIModelConfig, SimpleResponsesAPIModel
    from nemo_gym.config_types import BaseServerConfig
    from nemo_gym.openai_utils import (
        NeMoGymResponse,
        NeMoGymResponseOutputMessageForTraining,
        NeMoGymResponseOutputText,
    )
    from nemo_gym.server_utils import ServerClient

    served: list[str] = []

    class StubModel(SimpleResponsesAPIModel):
        async def chat_completions(self, body=None):  # not used: the rollouts speak /v1/responses
            raise NotImplementedError

        async def responses(self, body):
            items = body.input if isinstance(body.input, list) else [{"role": "user", "content": body.input}]
            text = f"answer {len(items)} {uuid.uuid4().hex[:6]}"
            generation = encode(text) + [EOS]
            response_id = f"resp-{uuid.uuid4().hex}"
            served.append(response_id)
            message = NeMoGymResponseOutputMessageForTraining(
                id=f"msg-{response_id}",
                content=[NeMoGymResponseOutputText(annotations=[], text=text)],
                prompt_token_ids=prompt_tokens(items),
                generation_token_ids=generation,
                generation_log_probs=[-0.125] * len(generation),
            )
            return NeMoGymResponse(
                id=response_id,
                created_at=time.time(),
                model="stub",
                object="response",
                output=[message],
                parallel_tool_calls=False,
                tool_choice="auto",
                tools=[],
            )

    server = StubModel(
        config=BaseResponsesAPIModelConfig(host="127.0.0.1", port=1, entrypoint="stub.py", name="stub_model"),
        server_client=ServerClient(
            head_server_config=BaseServerConfig(host="127.0.0.1", port=1),
            global_config_dict=OmegaConf.create(global_config),
        ),
    )
    return server, served


async def run_rollouts(app: Any, rollout_ids: list[str]) -> dict[str, list[dict]]:
    """Drive ``TURNS`` turns of each rollout concurrently; return each rollout's served responses."""
    import httpx

    served: dict[str, list[dict]] = {rid: [] for rid in rollout_ids}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://stub-model") as client:

        async def rollout(rid: str) -> None:
            items: list[dict] = [{"role": "user", "content": f"{rid}: question 0"}]
            for turn in range(TURNS):
                reply = await client.post(
                    f"/ng-rollout/{rid}/training-token-capture/v1/responses", json={"model": "stub", "input": items}
                )
                assert reply.status_code == 200, reply.text
                body = reply.json()
                served[rid].append(body)
                items = items + body["output"] + [{"role": "user", "content": f"question {turn + 1}"}]

        await asyncio.gather(*(rollout(rid) for rid in rollout_ids))
    return served


def capture_config(bucket_url: str) -> dict:
    """The README's ``token_id_capture`` block (tests/test_gym_yaml.py checks the README itself)."""
    return {
        "token_id_capture": {
            "enabled": True,
            "sink": "s3capture.store:S3TokenStore",
            "sink_kwargs": {"url": bucket_url},
            "lineage_store": "s3capture.store:S3TokenStore",
            "lineage_store_kwargs": {"url": bucket_url},
            "delta_records": True,
        }
    }


async def check_rollouts(bucket_url: str, served: dict[str, list[dict]]) -> None:
    """Every served call is one entry chained to the call before it; Gym builds one trajectory."""
    from nemo_gym.token_id_capture.consumer import trajectories_from_source

    from s3capture.store import S3TokenStore

    async with S3TokenStore(bucket_url, entry_type="gym") as source:
        for rid, responses in served.items():
            snapshot = await source.freeze(rid)
            assert not snapshot.incomplete
            by_response = {entry.response_id: entry for entry in snapshot.entries}
            assert len(snapshot.entries) == len(by_response) == TURNS
            assert sorted(by_response) == sorted(body["id"] for body in responses)  # every captured call
            chain = [by_response[body["id"]] for body in responses]
            assert chain[0].parent_resolution == "root" and chain[0].parent_call_id is None
            assert not chain[0].prompt_is_delta
            for parent, child in zip(chain, chain[1:]):  # each continuation resolved its parent
                assert child.parent_resolution == "resolved"
                assert child.parent_call_id == parent.model_call_id
                assert child.prompt_is_delta  # delta_records: Gym stored the suffix after the parent
            for body, entry in zip(responses, chain):
                assert list(entry.generation_token_ids) == body["output"][0]["generation_token_ids"]

            built = await trajectories_from_source(rid, source)  # freezes again: idempotent
            assert built is not None and built["mask_sample"] is False, built
            metrics = built["metrics"]
            assert (metrics["n_calls"], metrics["chains"], metrics["roots"]) == (TURNS, 1, 1)
            assert metrics["unresolved_parent_calls"] == 0 and metrics["quarantined_calls"] == 0
            trained = [item for item in built["rebuilt_response"]["output"] if item.get("generation_token_ids")]
            assert [item["generation_token_ids"] for item in trained] == [
                body["output"][0]["generation_token_ids"] for body in responses
            ]
            last = responses[-1]["output"][0]
            assert trained[-1]["prompt_token_ids"] == last["prompt_token_ids"]


async def test_gym_model_server_captures_into_s3capture_and_gym_rebuilds(s3_env, bucket_url):
    require_gym()
    pytest.importorskip("httpx")
    server, backend_ids = stub_server(capture_config(bucket_url))  # the README's block: delta_records true
    app = server.setup_webserver()  # Gym's install_model_call_capture builds s3capture's stores here
    rollout_ids = [f"mw-{index}-{uuid.uuid4().hex[:6]}" for index in range(ROLLOUTS)]
    async with app.router.lifespan_context(app):  # on exit Gym closes the sink and lineage store it built
        served = await run_rollouts(app, rollout_ids)
    assert sorted(backend_ids) == sorted(body["id"] for bodies in served.values() for body in bodies)
    await check_rollouts(bucket_url, served)


async def test_a_store_installed_through_s3capture_is_the_one_gym_middleware_uses(s3_env, bucket_url):
    """No sink in the YAML: ``s3capture.install_token_sink`` / ``install_lineage_store`` feed Gym's middleware."""
    require_gym()
    pytest.importorskip("httpx")
    import s3capture
    from s3capture.store import S3TokenStore

    sink, lineage = S3TokenStore(bucket_url), S3TokenStore(bucket_url)
    saved = s3capture.installed_token_sink(), s3capture.installed_lineage_store()
    s3capture.install_token_sink(sink)
    s3capture.install_lineage_store(lineage)
    try:
        # Without a sink or directory Gym's config check needs the installed sink and store to pass.
        server, _ = stub_server({"token_id_capture": {"enabled": True, "delta_records": True}})
        app = server.setup_webserver()
        rollout_ids = [f"inst-{uuid.uuid4().hex[:6]}"]
        async with app.router.lifespan_context(app):
            served = await run_rollouts(app, rollout_ids)
    finally:
        s3capture.install_token_sink(saved[0])
        s3capture.install_lineage_store(saved[1])
        await sink.close()
        await lineage.close()
    await check_rollouts(bucket_url, served)
