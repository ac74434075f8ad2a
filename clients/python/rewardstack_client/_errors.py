"""The exceptions the client raises on purpose, one tree under `ClientError`.

    ClientError
    ├── ServiceCallError      the service answered with an error (HTTP status, type, message, field)
    │   └── Fenced            another client opened a session on this namespace: this one must stop
    ├── ServiceUnavailable    no usable answer before the retry deadline (down, restarting, overloaded)
    ├── Cancelled             the caller stopped waiting (Ctrl-C during `await score_step`)
    ├── InvalidNamespace      the namespace is not a valid name (also a ValueError)
    └── DropInError           the openvalidators drop-in was used in a way it cannot honour
        ├── WeightsMismatch   the validator's --reward.*_weight flags differ from the service's config
        └── StepMismatch      a call disagrees with the step already committed (also a ValueError)
"""

from __future__ import annotations

from typing import Any, Optional


class ClientError(Exception):
    """Base of every error the client raises on purpose."""


class ServiceCallError(ClientError):
    """The service refused a request: HTTP status, error type, message and the field it names."""

    def __init__(self, status: int, type: str, message: str, field: Optional[str] = None) -> None:
        self.status = status
        self.type = type
        self.message = message
        self.field = field
        where = f" (field '{field}')" if field else ""
        super().__init__(f"{status} {type}: {message}{where}")

    @classmethod
    def from_response(cls, r: Any) -> "ServiceCallError":
        """From an httpx response carrying the service's error body (or anything else)."""
        try:
            err = r.json()["error"]
            kind = Fenced if err.get("type") == "fenced" else cls
            return kind(r.status_code, str(err.get("type")), str(err.get("message")), err.get("field"))
        except (ValueError, KeyError, TypeError, AttributeError):
            return cls(r.status_code, "http_error", r.text[:200])


class Fenced(ServiceCallError):
    """Another client took this namespace over (opened a newer session): this one's steps are refused.

    Two validators are writing one namespace, or this one was restarted elsewhere. The message names
    the other client (its name, host and pid) and when it took over; retrying cannot help.
    """


class Cancelled(ClientError):
    """The caller stopped waiting for the call (a cancelled task, Ctrl-C); nothing more was sent."""


class InvalidNamespace(ClientError, ValueError):
    """A namespace must match `[A-Za-z0-9_-]{1,64}` (it names a folder on the service)."""


class ServiceUnavailable(ClientError):
    """The service gave no usable answer within the retry deadline; the message says what to check."""


class DropInError(ClientError):
    """The openvalidators drop-in cannot do what was asked."""


class WeightsMismatch(DropInError):
    """The validator's reward weights are not the ones the service scores with."""


class StepMismatch(DropInError, ValueError):
    """A reward or mask call disagrees with the step this forward pass already committed."""


__all__ = ["Cancelled", "ClientError", "DropInError", "Fenced", "InvalidNamespace", "ServiceCallError",
           "ServiceUnavailable", "StepMismatch", "WeightsMismatch"]
