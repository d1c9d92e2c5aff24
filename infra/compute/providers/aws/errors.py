"""EC2 error codes → the launch error classes failover acts on (capacity, quota, price, invalid)."""

from __future__ import annotations

from botocore.exceptions import ClientError, NoCredentialsError, NoRegionError

from infra.compute.providers.base import CapacityError, InvalidRequestError, LaunchError, QuotaError
from infra.compute.providers.cloud_errors import AuthError, retry_later, unreachable

# Another zone, region or a later try may have it.
CAPACITY = frozenset({
    "InsufficientInstanceCapacity", "InsufficientHostCapacity", "InsufficientReservedInstanceCapacity",
    "MaxSpotInstanceCountExceeded", "SpotMaxPriceTooLow", "Unsupported", "UnfulfillableCapacity",
    "InsufficientCapacity", "InsufficientFreeAddressesInSubnet",
})
# The account's limits in this region: more of the same here cannot succeed until the quota is raised.
QUOTA = frozenset({
    "VcpuLimitExceeded", "InstanceLimitExceeded", "MaxSpotFleetRequestCountExceeded", "ResourceLimitExceeded",
    "PlacementGroupLimitExceeded", "SecurityGroupLimitExceeded", "NetworkInterfaceLimitExceeded",
    "VolumeLimitExceeded", "RulesPerSecurityGroupLimitExceeded",
})
AUTH = frozenset({
    "AuthFailure", "UnauthorizedOperation", "InvalidClientTokenId", "SignatureDoesNotMatch", "OptInRequired",
    "Blocked", "PendingVerification", "ExpiredToken", "AccessDenied",
})
# Throttling is retried by botocore itself (its standard retry mode); what still escapes is a capacity-like delay.
THROTTLED = frozenset({"RequestLimitExceeded", "Throttling", "ThrottlingException", "ServiceUnavailable"})
# EC2's own failures (HTTP 5xx): not a refusal of the request, and a later try may succeed.
SERVER_ERRORS = frozenset({"InternalError", "InternalFailure", "Unavailable"})


def error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", "Unknown"))


def classify(exc: Exception, doing: str) -> LaunchError:
    """The launch error for a boto3 failure; the message is one line: what failed, the code, what to do."""
    if isinstance(exc, NoCredentialsError):
        return AuthError(f"aws: no credentials while trying to {doing}: configure them (aws configure, "
                         "AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)")
    if isinstance(exc, NoRegionError):
        return InvalidRequestError(f"aws: no region while trying to {doing}: set cluster.regions or AWS_REGION")
    if not isinstance(exc, ClientError):
        return unreachable("aws", doing, f"{type(exc).__name__}: {exc}")
    code = error_code(exc)
    message = " ".join(str(exc.response.get("Error", {}).get("Message", "")).split())
    said = f"aws: {doing}: {code}: {message}"
    if code in CAPACITY or code in THROTTLED:
        return CapacityError(f"{said}: trying elsewhere")
    if code in QUOTA:
        return QuotaError(f"{said}: raise the quota in Service Quotas or ask for fewer/smaller nodes")
    if code in AUTH:
        return AuthError(f"{said}: check the credentials and their IAM permissions")
    # Before, these were "fix the request": not transient, so a teardown met by a 500 was not tried again.
    if code in SERVER_ERRORS or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) >= 500:
        return retry_later(f"{said}: EC2 failed, retry later")
    return InvalidRequestError(f"{said}: fix the request (config or catalog)")


__all__ = ["AUTH", "CAPACITY", "QUOTA", "AuthError", "CapacityError", "InvalidRequestError", "LaunchError",
           "QuotaError", "classify", "error_code"]
