"""The client of the scoring service (`rewardstack serve`): `rewardstack_client`, under its old name.

The code lives in clients/python (distribution `rewardstack-client`, httpx only, Python 3.8+),
which a validator installs into its own environment; rewardstack ships the same package, so this
module only re-exports it (one implementation). See `rewardstack_client` for the API.
"""

from __future__ import annotations

from rewardstack_client import (RETRY_STATUSES, TOKEN_ENV, AsyncClient, Client, ClientError, RetryPolicy,
                                ServiceCallError, ServiceUnavailable)

__all__ = ["AsyncClient", "Client", "ClientError", "RETRY_STATUSES", "RetryPolicy", "ServiceCallError",
           "ServiceUnavailable", "TOKEN_ENV"]
