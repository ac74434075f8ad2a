"""The clients of `rewardstack serve`, sync and async, on httpx.

    from rewardstack_client import Client
    with Client("http://127.0.0.1:8000", namespace="validator-a", name="validator-a@box1") as c:
        event = c.score({"name": "augment", "prompt": "...", "completions": ["...", "..."]})
        event["rewards"], event["sequence"]

Sessions and sequence numbers make a validator never stuck and never doubled:
- On first use the client opens a **session** on its namespace: the service answers with an epoch
  and the next sequence number, counted after every step it admitted before (a step of a killed
  predecessor still being scored commits first). Every step carries the epoch and its number;
  every resend of a step carries the *same* number, so the service applies it once and answers a
  repeat with the stored result (_retry.py says when a request goes again).
- Opening a session **fences** the one before: a second validator on the namespace makes the first
  one's next step fail with `Fenced`, naming the other (host, pid, name). It is never silent.
- A refused number is never sent again. After `sequence_conflict` or `sequence_gap` the client
  asks the service where the namespace stands and sends the step under the service's next
  number; when the service lost the namespace's state (`session_unknown`: a wiped folder, a new
  box) it opens a new session, logs one warning, and goes on from the service's number.
Other errors raise `ServiceCallError` with the service's `type`, `message` and `field`; every
failure is a `ClientError` (_errors.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import threading
import time
from typing import Any, Dict, Generator, Optional, Tuple, Union
from urllib.parse import quote

import httpx

from rewardstack_client._errors import ClientError, Fenced, InvalidNamespace, ServiceCallError, ServiceUnavailable
from rewardstack_client._retry import Attempts, RetryPolicy, check_cancelled, pause

TOKEN_ENV = "REWARDSTACK_TOKEN"
NAMESPACE_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
MEMORY_HEADER = "X-Rewardstack-Memory"
"""A scored answer's memory record summary (JSON); the client puts it in the event as `memory`."""
NUMBERING = frozenset({"sequence_conflict", "sequence_gap"})
"""Refusals that say the client's number is not the service's: resync, never resend it."""
RESYNCS = 3
"""How many times one call may resync or reopen before it gives up with the last refusal."""

log = logging.getLogger("rewardstack_client")
Request = Tuple[str, str, Optional[Dict[str, Any]]]


def _namespace(name: Optional[str]) -> Optional[str]:
    if name is not None and not (isinstance(name, str) and NAMESPACE_RE.fullmatch(name)):
        raise InvalidNamespace(f"namespace {name!r} is not valid: use 1 to 64 of A-Z, a-z, 0-9, '_' and '-'")
    return name


def _payload(step: Any, namespace: Optional[str], sequence: Optional[int], epoch: Optional[int] = None) -> Dict[str, Any]:
    d = dict(step.to_dict() if hasattr(step, "to_dict") else step)
    if namespace is not None:
        d["namespace"] = namespace
    if sequence is not None:
        d["sequence"] = sequence
    if epoch is not None:
        d["epoch"] = epoch
    return d


def _headers(token: Optional[str]) -> Dict[str, str]:
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    return {"Authorization": f"Bearer {token}"} if token else {}


def _timeout(timeout: Union[float, httpx.Timeout], connect_timeout: float) -> httpx.Timeout:
    if isinstance(timeout, httpx.Timeout):
        return timeout
    return httpx.Timeout(timeout, connect=connect_timeout, pool=connect_timeout)


def _answer(r: httpx.Response) -> Dict[str, Any]:
    if r.status_code >= 400:
        raise ServiceCallError.from_response(r)
    try:
        out = r.json()
    except ValueError:
        raise ServiceCallError(r.status_code, "invalid_answer", f"the answer is not JSON: {r.text[:200]!r}") from None
    memory = r.headers.get(MEMORY_HEADER)
    if memory is not None and isinstance(out, dict):
        try:
            out["memory"] = json.loads(memory)
        except ValueError:
            pass  # a proxy mangled it: the event itself is whole
    return out


def _when(t: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(t))) if t else "an unknown time"


class _Writer:
    """A client's session on its namespace: the epoch, the next number, and what each answer means
    for them. No I/O: `plan` yields the requests to send and is sent their answers (or thrown their
    errors), so the sync and async clients share every rule."""

    def __init__(self, namespace: Optional[str], name: Optional[str]) -> None:
        self.namespace = namespace
        self.path = f"/v1/namespaces/{quote(namespace or 'default', safe='')}"
        self.hello = {"client": name or f"rewardstack-client:{namespace or 'default'}",
                      "host": socket.gethostname(), "pid": os.getpid()}
        self.epoch: Optional[int] = None
        self.next: Optional[int] = None

    def plan(self, step: Any) -> Generator[Request, Any, Dict[str, Any]]:
        """Send `step` as the namespace's next step: open, resync or reopen the session as needed."""
        action = "open" if self.epoch is None else ("resync" if self.next is None else "send")
        last: Optional[ClientError] = None
        for _ in range(RESYNCS + 1):
            if action in ("open", "reopen"):
                self._opened((yield ("POST", self.path + "/sessions", self.hello)), reset=action == "reopen")
            elif action == "resync":
                action = self._resynced((yield ("GET", self.path, None)))
                if action != "send":
                    continue
            try:
                event = yield ("POST", "/v1/score", _payload(step, self.namespace, self.next, self.epoch))
            except ServiceUnavailable:
                self.next = None  # applied or not: ask the service before the next step
                raise
            except Fenced:
                raise
            except ServiceCallError as e:
                if e.type == "session_unknown":
                    action = "reopen"
                elif e.type in NUMBERING:
                    action = "resync"
                else:
                    raise
                last = e
                continue
            self.next = int(event["sequence"]) + 1
            return event
        assert last is not None
        raise last

    def open(self) -> Generator[Request, Any, Dict[str, Any]]:
        """Open a session now (fencing any other client of the namespace); the service's answer."""
        answer = yield ("POST", self.path + "/sessions", self.hello)
        self._opened(answer, reset=False)
        return answer

    def _opened(self, answer: Dict[str, Any], *, reset: bool) -> None:
        if reset:
            log.warning("namespace %s: the service has no record of this client's session (epoch %s): its state of "
                        "the namespace was reset (a wiped state folder or a new box), so its normalizers and history "
                        "start again; went on with a new session (epoch %s) from sequence %s", self.namespace,
                        self.epoch, answer.get("epoch"), answer.get("next"))
        previous = answer.get("previous") or {}
        if previous and self.epoch is None and (previous.get("host"), previous.get("pid")) != (
                self.hello["host"], self.hello["pid"]):
            log.warning("namespace %s: took it over from client '%s' (host %s, pid %s), whose last step was at %s; "
                        "if that client still runs, its next step is refused as fenced", self.namespace,
                        previous.get("client"), previous.get("host"), previous.get("pid"),
                        _when(previous.get("last_step_at")))
        self.epoch = int(answer["epoch"])
        self.next = int(answer["next"])

    def _resynced(self, standing: Dict[str, Any]) -> str:
        epoch = int(standing.get("epoch") or 0)
        if self.epoch is not None and epoch > self.epoch:
            holder = standing.get("holder") or {}
            raise Fenced(409, "fenced", f"namespace '{self.namespace}' was taken over by client '{holder.get('client')}' "
                         f"(host {holder.get('host')}, pid {holder.get('pid')}) at {_when(holder.get('opened_at'))} "
                         f"(epoch {epoch}); this client's session (epoch {self.epoch}) is fenced", "epoch")
        if epoch != self.epoch:
            return "reopen"
        self.next = int(standing["next"])
        return "send"


class Client:
    """Synchronous client. `namespace` defaults to the token's namespace, else `default`.

    `sequence="auto"` (the default) opens a session and numbers steps itself; `sequence=None` sends
    none (the service applies each as the next: no retry protection); a number passed to `score`
    wins. `name` is how the client introduces itself to the service (shown to a client it fences).
    `timeout` is the read timeout (a step may take long to score), `connect_timeout` the time to
    notice a dead host. One client may be shared by threads: auto-numbered steps go out one at a
    time, in order.
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, namespace: Optional[str] = None,
                 token: Optional[str] = None, timeout: Union[float, httpx.Timeout] = 120.0, connect_timeout: float = 5.0,
                 retry: Optional[RetryPolicy] = None, sequence: Optional[str] = "auto", name: Optional[str] = None,
                 transport: Optional[httpx.BaseTransport] = None) -> None:
        self.namespace = _namespace(namespace)
        self.retry = retry or RetryPolicy()
        self.auto_sequence = sequence == "auto"
        self._writer = _Writer(self.namespace, name)
        self._timeout = _timeout(timeout, connect_timeout)
        self._lock = threading.RLock()
        self.http = httpx.Client(base_url=base_url, headers=_headers(token), timeout=self._timeout, transport=transport)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    @property
    def epoch(self) -> Optional[int]:
        """This client's session on its namespace (None before the first step)."""
        return self._writer.epoch

    def open_session(self) -> Dict[str, Any]:
        """Open a session now (the first `score` does it otherwise): epoch, next sequence, the holder before."""
        with self._lock:
            return self._drive(self._writer.open())

    def next_sequence(self) -> int:
        """The sequence number the next step will carry (opens the session if none is open)."""
        with self._lock:
            if self._writer.epoch is None:
                self.open_session()
            elif self._writer.next is None:
                self._writer._resynced(self._send("GET", self._writer.path, None))
            return int(self._writer.next)  # type: ignore[arg-type]

    def score(self, step: Any, *, sequence: Optional[int] = None) -> Dict[str, Any]:
        """Score one step; the event dict (`rewards`, `best`, per-model values...) plus `sequence`."""
        if sequence is not None or not self.auto_sequence:
            return self._send("POST", "/v1/score", _payload(step, self.namespace, sequence))
        with self._lock:
            return self._drive(self._writer.plan(step))

    def stack(self) -> Dict[str, Any]:
        """Models, placement, budget, cost models and queue (`GET /v1/stack`), waiting for the service."""
        return self._send("GET", "/v1/stack", None)

    def health(self) -> Dict[str, Any]:
        return self._send("GET", "/healthz", None)

    def ready(self) -> bool:
        try:
            return self.http.get("/readyz", timeout=self._timeout.connect).status_code == 200
        except httpx.TransportError:
            return False

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Block until `/readyz` says ready (models loaded and checked)."""
        end = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > end:
                raise ServiceUnavailable(f"the service at {self.http.base_url} was not ready within {timeout}s")
            pause(0.2)

    def _drive(self, plan: Generator[Request, Any, Dict[str, Any]]) -> Dict[str, Any]:
        request = next(plan)
        while True:
            error: Optional[ClientError] = None
            try:
                answer = self._send(*request)
            except ClientError as e:
                error = e  # the plan decides: resync, reopen or raise
            try:
                request = plan.throw(error) if error is not None else plan.send(answer)
            except StopIteration as done:
                return done.value

    def _send(self, method: str, path: str, body: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        plan = Attempts(self.retry, self._timeout, str(self.http.base_url).rstrip("/"), method, path, body)
        while True:
            check_cancelled()
            try:
                r = self.http.request(method, path, json=body, timeout=plan.try_timeout())
            except (httpx.UnsupportedProtocol, httpx.InvalidURL) as e:
                raise ClientError(f"{method} {self.http.base_url}{path}: {e}") from e
            except httpx.TransportError as e:
                pause(plan.after_error(e))
                continue
            except httpx.HTTPError as e:
                raise ServiceUnavailable(f"{method} {self.http.base_url}{path}: {type(e).__name__}: {e}") from e
            wait = plan.after_response(r)
            if wait is None:
                return _answer(r)
            pause(wait)


class AsyncClient:
    """The asynchronous twin of `Client` (same arguments, `await` every call)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, namespace: Optional[str] = None,
                 token: Optional[str] = None, timeout: Union[float, httpx.Timeout] = 120.0, connect_timeout: float = 5.0,
                 retry: Optional[RetryPolicy] = None, sequence: Optional[str] = "auto", name: Optional[str] = None,
                 transport: Optional[httpx.AsyncBaseTransport] = None) -> None:
        self.namespace = _namespace(namespace)
        self.retry = retry or RetryPolicy()
        self.auto_sequence = sequence == "auto"
        self._writer = _Writer(self.namespace, name)
        self._timeout = _timeout(timeout, connect_timeout)
        self._lock: Optional[asyncio.Lock] = None  # made on first use: it belongs to the running loop
        self.http = httpx.AsyncClient(base_url=base_url, headers=_headers(token), timeout=self._timeout,
                                      transport=transport)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    @property
    def epoch(self) -> Optional[int]:
        return self._writer.epoch

    def _locked(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def open_session(self) -> Dict[str, Any]:
        async with self._locked():
            return await self._drive(self._writer.open())

    async def next_sequence(self) -> int:
        async with self._locked():
            if self._writer.epoch is None:
                await self._drive(self._writer.open())
            elif self._writer.next is None:
                self._writer._resynced(await self._send("GET", self._writer.path, None))
            return int(self._writer.next)  # type: ignore[arg-type]

    async def score(self, step: Any, *, sequence: Optional[int] = None) -> Dict[str, Any]:
        """Score one step (see `Client.score`)."""
        if sequence is not None or not self.auto_sequence:
            return await self._send("POST", "/v1/score", _payload(step, self.namespace, sequence))
        async with self._locked():  # auto-numbered steps of one client go out one at a time, in order
            return await self._drive(self._writer.plan(step))

    async def stack(self) -> Dict[str, Any]:
        return await self._send("GET", "/v1/stack", None)

    async def ready(self) -> bool:
        try:
            return (await self.http.get("/readyz", timeout=self._timeout.connect)).status_code == 200
        except httpx.TransportError:
            return False

    async def _drive(self, plan: Generator[Request, Any, Dict[str, Any]]) -> Dict[str, Any]:
        request = next(plan)
        while True:
            error: Optional[ClientError] = None
            try:
                answer = await self._send(*request)
            except ClientError as e:
                error = e  # the plan decides: resync, reopen or raise
            try:
                request = plan.throw(error) if error is not None else plan.send(answer)
            except StopIteration as done:
                return done.value

    async def _send(self, method: str, path: str, body: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        plan = Attempts(self.retry, self._timeout, str(self.http.base_url).rstrip("/"), method, path, body)
        while True:
            try:
                r = await self.http.request(method, path, json=body, timeout=plan.try_timeout())
            except (httpx.UnsupportedProtocol, httpx.InvalidURL) as e:
                raise ClientError(f"{method} {self.http.base_url}{path}: {e}") from e
            except httpx.TransportError as e:
                await asyncio.sleep(plan.after_error(e))
                continue
            except httpx.HTTPError as e:
                raise ServiceUnavailable(f"{method} {self.http.base_url}{path}: {type(e).__name__}: {e}") from e
            wait = plan.after_response(r)
            if wait is None:
                return _answer(r)
            await asyncio.sleep(wait)


__all__ = ["AsyncClient", "Client", "TOKEN_ENV"]
