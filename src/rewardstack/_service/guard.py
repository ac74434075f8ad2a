"""What every rewardstack HTTP app puts in front of its routes: the one error chokepoint, bearer
access (the namespace rule, `namespace_for`, is the protocol's: service/protocol.py), and the
checks that keep a browser from writing to a loopback service without a token (`require_json`,
`loopback_guard`; docs/SERVICE.md, "Loopback without a token").

`rewardstack serve` (service/app.py) and the Ray Serve replicas (distributed/serve.py) answer the
same contract; both install these, so a refusal reads the same from either.
"""

from __future__ import annotations

import logging
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from rewardstack.errors import InputError, RewardStackError
from rewardstack._service.errors import ServiceError
from rewardstack._service.namespaces import Access, is_loopback

log = logging.getLogger(__name__)


def status_for(exc: BaseException) -> int:
    """The HTTP status the handlers below answer `exc` with: what a request counter must count."""
    if isinstance(exc, ServiceError):
        return exc.status
    if isinstance(exc, (InputError, RequestValidationError)):
        return 422
    if isinstance(exc, StarletteHTTPException):
        return exc.status_code
    if isinstance(exc, ClientDisconnect):
        return CLIENT_GONE
    return 500


CLIENT_GONE = 499
"""The status counted for a client that went away before its answer (nginx's code; never sent)."""


def install_error_handlers(app: FastAPI) -> None:
    """Turn every error a route raises into `{"error": {"message", "type", "field"}}` with its status."""

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(InputError)
    async def input_error(request: Request, exc: InputError) -> JSONResponse:
        return await service_error(request, ServiceError(422, "invalid_step", str(exc), field=exc.field))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        where = ".".join(str(x) for x in errs[0].get("loc", ())[1:]) if errs else None
        return await service_error(request, ServiceError(422, "invalid_request", errs[0]["msg"] if errs else "invalid",
                                                         field=where or None))

    @app.exception_handler(StarletteHTTPException)
    async def routing_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # The router's own refusals (no such route, a method the route does not take) answer the
        # same shape as every other error, not FastAPI's `{"detail": ...}`.
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            error = ServiceError(404, "not_found", f"no route {where}")
        elif exc.status_code == 405:
            error = ServiceError(405, "method_not_allowed", f"{where}: the route does not take this method")
        else:
            error = ServiceError(exc.status_code, "http_error", str(exc.detail))
        error.headers = dict(exc.headers or {})  # 405 keeps its Allow header
        return await service_error(request, error)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect) -> JSONResponse:
        # The client closed its connection while sending the body: its mistake or its network's,
        # not the server's, so one line and no traceback (and the answer goes nowhere).
        log.info("%s %s: the client went away before its request body was complete; nothing was scored",
                 request.method, request.url.path)
        return await service_error(request, ServiceError(CLIENT_GONE, "client_gone", "the client went away "
                                                         "before its request body was complete"))

    @app.exception_handler(RewardStackError)
    async def library_error(request: Request, exc: RewardStackError) -> JSONResponse:
        return await service_error(request, ServiceError(500, "internal", str(exc)))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return await service_error(request, ServiceError(500, "internal", f"internal error ({type(exc).__name__})"))


def require_json(request: Request) -> None:
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


def loopback_guard(host: str, access: Access) -> Callable[[Request], None] | None:
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

    def guard(request: Request) -> None:
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


def bearer(request: Request) -> str | None:
    """The token of an `Authorization: Bearer ...` header, if there is one."""
    value = request.headers.get("authorization")
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def authorize(request: Request) -> str | None:
    """A FastAPI dependency: the namespace the caller's token is bound to (ALL_NAMESPACES: any;
    None: no tokens are configured), or 401. The app's `Access` is `request.app.state.access`."""
    access: Access = request.app.state.access
    if not access.required:
        return None
    scope = access.namespace_of(bearer(request))
    if scope is None:
        raise ServiceError(401, "unauthorized", "a valid bearer token is required (Authorization: Bearer ...)",
                           field="authorization", headers={"WWW-Authenticate": "Bearer"})
    return scope
