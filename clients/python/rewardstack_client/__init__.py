"""rewardstack-client: the thin client of `rewardstack serve` (httpx only) and the openvalidators drop-in.

    from rewardstack_client import Client
    from rewardstack_client.openvalidators import OpenValidatorsStack

Installs into a validator's own environment (Python 3.8+, any torch, any transformers): it sends
JSON and reads JSON. The scoring, the models and the GPU stay with the service.
"""

from rewardstack_client._client import TOKEN_ENV, AsyncClient, Client
from rewardstack_client._errors import (Cancelled, ClientError, DropInError, Fenced, InvalidNamespace, ServiceCallError,
                                        ServiceUnavailable, StepMismatch, WeightsMismatch)
from rewardstack_client._retry import RETRY_STATUSES, RetryPolicy

__version__ = "0.1.0"

__all__ = ["AsyncClient", "Cancelled", "Client", "ClientError", "DropInError", "Fenced", "InvalidNamespace",
           "RETRY_STATUSES", "RetryPolicy", "ServiceCallError", "ServiceUnavailable", "StepMismatch", "TOKEN_ENV",
           "WeightsMismatch", "__version__"]
