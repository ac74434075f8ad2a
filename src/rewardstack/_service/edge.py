"""What every rewardstack HTTP app puts in front of its routes, and what `rewardstack serve` does about
clients that hold connections open.

The routes' edge: the one error chokepoint, bearer access (the namespace rule, `namespace_for`, is
the protocol's: service/protocol.py), and the checks that keep a browser from writing to a loopback
service without a token (`require_json`, `loopback_guard`; docs/SERVICE.md, "Loopback without a
token"). `rewardstack serve` (service/app.py) and the Ray Serve replicas (distributed/serve.py)
answer the same contract; both install these, so a refusal reads the same from either.

The connections' edge: uvicorn times out a connection only while it is idle between requests (its
keep-alive timeout): a client that opens a connection and sends nothing, or sends its headers a
byte at a time, holds a socket (a file descriptor) for as long as it likes, and enough of them take
every descriptor the process has, after which the accept loop fails on every new connection and
logs each failure. So, around uvicorn's own HTTP protocol (whichever it picked, h11 or httptools):

- `guarded_protocol`: a connection must complete a request's headers within `header_timeout_s`
  of connecting (or of its previous answer), else it is closed; past `max_connections` open
  connections a new one is closed as it arrives, before it reads anything. The body has its own
  timeout in the body-counting middleware (`protocol.BodyLimit`, 408).
- `server_config`: the uvicorn configuration `serve` runs with (the protocol below, the bounded
  drain on SIGTERM: `drain_timeout_s`).
- `CutAtShutdown`: a request still open when the drain time is up is answered 503 in one log
  line, not a traceback.
- the cap on connections is kept under the process's open-file limit (the models, the state files
  and one lock per namespace need descriptors too).
- `answer_of`: a queued request's answer, withdrawn if its deadline passes or its client goes away
  before the worker starts it (the score, session and trainer routes alike).
- `RepeatFilter` / `log_rate_limited`: a message repeated (same logger, same text before its
  arguments) is logged at most once per window, the next one saying how many were held back, so a
  flood of refused connections or accept errors writes a few lines, not gigabytes.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from rewardstack.errors import InputError, RewardStackError
from rewardstack._service.errors import ServiceError
from rewardstack._service.access import Access, is_loopback
from rewardstack._settings import ServiceSettings

log = logging.getLogger("rewardstack.service")


def as_service_error(exc: BaseException, where: str = "") -> ServiceError:
    """The refusal the app answers `exc` with (its status is what a request counter must count);
    `where` is the request's method and path, which a routing error names."""
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, InputError):
        return ServiceError(422, "invalid_step", str(exc), field=exc.field)
    if isinstance(exc, RequestValidationError):
        errs = exc.errors()
        loc = ".".join(str(x) for x in errs[0].get("loc", ())[1:]) if errs else None
        return ServiceError(422, "invalid_request", errs[0]["msg"] if errs else "invalid", field=loc or None)
    if isinstance(exc, StarletteHTTPException):
        # The router's own refusals (no such route, a method the route does not take) answer the
        # same shape as every other error, not FastAPI's `{"detail": ...}`.
        if exc.status_code == 404:
            error = ServiceError(404, "not_found", f"no route {where}")
        elif exc.status_code == 405:
            error = ServiceError(405, "method_not_allowed", f"{where}: the route does not take this method")
        else:
            error = ServiceError(exc.status_code, "http_error", str(exc.detail))
        error.headers = dict(exc.headers or {})  # 405 keeps its Allow header
        return error
    if isinstance(exc, ClientDisconnect):
        return ServiceError(CLIENT_GONE, "client_gone", "the client went away before its request body was complete")
    if isinstance(exc, RewardStackError):
        return ServiceError(500, "internal", str(exc))
    return ServiceError(500, "internal", f"internal error ({type(exc).__name__})")


CLIENT_GONE = 499
"""The status counted for a client that went away before its answer (nginx's code; never sent)."""
EXPECTED = (ServiceError, RewardStackError, RequestValidationError, StarletteHTTPException, ClientDisconnect)
"""The errors `as_service_error` knows (InputError is a RewardStackError); any other is logged with its traceback."""


def install_error_handlers(app: FastAPI) -> None:
    """Turn every error a route raises into `{"error": {"message", "type", "field"}}` with its status."""

    async def answer(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, ClientDisconnect):
            # The client closed its connection while sending the body: its mistake or its network's,
            # not the server's, so one line and no traceback (and the answer goes nowhere).
            log.info("%s %s: the client went away before its request body was complete; nothing was scored",
                     request.method, request.url.path)
        elif not isinstance(exc, EXPECTED):
            log.exception("unexpected error")
        error = as_service_error(exc, f"{request.method} {request.url.path}")
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    for kind in (*EXPECTED, Exception):
        app.add_exception_handler(kind, answer)


# The request dependencies below are coroutines, though they never wait: FastAPI runs a plain
# function dependency in a worker thread, and those handoffs took half the event loop's time per
# one-sample trainer request (bench/RESULTS.md).
async def require_json(request: Request) -> None:
    """A FastAPI dependency: 415 unless the body is declared `application/json`.

    A web page can make a browser send a cross-origin POST without asking the server first only
    with a "simple" content type (text/plain, a form, or none at all); `application/json` makes the
    browser ask first (a CORS preflight), which this service never grants. So a page on another
    site cannot get a step scored, whatever the body holds.
    """
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind != "application/json":
        raise ServiceError(415, "unsupported_media_type", f"the body must be sent as Content-Type: application/json "
                           f"(got {kind or 'none'}); the step was not scored", field="content-type")


def _host_name(value: str) -> str:
    """The name part of a Host header (`[::1]:8000` -> `::1`, `localhost:9000` -> `localhost`)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _is_local_name(name: str, bound: str) -> bool:
    return name == bound.lower() or is_loopback(name)


def loopback_guard(host: str, access: Access) -> Callable[[Request], Awaitable[None]] | None:
    """A FastAPI dependency for every route of a service bound to loopback without a token, else None.

    Without a token, being on this machine is the only credential, and a browser on this machine
    can be made to send requests: DNS rebinding points a site's own name at 127.0.0.1, so its
    page reads and writes the service as if same-origin. Such requests carry that site's name in
    `Host`, and a page's cross-origin requests carry its `Origin`: both must name this machine
    (`localhost`, a loopback address, or the bound host). The port is not checked: an SSH tunnel
    may forward another one.
    """
    if access.required or not is_loopback(host):
        return None

    async def guard(request: Request) -> None:
        name = _host_name(request.headers.get("host", ""))
        if not _is_local_name(name, host):
            raise ServiceError(403, "forbidden_host", f"Host {name or '(none)'!r} is not this machine: without a token "
                               "the service answers only requests addressed to localhost or a loopback address",
                               field="host")
        origin = request.headers.get("origin")
        if origin is not None:
            _, _, rest = origin.partition("://")
            if not rest or not _is_local_name(_host_name(rest.split("/", 1)[0]), host):
                raise ServiceError(403, "forbidden_origin", f"Origin {origin[:100]!r} is not this machine: without a "
                                   "token the service refuses requests from web pages of other sites", field="origin")

    return guard


async def authorize(request: Request) -> str | None:
    """A FastAPI dependency: the namespace the caller's token is bound to (ALL_NAMESPACES: any;
    None: no tokens are configured), or 401. The app's `Access` is `request.app.state.access`."""
    access: Access = request.app.state.access
    if not access.required:
        return None
    scheme, _, token = request.headers.get("authorization", "").partition(" ")  # Authorization: Bearer <token>
    scope = access.namespace_of(token.strip() if scheme.lower() == "bearer" and token.strip() else None)
    if scope is None:
        raise ServiceError(401, "unauthorized", "a valid bearer token is required (Authorization: Bearer ...)",
                           field="authorization", headers={"WWW-Authenticate": "Bearer"})
    return scope



# -- connections: timeouts, the cap, the drain, quiet logs -----------------------------------------
FD_RESERVE = 64
"""Descriptors kept for everything but client connections (model files, state, logs, pipes)."""


def server_config(app: Any, settings: ServiceSettings, *, log_level: str = "warning") -> Any:
    """The `uvicorn.Config` `rewardstack serve` runs `app` with: uvicorn's own HTTP protocol with
    the header timeout and the connection cap, and a shutdown that waits `drain_timeout_s` at
    most for open requests (the worker still finishes and commits the step it started)."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    # The cap, kept under the open-file limit (at least 8): the models, state and a lock per namespace need some too.
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = settings.max_connections if soft == resource.RLIM_INFINITY else max(
        8, min(settings.max_connections, soft - FD_RESERVE - settings.max_namespaces))
    if cap < settings.max_connections:
        log.warning("at most %d open connections (service.max_connections %d, lowered to stay under the "
                    "open-file limit)", cap, settings.max_connections)
    protocol = guarded_protocol(AutoHTTPProtocol, header_timeout_s=settings.header_timeout_s, max_connections=cap)
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level, workers=1, lifespan="on",
                          http=protocol, timeout_graceful_shutdown=settings.drain_timeout_s)  # type: ignore[arg-type]


def guarded_protocol(base: type[asyncio.Protocol], *, header_timeout_s: float, max_connections: int) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class `base` with a header timeout and a cap on open connections.

    Relies on what both of uvicorn's protocols have: `connections` (the server's open
    connections), `cycle` (the current request, replaced when a request's headers are complete),
    `loop`, `transport` and `on_response_complete`.
    """

    class GuardedProtocol(base):  # type: ignore[misc, valid-type]
        _header_timer: asyncio.TimerHandle | None = None
        _waiting_since_cycle: Any = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                log.warning("%d connections are open (service.max_connections, or the open-file limit): "
                            "new connections are closed until some end", max_connections)
                transport.abort()  # nothing read, nothing answered: the descriptor is freed now
                return
            self._await_headers()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._await_headers()  # the next request on this connection gets the same time

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timer()
            super().connection_lost(exc)

        def _await_headers(self) -> None:
            self._stop_timer()
            # A request whose headers complete replaces `cycle`; if it is still this one when the
            # timer fires, no request started in time.
            self._waiting_since_cycle = self.cycle
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _stop_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.cycle is self._waiting_since_cycle and not self.transport.is_closing():
                log.info("a connection sent no complete request headers within %g s (service.header_timeout_s): "
                         "closed", header_timeout_s)
                self.transport.close()

    GuardedProtocol.__name__ = f"Guarded{base.__name__}"
    return GuardedProtocol


class CutAtShutdown:
    """Pure ASGI middleware: a request still open when the drain time is up is answered 503
    `shutting_down` (if nothing was sent yet) with one log line, instead of the traceback uvicorn
    logs for every request task it cancels at shutdown (one per slow client still connected)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except asyncio.CancelledError:
            # uvicorn cancels the request tasks still running after timeout_graceful_shutdown: this
            # request is over either way (a step it started still commits in the worker), and
            # re-raising would only add a traceback.
            log.info("%s %s was still open after service.drain_timeout_s: closed at shutdown",
                     scope.get("method"), scope.get("path"))
            if not started:
                body = (b'{"error": {"message": "the service shut down before this request finished; retry with the '
                        b'same sequence number", "type": "shutting_down", "field": null}}')
                await send({"type": "http.response.start", "status": 503, "headers": [
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"), (b"retry-after", b"5")]})
                await send({"type": "http.response.body", "body": body, "more_body": False})


class RepeatFilter(logging.Filter):
    """Passes a message at most once per `window_s` for each (logger, message template: the text
    before its arguments); the next one that passes says how many were held back meanwhile."""

    def __init__(self, window_s: float = 10.0, *, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window_s = window_s
        self._clock = clock  # a parameter so a test can step time instead of racing it
        self._seen: dict[tuple[str, str], list[float]] = {}  # key -> [last passed at, held back]
        self._lock = threading.Lock()  # the worker thread logs too

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = self._clock()
        with self._lock:
            entry = self._seen.get(key)
            if entry is not None and now - entry[0] < self.window_s:
                entry[1] += 1
                return False
            held = int(entry[1]) if entry is not None else 0
            if len(self._seen) >= 1024:  # bounded: forget the keys whose window has passed
                self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.window_s}
            self._seen[key] = [now, 0]
        if held and isinstance(record.msg, str):
            record.msg = record.msg + f" [{held} more like this in the last {self.window_s:g} s were not logged]"
        return True


@contextmanager
def log_rate_limited(window_s: float = 10.0) -> Iterator[RepeatFilter]:
    """Inside: one `RepeatFilter` on every handler of the root and uvicorn loggers (asyncio's accept
    errors and rewardstack's own lines reach the root's); enter after uvicorn set up its logging.
    The handlers are the process's: the filter comes off on the way out."""
    repeat = RepeatFilter(window_s)
    handlers = [h for name in ("", "uvicorn", "uvicorn.error", "uvicorn.access") for h in logging.getLogger(name).handlers
                if not any(isinstance(f, RepeatFilter) for f in h.filters)]
    for handler in handlers:
        handler.addFilter(repeat)
    try:
        yield repeat
    finally:
        for handler in handlers:
            handler.removeFilter(repeat)


async def answer_of(request: Any, job: Any, deadline: float) -> Any:
    """A queued job's outcome (`job.future`); withdraws the job (`job.try_cancel()`) if its deadline
    passes or its client goes away first: 504 or 499, nothing scored. A job the worker has started
    finishes, and is answered, whatever happens to its client."""
    result = asyncio.wrap_future(job.future)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({result, gone}, timeout=max(0.0, deadline - time.monotonic()),
                                     return_when=asyncio.FIRST_COMPLETED)
        if result in done:
            return result.result()
        if job.try_cancel():  # not started: it will never be scored
            if gone in done:
                raise ServiceError(499, "client_gone", "the client went away; nothing was scored")
            raise ServiceError(504, "deadline_exceeded", "the request's deadline passed before scoring started; "
                               "nothing was scored (service.deadline_s)")
        return await result  # started: it finishes; answer with it
    finally:
        gone.cancel()


async def _disconnected(request: Any) -> None:
    """Returns when the client disconnects (the body has been read, so `receive` waits for that)."""
    while True:
        if (await request.receive())["type"] == "http.disconnect":
            return
