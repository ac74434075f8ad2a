"""When a request goes again: the retry policy and one request's plan, shared by both clients.

A step carries a sequence number, so resending it is safe: the service applies a number once and
answers a repeat with the stored result. That makes riding out a restart simple: while the
service is down (connection refused), restarting (503 while it loads and calibrates), overloaded
(429), past its own deadline for the step (504: not scored) or the answer was lost (timeout,
dropped connection), the same request goes again with a bounded backoff until `deadline_s`; only
then does the call raise `ServiceUnavailable`. No try outlasts the deadline: each one's timeouts
are cut to the time left. A request without a sequence number is resent only when it cannot have
arrived (the connection was refused).

A call made in a worker thread for an async caller (`openvalidators.score_step`) stops at its next
wait once the caller is cancelled (`cancellable`): a Ctrl-C ends it, it does not go on retrying.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional

import httpx

from rewardstack_client._errors import Cancelled, ServiceCallError, ServiceUnavailable

log = logging.getLogger("rewardstack_client")

RETRY_STATUSES = frozenset({429, 502, 503, 504})
"""Answers that mean "not now": overloaded, a proxy with no service behind it, loading or draining,
and (for a numbered step or a read only) the service's deadline passed before it scored the step."""


@dataclass
class RetryPolicy:
    """How long and how often a request is resent (always the same request, same sequence number)."""

    deadline_s: float = 900.0
    """Give up after this many seconds in all. The default outlasts a restart of the service that
    loads and calibrates a full stack (several minutes on a 40 GiB card)."""
    backoff_s: float = 0.25
    """The first wait; it doubles each try, with jitter, up to `max_backoff_s`."""
    max_backoff_s: float = 5.0
    """The longest wait between two tries of the client's own choosing (a restarted service is
    found within this)."""
    max_retry_after_s: float = 60.0
    """The longest wait a service's `Retry-After` header is honoured for."""
    attempts: Optional[int] = None
    """A cap on tries as well as the deadline (None: as many as the deadline allows)."""
    log_every_s: float = 5.0
    """While retrying, one warning this often (not one per try)."""

    def delay(self, attempt: int, retry_after: Optional[str] = None) -> float:
        """Seconds before try `attempt + 1`: the service's Retry-After when it sends one, bounded."""
        if retry_after is not None:
            try:
                return min(self.max_retry_after_s, max(0.0, float(retry_after)))
            except ValueError:
                pass
        return min(self.max_backoff_s, self.backoff_s * 2 ** min(attempt, 30)) * (0.5 + random.random() / 2)


_local = threading.local()


@contextlib.contextmanager
def cancellable(event: threading.Event) -> Iterator[None]:
    """Within the block, this thread's waits between tries end with `Cancelled` once `event` is set."""
    _local.cancel = event
    try:
        yield
    finally:
        _local.cancel = None


def pause(seconds: float) -> None:
    """Wait between two tries; raise `Cancelled` if this thread's call was cancelled."""
    event: Optional[threading.Event] = getattr(_local, "cancel", None)
    if event is None:
        time.sleep(seconds)
    elif event.wait(seconds):
        raise Cancelled("the call was cancelled (its caller stopped waiting); nothing more was sent")


def check_cancelled() -> None:
    """Raise `Cancelled` if this thread's call was cancelled (before a try)."""
    event: Optional[threading.Event] = getattr(_local, "cancel", None)
    if event is not None and event.is_set():
        raise Cancelled("the call was cancelled (its caller stopped waiting); nothing more was sent")


class Attempts:
    """One request's retry plan: after each failed try, how long to wait, or the error to raise."""

    def __init__(self, policy: RetryPolicy, timeout: httpx.Timeout, base_url: str, method: str, path: str,
                 body: Optional[Dict[str, Any]]) -> None:
        self.policy = policy
        self.timeout = timeout
        self.what = f"{method} {base_url}{path}" + (f" (sequence {body['sequence']})" if body and "sequence" in body else "")
        # Resending is safe for a read, for a numbered step, or when nothing reached the service.
        self.idempotent = body is None or "sequence" in body
        self.started = time.monotonic()
        self.tries = 0
        self.logged_at: Optional[float] = None

    def left(self) -> float:
        return self.policy.deadline_s - (time.monotonic() - self.started)

    def try_timeout(self) -> httpx.Timeout:
        """This try's timeouts, none past the deadline."""
        left = max(0.05, self.left())

        def cut(t: Optional[float]) -> float:
            return left if t is None else min(t, left)

        return httpx.Timeout(connect=cut(self.timeout.connect), read=cut(self.timeout.read),
                             write=cut(self.timeout.write), pool=cut(self.timeout.pool))

    def after_error(self, error: httpx.TransportError) -> float:
        """The wait before resending after a transport error, or raise (not resendable, or too late)."""
        if not (self.idempotent or isinstance(error, httpx.ConnectError)):
            raise ServiceUnavailable(f"{self.what}: {type(error).__name__}: {error}. The step carries no sequence "
                                     "number, so it may have been scored and is not sent again") from error
        return self._next(f"{type(error).__name__}: {error}", None)

    def after_response(self, r: httpx.Response) -> Optional[float]:
        """None when `r` is the answer (success or a final error); else the wait before resending."""
        if r.status_code not in RETRY_STATUSES or (r.status_code == 504 and not self.idempotent):
            if self.logged_at is not None:
                log.warning("%s answered after %.0f s of retries", self.what, time.monotonic() - self.started)
            return None
        return self._next(f"HTTP {r.status_code}", r)

    def _next(self, reason: str, r: Optional[httpx.Response]) -> float:
        self.tries += 1
        elapsed = time.monotonic() - self.started
        wait = self.policy.delay(self.tries - 1, r.headers.get("retry-after") if r is not None else None)
        capped = self.policy.attempts is not None and self.tries >= self.policy.attempts
        if capped or elapsed + wait > self.policy.deadline_s:
            if r is not None and capped and elapsed + wait <= self.policy.deadline_s:
                raise ServiceCallError.from_response(r)  # out of tries, not of time: the service's own answer
            raise ServiceUnavailable(
                f"{self.what}: no answer after {elapsed:.0f} s and {self.tries} tries (last: {reason}). Check that "
                f"`rewardstack serve` runs there and that GET /readyz answers 200 (it is 503 while models load); "
                f"a longer wait is RetryPolicy(deadline_s=...)")
        now = time.monotonic()
        if self.logged_at is None or now - self.logged_at >= self.policy.log_every_s:
            self.logged_at = now
            log.warning("%s: %s; resending the same request (%.0f s of %.0f s)", self.what, reason, elapsed,
                        self.policy.deadline_s)
        return wait


__all__ = ["Attempts", "RETRY_STATUSES", "RetryPolicy", "cancellable", "check_cancelled", "pause"]
