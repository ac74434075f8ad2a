"""The service's one error type: an HTTP status, a machine-readable type, a message and a field.

Every refusal on a request path raises `ServiceError` (or a library error the app maps to one);
the app's exception handlers are the one place that turns them into the JSON body
`{"error": {"message", "type", "field"}}`.
"""

from __future__ import annotations

from rewardstack._wire import error_body


class ServiceError(Exception):
    """An HTTP error answer: `status`, `type` (e.g. `queue_full`), message, the field it is about."""

    def __init__(self, status: int, type: str, message: str, *, field: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.message = message
        self.field = field
        self.headers = headers or {}

    def __reduce__(self) -> tuple:
        # Rebuilt whole when pickled: Ray Serve's state actors return refusals to the replicas.
        return (ServiceError, (self.status, self.type, self.message), {"field": self.field, "headers": self.headers})

    def body(self) -> dict:
        """The JSON body of the answer."""
        return error_body(self.message, self.type, self.field)
