"""Nebius API failures → the launch error classes failover acts on (capacity, quota, auth, invalid).

A failure arrives as the SDK's RequestError (the call itself was refused: bad argument, no permission, throttled)
or OperationError (the call was accepted and its operation ended badly: no GPUs left in the fabric, a quota). Both
carry a gRPC status code and Nebius's ServiceError details, whose kind says what happened: `not_enough_resources`
(capacity), `quota_failure`, `permission_denied`, `too_many_requests`, `bad_request`... A RESOURCE_EXHAUSTED without
details is told apart by its message (quota or not).
"""

from __future__ import annotations

from typing import Any

from infra.compute.providers.base import CapacityError, InvalidRequestError, LaunchError, QuotaError
from infra.compute.providers.cloud_errors import AuthError, one_line, retry_later, unreachable

CAPACITY_KINDS = frozenset({"not_enough_resources"})
QUOTA_KINDS = frozenset({"quota_failure"})
THROTTLED_KINDS = frozenset({"too_many_requests"})
AUTH_KINDS = frozenset({"permission_denied"})
# Codes (StatusCode names) after which the same call may succeed: the API or the network hiccuped.
TRANSIENT_CODES = frozenset({"UNAVAILABLE", "INTERNAL", "DEADLINE_EXCEEDED", "ABORTED", "UNKNOWN"})
AUTH_CODES = frozenset({"PERMISSION_DENIED", "UNAUTHENTICATED"})
NOT_FOUND = "NOT_FOUND"
AUTH_FIX = ("give the credentials' service account the editor role on the project (and check "
            "TRAINPIPE_NEBIUS_PROJECTS names the project of each region)")
NO_CREDENTIALS_FIX = ("set TRAINPIPE_NEBIUS_CREDENTIALS_FILE to a service account's credentials.json (nebius iam "
                      "auth-public-key generate), or NEBIUS_IAM_TOKEN, or log in with the nebius CLI")


def status_code(exc: BaseException) -> str:
    """The gRPC status code name an SDK error carries ("" for anything else)."""
    status = getattr(exc, "status", None)
    code = getattr(status, "code", None)
    return str(getattr(code, "name", "") or "")


def error_kinds(exc: BaseException) -> list[str]:
    """The kinds of the ServiceError details an SDK error carries (not_enough_resources, quota_failure, ...)."""
    status = getattr(exc, "status", None)
    kinds = []
    for error in getattr(status, "service_errors", None) or ():
        kind = error.which_field_in_oneof("details")
        if kind:
            kinds.append(str(kind))
    return kinds


def _message(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    return one_line(str(getattr(status, "message", None) or exc))


def is_sdk_error(exc: BaseException) -> bool:
    from nebius.base.error import SDKError

    return isinstance(exc, SDKError)


def is_transient(exc: BaseException) -> bool:
    """Worth repeating the same call: throttling, the API unavailable, a dropped connection. Never a refused
    launch (capacity, quota): those are failover's to act on."""
    if set(error_kinds(exc)) & THROTTLED_KINDS:
        return True
    return status_code(exc) in TRANSIENT_CODES or isinstance(exc, ConnectionError | TimeoutError)


def is_not_found(exc: BaseException) -> bool:
    return status_code(exc) == NOT_FOUND


def classify(exc: BaseException, doing: str) -> LaunchError:
    """The launch error for a Nebius failure; the message is one line: what failed, the code, what to do."""
    code, kinds = status_code(exc), error_kinds(exc)
    if not code:
        # Not an API answer (no credentials found, the connection gone): another try later may succeed, unless
        # the SDK says there are no credentials.
        text = one_line(f"{type(exc).__name__}: {exc}")
        if "credential" in text.lower() or "token" in text.lower():
            return AuthError(f"nebius: no usable credentials while trying to {doing} ({text}): {NO_CREDENTIALS_FIX}")
        return unreachable("nebius", doing, text)
    said = f"nebius: {doing}: {code}{' (' + ', '.join(kinds) + ')' if kinds else ''}: {_message(exc)}"
    exhausted = code == "RESOURCE_EXHAUSTED"
    if set(kinds) & QUOTA_KINDS or (exhausted and not kinds and "quota" in said.lower()):
        return QuotaError(f"{said}: request more quota (console: Administration → Quotas, for the region named "
                          "above) or ask for fewer nodes")
    if set(kinds) & CAPACITY_KINDS or exhausted:
        return CapacityError(f"{said}: trying elsewhere")
    if set(kinds) & THROTTLED_KINDS:
        return CapacityError(f"{said}: throttled, trying elsewhere")
    if set(kinds) & AUTH_KINDS or code in AUTH_CODES:
        return AuthError(f"{said}: {AUTH_FIX}")
    if code in TRANSIENT_CODES:
        return retry_later(f"{said}: the Nebius API failed, retry later")
    return InvalidRequestError(f"{said}: fix the request (config or catalog)")


def describe(exc: Any) -> str:
    """One line for a log: the code and message of an SDK error, else the exception."""
    code = status_code(exc)
    return f"{code}: {_message(exc)}" if code else one_line(f"{type(exc).__name__}: {exc}")


__all__ = ["AuthError", "CapacityError", "InvalidRequestError", "LaunchError", "QuotaError", "classify",
           "error_kinds", "is_not_found", "is_sdk_error", "is_transient", "status_code"]
