"""The clients of `rewardstack serve`, sync and async, on httpx.

    from rewardstack_client import Client
    with Client("http://127.0.0.1:8000", namespace="validator-a") as c:
        event = c.score({"name": "augment", "prompt": "...", "completions": ["...", "..."]})
        event["rewards"], event["sequence"]

Sequence numbers make retries safe: the client numbers each step of its namespace (asking the
service where the namespace stands on first use) and every resend carries the *same* number, so
the service applies the step once and answers a repeat with the stored result (_retry.py says
when a request goes again). Other errors raise `ServiceCallError` with the service's `type`,
`message` and `field`.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from typing import Any, Dict, Optional

import httpx

from rewardstack_client._errors import ServiceCallError, ServiceUnavailable
from rewardstack_client._retry import Attempts, RetryPolicy

TOKEN_ENV = "REWARDSTACK_TOKEN"


def _payload(step: Any, namespace: Optional[str], sequence: Optional[int]) -> Dict[str, Any]:
    d = dict(step.to_dict() if hasattr(step, "to_dict") else step)
    if namespace is not None:
        d["namespace"] = namespace
    if sequence is not None:
        d["sequence"] = sequence
    return d


def _headers(token: Optional[str]) -> Dict[str, str]:
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    return {"Authorization": f"Bearer {token}"} if token else {}


MEMORY_HEADER = "X-Rewardstack-Memory"
"""A scored answer's memory record summary (JSON); the client puts it in the event as `memory`."""


def _answer(r: httpx.Response) -> Dict[str, Any]:
    if r.status_code >= 400:
        raise ServiceCallError.from_response(r)
    out = r.json()
    memory = r.headers.get(MEMORY_HEADER)
    if memory is not None and isinstance(out, dict):
        try:
            out["memory"] = json.loads(memory)
        except ValueError:
            pass  # a proxy mangled it: the event itself is whole
    return out


class Client:
    """Synchronous client. `namespace` defaults to the token's namespace, else `default`.

    `sequence="auto"` (the default) numbers steps itself; `sequence=None` sends none (the service
    applies each as the next: no retry protection); a number passed to `score` wins. One client
    may be shared by threads: auto-numbered steps go out one at a time, in order.
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, namespace: Optional[str] = None,
                 token: Optional[str] = None, timeout: float = 120.0, retry: Optional[RetryPolicy] = None,
                 sequence: Optional[str] = "auto", transport: Optional[httpx.BaseTransport] = None) -> None:
        self.namespace = namespace
        self.retry = retry or RetryPolicy()
        self.auto_sequence = sequence == "auto"
        self._next: Optional[int] = None
        self._lock = threading.RLock()
        self.http = httpx.Client(base_url=base_url, headers=_headers(token), timeout=timeout, transport=transport)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def next_sequence(self) -> int:
        """The sequence number the next step will carry (asks the service once, waiting for it)."""
        with self._lock:
            if self._next is None:
                self._next = int(self._send("GET", f"/v1/namespaces/{self.namespace or 'default'}", None)["next"])
            return self._next

    def score(self, step: Any, *, sequence: Optional[int] = None) -> Dict[str, Any]:
        """Score one step; the event dict (`rewards`, `best`, per-model values...) plus `sequence`."""
        if sequence is not None or not self.auto_sequence:
            return self._send("POST", "/v1/score", _payload(step, self.namespace, sequence))
        with self._lock:
            seq = self.next_sequence()
            try:
                event = self._send("POST", "/v1/score", _payload(step, self.namespace, seq))
            except ServiceUnavailable:
                self._next = None  # it may or may not have been applied: ask the service next time
                raise
            self._next = int(event["sequence"]) + 1
            return event

    def stack(self) -> Dict[str, Any]:
        """Models, placement, budget, cost models and queue (`GET /v1/stack`), waiting for the service."""
        return self._send("GET", "/v1/stack", None)

    def health(self) -> Dict[str, Any]:
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
                raise ServiceUnavailable(f"the service at {self.http.base_url} was not ready within {timeout}s")
            time.sleep(0.2)

    def _send(self, method: str, path: str, body: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        plan = Attempts(self.retry, str(self.http.base_url).rstrip("/"), method, path, body)
        while True:
            try:
                r = self.http.request(method, path, json=body)
            except httpx.TransportError as e:
                time.sleep(plan.after_error(e))
                continue
            wait = plan.after_response(r)
            if wait is None:
                return _answer(r)
            time.sleep(wait)


class AsyncClient:
    """The asynchronous twin of `Client` (same arguments, `await` every call)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, namespace: Optional[str] = None,
                 token: Optional[str] = None, timeout: float = 120.0, retry: Optional[RetryPolicy] = None,
                 sequence: Optional[str] = "auto", transport: Optional[httpx.AsyncBaseTransport] = None) -> None:
        self.namespace = namespace
        self.retry = retry or RetryPolicy()
        self.auto_sequence = sequence == "auto"
        self._next: Optional[int] = None
        self._lock: Optional[asyncio.Lock] = None  # made on first use: it belongs to the running loop
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

    async def score(self, step: Any, *, sequence: Optional[int] = None) -> Dict[str, Any]:
        """Score one step (see `Client.score`)."""
        if sequence is not None or not self.auto_sequence:
            return await self._send("POST", "/v1/score", _payload(step, self.namespace, sequence))
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # auto-numbered steps of one client go out one at a time, in order
            seq = await self.next_sequence()
            try:
                event = await self._send("POST", "/v1/score", _payload(step, self.namespace, seq))
            except ServiceUnavailable:
                self._next = None
                raise
            self._next = int(event["sequence"]) + 1
            return event

    async def stack(self) -> Dict[str, Any]:
        return await self._send("GET", "/v1/stack", None)

    async def ready(self) -> bool:
        try:
            return (await self.http.get("/readyz")).status_code == 200
        except httpx.TransportError:
            return False

    async def _send(self, method: str, path: str, body: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        plan = Attempts(self.retry, str(self.http.base_url).rstrip("/"), method, path, body)
        while True:
            try:
                r = await self.http.request(method, path, json=body)
            except httpx.TransportError as e:
                await asyncio.sleep(plan.after_error(e))
                continue
            wait = plan.after_response(r)
            if wait is None:
                return _answer(r)
            await asyncio.sleep(wait)


__all__ = ["AsyncClient", "Client", "TOKEN_ENV"]
