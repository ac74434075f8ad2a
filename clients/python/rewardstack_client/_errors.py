"""The exceptions the client raises on purpose, one tree under `ClientError`.

    ClientError
    ├── ServiceCallError      the service answered with an error (HTTP status, type, message, field)
    ├── ServiceUnavailable    no usable answer before the retry deadline (down, restarting, overloaded)
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
            return cls(r.status_code, str(err.get("type")), str(err.get("message")), err.get("field"))
        except (ValueError, KeyError, TypeError, AttributeError):
            return cls(r.status_code, "http_error", r.text[:200])


class ServiceUnavailable(ClientError):
    """The service gave no usable answer within the retry deadline; the message says what to check."""


class DropInError(ClientError):
    """The openvalidators drop-in cannot do what was asked."""


class WeightsMismatch(DropInError):
    """The validator's reward weights are not the ones the service scores with."""


class StepMismatch(DropInError, ValueError):
    """A reward or mask call disagrees with the step this forward pass already committed."""


__all__ = ["ClientError", "DropInError", "ServiceCallError", "ServiceUnavailable", "StepMismatch", "WeightsMismatch"]
