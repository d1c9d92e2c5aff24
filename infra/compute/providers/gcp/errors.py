"""Compute Engine errors → the launch error classes failover acts on (capacity, quota, auth, invalid).

They arrive in two shapes, and `classify` reads both:
- A request Compute Engine accepts but cannot fulfil (a stockout, most quota refusals) answers HTTP 200 with an
  operation that later ends DONE carrying `error.errors[].code` (ZONE_RESOURCE_POOL_EXHAUSTED, QUOTA_EXCEEDED) and
  `httpErrorStatusCode` (503, 403). `operation_error` turns such an operation into the exception google-api-core's
  ExtendedOperation.result() would raise: `from_http_status(httpErrorStatusCode, …, errors=error.errors)`.
- A request it refuses outright (no permission, a malformed body, some quota checks, throttling) is an HTTP 4xx/5xx
  whose JSON `error.errors[].reason` names it (forbidden, quotaExceeded, badRequest, rateLimitExceeded);
  google-api-core raises that as a GoogleAPICallError subclass whose `.errors` are those dicts.
"""

from __future__ import annotations

from typing import Any

import requests
from google.api_core import exceptions
from google.auth import exceptions as auth_exceptions

from infra.compute.providers.base import CapacityError, InvalidRequestError, LaunchError, QuotaError
from infra.compute.providers.cloud_errors import AuthError, one_line, retry_later, unreachable

# Another zone, region or a later try may have it. UNSUPPORTED_OPERATION is what an insert reports when a Spot VM
# is preempted while it is being created (SkyPilot observed it and treats it per zone; Google does not document it).
CAPACITY = frozenset({
    "ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS", "REGION_RESOURCE_POOL_EXHAUSTED",
    "RESOURCE_POOL_EXHAUSTED", "GCE_STOCKOUT", "STOCKOUT", "UNSUPPORTED_OPERATION", "insufficientCapacity",
})
# Wording of a stockout when the code is missing or unfamiliar (messages of both ZONE_RESOURCE_POOL_EXHAUSTED codes).
CAPACITY_WORDS = ("resource pool exhausted", "does not have enough resources available", "stockout")
# The project's limits (GPUs, CPUs, addresses, local SSD per region): more of the same here fails until raised.
QUOTA = frozenset({"QUOTA_EXCEEDED", "quotaExceeded", "limitExceeded", "REGION_QUOTA_EXCEEDED"})
# Throttling: a later try succeeds. The API call itself is retried with backoff first (see is_transient).
THROTTLED = frozenset({
    "rateLimitExceeded", "userRateLimitExceeded", "RATE_LIMIT_EXCEEDED", "RESOURCE_OPERATION_RATE_EXCEEDED",
    "CONCURRENT_OPERATIONS_QUOTA_EXCEEDED", "RESOURCE_NOT_READY", "resourceNotReady",
})
AUTH = frozenset({
    "forbidden", "insufficientPermissions", "IAM_PERMISSION_DENIED", "PERMISSION_DENIED", "authError",
    "unauthorized", "required", "ACCESS_TOKEN_SCOPE_INSUFFICIENT",
})
API_DISABLED = frozenset({"accessNotConfigured", "SERVICE_DISABLED"})
TRANSIENT_HTTP = (exceptions.InternalServerError, exceptions.BadGateway, exceptions.ServiceUnavailable,
                  exceptions.GatewayTimeout, exceptions.TooManyRequests, exceptions.DeadlineExceeded)
AUTH_FIX = ("grant the credentials roles/compute.instanceAdmin.v1 and roles/iam.serviceAccountUser on the project "
            "(and check the project: TRAINPIPE_GCP_PROJECT)")
NO_CREDENTIALS_FIX = ("run `gcloud auth application-default login` or set GOOGLE_APPLICATION_CREDENTIALS to a "
                      "service account key")


def _item(entry: Any, *names: str) -> str:
    """A field of one entry of `.errors`: a dict from an HTTP error, a compute_v1.Errors from an operation."""
    for name in names:
        value = entry.get(name) if isinstance(entry, dict) else getattr(entry, name, None)
        if value:
            return str(value)
    return ""


def error_codes(exc: BaseException) -> list[str]:
    """The GCP codes an error carries: operation `errors[].code`, HTTP `errors[].reason`, the ErrorInfo reason."""
    if not isinstance(exc, exceptions.GoogleAPICallError):
        return []
    codes = [_item(entry, "code", "reason") for entry in exc.errors or ()]
    if exc.reason:
        codes.append(str(exc.reason))
    return [code for code in codes if code]


def _detail(exc: exceptions.GoogleAPICallError) -> str:
    messages = [_item(entry, "message") for entry in exc.errors or ()]
    return one_line(next((m for m in messages if m), exc.message or str(exc)))


def operation_error(operation: Any) -> exceptions.GoogleAPICallError | None:
    """The error a finished compute_v1.Operation carries, shaped as ExtendedOperation.result() raises it; None when
    it succeeded. An error without an HTTP status (never seen, but the fields are optional) counts as a 500."""
    errors = list(operation.error.errors) if operation.error else []
    status = int(operation.http_error_status_code or 0)
    if not errors and not status:
        return None
    message = operation.http_error_message or (errors[0].message if errors else "operation failed")
    return exceptions.from_http_status(status or 500, message, errors=errors, response=operation)


def is_transient(exc: BaseException) -> bool:
    """Worth repeating the same API call: throttling, 5xx, a dropped connection. Never a refused launch: those come
    back in operations (operation_error), not from the call that is repeated."""
    if isinstance(exc, TRANSIENT_HTTP):
        return True
    if isinstance(exc, exceptions.Forbidden):
        return any(code in THROTTLED for code in error_codes(exc))
    return isinstance(exc, requests.ConnectionError | requests.Timeout | auth_exceptions.TransportError)


def classify(exc: BaseException, doing: str) -> LaunchError:
    """The launch error for a Compute Engine failure; the message is one line: what failed, the code, what to do."""
    if isinstance(exc, auth_exceptions.DefaultCredentialsError):
        return AuthError(f"gcp: no credentials while trying to {doing}: {NO_CREDENTIALS_FIX}")
    if isinstance(exc, auth_exceptions.RefreshError):
        return AuthError(f"gcp: the credentials were refused while trying to {doing} ({one_line(str(exc))}): "
                         f"{NO_CREDENTIALS_FIX}")
    if not isinstance(exc, exceptions.GoogleAPICallError):
        return unreachable("gcp", doing, f"{type(exc).__name__}: {one_line(str(exc))}")
    codes = error_codes(exc)
    status = int(exc.code or 0)
    code = codes[0] if codes else str(status)
    said = f"gcp: {doing}: {code}: {_detail(exc)}"
    if any(c in CAPACITY for c in codes) or any(w in said.lower() for w in CAPACITY_WORDS):
        return CapacityError(f"{said}: trying elsewhere")
    if any(c in THROTTLED for c in codes):
        return CapacityError(f"{said}: throttled, trying elsewhere")
    if any(c in QUOTA or "quota" in c.lower() for c in codes):
        return QuotaError(f"{said}: request more quota (console.cloud.google.com/iam-admin/quotas, the metric and "
                          "region are named above) or ask for fewer/smaller nodes")
    if any(c in API_DISABLED for c in codes):
        return AuthError(f"{said}: enable the API (gcloud services enable compute.googleapis.com)")
    if status in (401, 403) or any(c in AUTH for c in codes):
        return AuthError(f"{said}: {AUTH_FIX}")
    if status >= 500:
        return retry_later(f"{said}: Compute Engine failed, retry later")
    return InvalidRequestError(f"{said}: fix the request (config or catalog)")


__all__ = ["AUTH", "CAPACITY", "QUOTA", "THROTTLED", "AuthError", "CapacityError", "InvalidRequestError",
           "LaunchError", "QuotaError", "classify", "error_codes", "is_transient", "operation_error"]
