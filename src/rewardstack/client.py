"""A small typed client of the scoring service (`rewardstack serve`), sync and async, on httpx.

    from rewardstack.client import Client
    with Client("http://127.0.0.1:8000", namespace="validator-a") as c:
        event = c.score({"name": "augment", "prompt": "...", "completions": ["...", "..."]})
        event["rewards"], event["sequence"]

Sequence numbers make retries safe: the client numbers each step of its namespace (asking the
service where the namespace stands on first use) and a retry after a timeout, a dropped
connection, 429 or 503 resends the *same* number, so the service applies the step once and answers
the retry with the stored result. Other errors raise `ServiceCallError` with the service's
`type`, `message` and `field`.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass
from typing import Any, Mapping

import httpx

from rewardstack.errors import RewardStackError

RETRY_STATUSES = frozenset({429, 503})
TOKEN_ENV = "REWARDSTACK_TOKEN"


class ServiceCallError(RewardStackError):
    """The service refused a request: HTTP status, error type, message and the field it names."""

    def __init__(self, status: int, type: str, message: str, field: str | None = None) -> None:
        self.status = status
        self.type = type
        self.message = message
        self.field = field
        where = f" (field '{field}')" if field else ""
        super().__init__(f"{status} {type}: {message}{where}")

    @classmethod
    def from_response(cls, r: httpx.Response) -> "ServiceCallError":
        try:
            err = r.json()["error"]
            return cls(r.status_code, str(err.get("type")), str(err.get("message")), err.get("field"))
        except (ValueError, KeyError, TypeError):
            return cls(r.status_code, "http_error", r.text[:200])


@dataclass
class RetryPolicy:
    """How often and how long to retry 429, 503 and transport errors (the same sequence each time)."""

    attempts: int = 6
    backoff_s: float = 0.25
    max_backoff_s: float = 10.0

    def delay(self, attempt: int, retry_after: str | None) -> float:
        if retry_after is not None:
            try:
                return min(self.max_backoff_s, max(0.0, float(retry_after)))
            except ValueError:
                pass
        return min(self.max_backoff_s, self.backoff_s * 2**attempt) * (0.5 + random.random() / 2)


def _payload(step: Mapping[str, Any] | Any, namespace: str | None, sequence: int | None) -> dict[str, Any]:
    d = dict(step.to_dict() if hasattr(step, "to_dict") else step)
    if namespace is not None:
        d["namespace"] = namespace
    if sequence is not None:
        d["sequence"] = sequence
    return d


def _may_resend(body: dict[str, Any] | None, error: httpx.TransportError) -> bool:
    """Whether a request that failed in transport may go again without risk of scoring twice.

    With a sequence number the service answers a repeat from its store; without one, only a
    request that never reached the service (no connection) is safe to send again.
    """
    return body is None or "sequence" in body or isinstance(error, httpx.ConnectError)


def _headers(token: str | None) -> dict[str, str]:
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    return {"Authorization": f"Bearer {token}"} if token else {}


class Client:
    """Synchronous client. `namespace` defaults to the token's namespace, else `default`.

    `sequence="auto"` (the default) numbers steps itself; `sequence=None` sends none (the service
    applies each as the next: no retry protection); a number passed to `score` wins.
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, namespace: str | None = None,
                 token: str | None = None, timeout: float = 120.0, retry: RetryPolicy | None = None,
                 sequence: str | None = "auto", transport: httpx.BaseTransport | None = None) -> None:
        self.namespace = namespace
        self.retry = retry or RetryPolicy()
        self.auto_sequence = sequence == "auto"
        self._next: int | None = None
        self.http = httpx.Client(base_url=base_url, headers=_headers(token), timeout=timeout, transport=transport)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def next_sequence(self) -> int:
        """The sequence number the next step will carry (asks the service once)."""
        if self._next is None:
            self._next = int(self._get(f"/v1/namespaces/{self.namespace or 'default'}")["next"])
        return self._next

    def score(self, step: Mapping[str, Any] | Any, *, sequence: int | None = None) -> dict[str, Any]:
        """Score one step; the event dict (`rewards`, `best`, per-model values...) plus `sequence`."""
        if sequence is None and self.auto_sequence:
            sequence = self.next_sequence()
        event = self._post("/v1/score", _payload(step, self.namespace, sequence))
        if self.auto_sequence:
            self._next = int(event["sequence"]) + 1
        return event

    def stack(self) -> dict[str, Any]:
        """Models, placement, budget, cost models and queue (`GET /v1/stack`)."""
        return self._get("/v1/stack")

    def health(self) -> dict[str, Any]:
        return self.http.get("/healthz").json()

    def ready(self) -> bool:
        try:
            return self.http.get("/readyz").status_code == 200
        except httpx.TransportError:
            return False

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Block until `/readyz` says ready (models loaded and checked)."""
        end = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > end:
                raise TimeoutError(f"the service at {self.http.base_url} was not ready within {timeout}s")
            time.sleep(0.2)

    def _get(self, path: str) -> dict[str, Any]:
        return self._send("GET", path, None)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._send("POST", path, body)

    def _send(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        for attempt in range(self.retry.attempts):
            last = attempt == self.retry.attempts - 1
            try:
                r = self.http.request(method, path, json=body)
            except httpx.TransportError as e:
                if last or not _may_resend(body, e):
                    raise
                time.sleep(self.retry.delay(attempt, None))
                continue
            if r.status_code in RETRY_STATUSES and not last:
                time.sleep(self.retry.delay(attempt, r.headers.get("retry-after")))
                continue
            if r.status_code >= 400:
                raise ServiceCallError.from_response(r)
            return r.json()
        raise AssertionError("unreachable")  # pragma: no cover


class AsyncClient:
    """The asynchronous twin of `Client` (same arguments, `await` every call)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, namespace: str | None = None,
                 token: str | None = None, timeout: float = 120.0, retry: RetryPolicy | None = None,
                 sequence: str | None = "auto", transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.namespace = namespace
        self.retry = retry or RetryPolicy()
        self.auto_sequence = sequence == "auto"
        self._next: int | None = None
        self._lock = asyncio.Lock()  # auto-numbered steps of one client go out one at a time, in order
        self.http = httpx.AsyncClient(base_url=base_url, headers=_headers(token), timeout=timeout, transport=transport)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def next_sequence(self) -> int:
        if self._next is None:
            self._next = int((await self._send("GET", f"/v1/namespaces/{self.namespace or 'default'}", None))["next"])
        return self._next

    async def score(self, step: Mapping[str, Any] | Any, *, sequence: int | None = None) -> dict[str, Any]:
        """Score one step (see `Client.score`)."""
        if sequence is not None or not self.auto_sequence:
            return await self._send("POST", "/v1/score", _payload(step, self.namespace, sequence))
        async with self._lock:
            seq = await self.next_sequence()
            event = await self._send("POST", "/v1/score", _payload(step, self.namespace, seq))
            self._next = int(event["sequence"]) + 1
            return event

    async def stack(self) -> dict[str, Any]:
        return await self._send("GET", "/v1/stack", None)

    async def ready(self) -> bool:
        try:
            return (await self.http.get("/readyz")).status_code == 200
        except httpx.TransportError:
            return False

    async def _send(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        for attempt in range(self.retry.attempts):
            last = attempt == self.retry.attempts - 1
            try:
                r = await self.http.request(method, path, json=body)
            except httpx.TransportError as e:
                if last or not _may_resend(body, e):
                    raise
                await asyncio.sleep(self.retry.delay(attempt, None))
                continue
            if r.status_code in RETRY_STATUSES and not last:
                await asyncio.sleep(self.retry.delay(attempt, r.headers.get("retry-after")))
                continue
            if r.status_code >= 400:
                raise ServiceCallError.from_response(r)
            return r.json()
        raise AssertionError("unreachable")  # pragma: no cover


__all__ = ["AsyncClient", "Client", "RetryPolicy", "ServiceCallError"]
