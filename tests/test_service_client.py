"""The client's retries reuse the sequence number; errors carry the service's type and field.

A mock transport stands in for the service, so each case decides exactly what the server answers.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from rewardstack.client import AsyncClient, Client, RetryPolicy, ServiceCallError, ServiceUnavailable

STEP = {"name": "augment", "prompt": "p", "completions": ["a", "b"]}
FAST = RetryPolicy(attempts=4, backoff_s=0.0, max_backoff_s=0.0)


def service(answers: list[int]):  # noqa: ANN201
    """A handler answering /v1/score with the given statuses in turn, recording every body."""
    seen: list[dict] = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/v1/namespaces/"):  # a session (POST) or the standing (GET)
            return httpx.Response(200, json={"namespace": "n", "sequence": 4, "next": 5, "epoch": 7})
        body = json.loads(request.content)
        seen.append(body)
        code = answers.pop(0) if answers else 200
        if code == 200:
            return httpx.Response(200, json={"rewards": [0.5, 0.5], "sequence": body.get("sequence", 1)})
        if code == 422:
            return httpx.Response(422, json={"error": {"message": "must be a string", "type": "invalid_step", "field": "prompt"}})
        return httpx.Response(code, headers={"Retry-After": "0"}, json={"error": {"message": "busy", "type": "queue_full", "field": None}})

    return handle, seen


def test_sync_client_numbers_steps_and_retries_with_the_same_number() -> None:
    handle, seen = service([429, 503])
    with Client("http://svc", namespace="n", retry=FAST, transport=httpx.MockTransport(handle)) as c:
        first = c.score(STEP)
        second = c.score(STEP)
    assert first["sequence"] == 5 and second["sequence"] == 6
    assert [b["sequence"] for b in seen] == [5, 5, 5, 6]  # two refusals, then the same step again
    assert all(b["namespace"] == "n" and b["epoch"] == 7 for b in seen)


def test_a_504_is_resent_with_the_same_number_and_retry_after_is_honoured_up_to_a_minute() -> None:
    handle, seen = service([504])
    with Client("http://svc", namespace="n", retry=FAST, transport=httpx.MockTransport(handle)) as c:
        assert c.score(STEP)["sequence"] == 5
    assert [b["sequence"] for b in seen] == [5, 5]  # the service's deadline passed before scoring: not scored
    policy = RetryPolicy(max_backoff_s=5.0)
    assert policy.delay(0, "30") == 30.0 and policy.delay(0, "600") == 60.0


def test_errors_name_type_and_field_and_are_not_retried() -> None:
    handle, seen = service([422])
    with Client("http://svc", namespace="n", retry=FAST, transport=httpx.MockTransport(handle)) as c:
        with pytest.raises(ServiceCallError) as e:
            c.score(STEP)
    assert e.value.status == 422 and e.value.type == "invalid_step" and e.value.field == "prompt"
    assert len(seen) == 1


def test_a_step_without_sequence_is_not_resent_after_a_lost_answer() -> None:
    calls = []

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        raise httpx.ReadTimeout("answer lost", request=request)

    with Client("http://svc", retry=FAST, sequence=None, transport=httpx.MockTransport(handle)) as c:
        with pytest.raises(ServiceUnavailable, match="may have been scored") as e:
            c.score(STEP)
    assert isinstance(e.value.__cause__, httpx.ReadTimeout)
    assert len(calls) == 1  # it may have been scored: sending it again could apply it twice


def test_async_client_retries_with_the_same_number() -> None:
    handle, seen = service([429])

    async def go() -> list[dict]:
        async with AsyncClient("http://svc", namespace="n", retry=FAST, transport=httpx.MockTransport(handle)) as c:
            return list(await asyncio.gather(c.score(STEP), c.score(STEP)))

    events = asyncio.run(go())
    assert sorted(e["sequence"] for e in events) == [5, 6]
    assert [b["sequence"] for b in seen] == [5, 5, 6]
