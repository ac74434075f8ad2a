"""The client of the scoring service (`rewardstack serve`), as `rewardstack.client`.

The code is the distribution `rewardstack-client` (clients/python: httpx only, Python 3.8+), which a
validator installs into its own environment and rewardstack depends on; this module re-exports
it. See `rewardstack_client` for the API.
"""

from __future__ import annotations

from rewardstack_client import (RETRY_STATUSES, TOKEN_ENV, AsyncClient, Cancelled, Client, ClientError, Fenced,
                                InvalidNamespace, RetryPolicy, ServiceCallError, ServiceUnavailable)

__all__ = ["AsyncClient", "Cancelled", "Client", "ClientError", "Fenced", "InvalidNamespace", "RETRY_STATUSES",
           "RetryPolicy", "ServiceCallError", "ServiceUnavailable", "TOKEN_ENV"]
