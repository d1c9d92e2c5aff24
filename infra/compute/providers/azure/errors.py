"""Azure Resource Manager errors → the launch error classes failover acts on (capacity, quota, price, auth, invalid).

They arrive in two shapes, and azure-core raises both as HttpResponseError whose `.error.code` names them:
- a request ARM refuses outright: an HTTP 4xx with `{"error": {"code", "message"}}` (SkuNotAvailable, the quota
  refusal OperationNotAllowed, AuthorizationFailed, InvalidParameter);
- a request ARM accepts (201 + Azure-AsyncOperation) whose operation then ends Failed with the same error object: an
  allocation failure (AllocationFailed, OverconstrainedAllocationRequest, ZonalAllocationFailed), raised by the
  poller.
"""

from __future__ import annotations

from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    ServiceRequestError,
    ServiceResponseError,
)

from infra.compute.providers.base import CapacityError, InvalidRequestError, LaunchError, PriceError, QuotaError
from infra.compute.providers.cloud_errors import AuthError, one_line, retry_later, unreachable

# No capacity for this size here now: another region, size or a later try may have it.
CAPACITY = frozenset({
    "SkuNotAvailable", "AllocationFailed", "OverconstrainedAllocationRequest", "ZonalAllocationFailed",
    "OverconstrainedZonalAllocationRequest", "AllocationFailedVmSizeNotAvailable", "SpotVMEvictedDuringCreation",
})
QUOTA = frozenset({"QuotaExceeded", "OperationNotAllowed", "ResourceQuotaExceeded", "PublicIPCountLimitReached"})
PRICE_WORDS = ("max price", "maxprice", "spot price")
AUTH = frozenset({"AuthorizationFailed", "AuthenticationFailed", "InvalidAuthenticationToken",
                  "InvalidAuthenticationTokenTenant", "LinkedAuthorizationFailed", "SubscriptionNotFound",
                  "MissingSubscriptionRegistration"})
AUTH_FIX = ("give the credentials Contributor on the subscription (or Virtual Machine Contributor and Network "
            "Contributor, and Managed Identity Operator for cluster.azure.identity), and check AZURE_SUBSCRIPTION_ID")
NO_CREDENTIALS_FIX = ("sign in (az login), or set AZURE_CLIENT_ID/AZURE_TENANT_ID/AZURE_CLIENT_SECRET, or run where "
                      "a managed identity is available")


def error_code(exc: BaseException) -> str:
    error = getattr(exc, "error", None)
    return str(getattr(error, "code", None) or "")


def _detail(exc: HttpResponseError) -> str:
    error = exc.error
    message = getattr(error, "message", None) if error is not None else None
    return one_line(str(message or exc.message or exc))


def classify(exc: BaseException, doing: str) -> LaunchError:
    """The launch error for an ARM failure; the message is one line: what failed, the code, what to do."""
    if isinstance(exc, ClientAuthenticationError) and not getattr(exc, "status_code", None):
        return AuthError(f"azure: no usable credentials while trying to {doing} ({one_line(str(exc))[:300]}): "
                         f"{NO_CREDENTIALS_FIX}")
    if isinstance(exc, ServiceRequestError | ServiceResponseError) or not isinstance(exc, HttpResponseError):
        return unreachable("azure", doing, f"{type(exc).__name__}: {one_line(str(exc))[:300]}")
    code = error_code(exc) or str(exc.status_code or "")
    said = f"azure: {doing}: {code}: {_detail(exc)}"
    lowered = said.lower()
    if any(word in lowered for word in PRICE_WORDS):
        return PriceError(f"{said}: raise cluster.max_price_per_hour or use regular VMs")
    if code in QUOTA and (code != "OperationNotAllowed" or "quota" in lowered):
        return QuotaError(f"{said}: request more quota (portal: Subscriptions > Usage + quotas, the family and "
                          "region are named above) or ask for fewer/smaller nodes")
    if code in CAPACITY:
        return CapacityError(f"{said}: trying elsewhere")
    if code in ("TooManyRequests", "RetryableError") or exc.status_code == 429:
        return CapacityError(f"{said}: throttled, trying elsewhere")
    if code in AUTH or exc.status_code in (401, 403):
        return AuthError(f"{said}: {AUTH_FIX}")
    if (exc.status_code or 0) >= 500:
        return retry_later(f"{said}: Azure failed, retry later")
    return InvalidRequestError(f"{said}: fix the request (config or catalog)")


API_ERRORS = (AzureError,)

__all__ = ["API_ERRORS", "AUTH", "CAPACITY", "QUOTA", "AuthError", "CapacityError", "InvalidRequestError",
           "LaunchError", "PriceError", "QuotaError", "classify", "error_code"]
