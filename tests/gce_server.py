"""A simulated Compute Engine control plane: a stdlib HTTP server on a free loopback port, in a thread.

The real GCE control plane cannot be reached from here (no network, no project, no credentials), and no emulator of
it exists, so the GCP provider's tests run against this stand-in. It serves exactly the Compute REST (v1) endpoints
the provider calls, with the JSON shapes of the real API (kinds, selfLinks, operations, aggregated lists):

- zones/{zone}/instances: insert, get, list, delete, setLabels (guarded by labelFingerprint); aggregated/instances
- regions/{region}/resourcePolicies: insert, get, delete; aggregated/resourcePolicies
- zones/{zone}/operations/{name} and regions/{region}/operations/{name}: get and wait
- global/images/family/{family} of the public image projects (images.getFromFamily): `public_images`, by default the
  Deep Learning VM family the provider boots when told no image

Operations come back PENDING and are DONE from their first poll; instances go PROVISIONING → STAGING → RUNNING, one
step per read. The rules of GCE that the provider must respect are enforced: RFC 1035 names, label keys and values,
one boot disk, a placement policy that exists in the zone's region, requestId deduplication, and no deleting a
resource policy an instance still uses (400 resourceInUseByAnotherResource), so the teardown order is really tested.

It also answers OAuth's token endpoint (POST /token), so a service-account key file whose token_uri points here gives
a process of its own (an orchestrator started as a command) credentials the way Google's would. Instances' external
addresses come from `nat_prefix` when one is given (where tests run a stand-in for their machines), their first
interface's VPC addresses from `network_prefix`.

Faults are injected with `fail()` and arrive as they do from GCE: a stockout or a quota refusal is an HTTP 200 insert
whose operation ends DONE with `error.errors[0].code` (ZONE_RESOURCE_POOL_EXHAUSTED, QUOTA_EXCEEDED) and
`httpErrorStatusCode`; a permission, validation or throttling refusal (given `http_status`) is an HTTP 4xx/5xx JSON
error whose `errors[0].reason` is the code (forbidden, badRequest, quotaExceeded, backendError). An outage of the
instance reads (get, list, aggregated list: what the run's preemption watch reads) is started with `outage.start()`
(tests/outage.py): 503 backendError, then 429 rateLimitExceeded, as Compute Engine answers them.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from fault_budget import FaultBudget
from http_stub import Served, StandIn
from outage import ERRORS, OutageSwitch

PROJECT = "trainpipe-test"
# (project, family) → the newest image's name, as Google publishes them.
PUBLIC_IMAGES = {("deeplearning-platform-release", "common-cu128-ubuntu-2204-nvidia-570"):
                 "common-cu128-ubuntu-2204-nvidia-570-v20250101"}
API = "https://www.googleapis.com/compute/v1"
NAME = re.compile(r"^[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?$")
LABEL_KEY = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
LABEL_VALUE = re.compile(r"^[a-z0-9_-]{0,63}$")
FILTER = re.compile(r'^\s*labels\.([a-z][a-z0-9_-]*)\s*(?:=\s*"([^"]*)"|(:)\s*\*)\s*$')
POLICY_REF = re.compile(r"(?:^|/)projects/([^/]+)/regions/([^/]+)/resourcePolicies/([^/]+)$")
# Refusals GCE reports in the operation of an accepted insert: (httpErrorStatusCode, httpErrorMessage).
OPERATION_ERRORS = {
    "ZONE_RESOURCE_POOL_EXHAUSTED": (503, "SERVICE UNAVAILABLE"),
    "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS": (503, "SERVICE UNAVAILABLE"),
    "QUOTA_EXCEEDED": (403, "FORBIDDEN"),
    "UNSUPPORTED_OPERATION": (400, "BAD REQUEST"),
}


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _region(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


class ApiError(Exception):
    """An HTTP error answer, shaped as Google APIs shape them."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.status, "message": self.message,
                          "errors": [{"message": self.message, "domain": "global", "reason": self.reason}]}}


@dataclass
class Fault(FaultBudget):
    """Refuse instance inserts that match (zone, or every zone of region; spot, on-demand or both): the first
    `after_n_ok_inserts` matching ones pass, then `times` of them (None: all) fail with `code`."""

    code: str
    zone: str | None = None
    region: str | None = None
    spot: bool | None = None
    after_n_ok_inserts: int = 0
    times: int | None = None
    http_status: int | None = None
    message: str | None = None
    passed: int = 0
    fired: int = 0

    def matches(self, zone: str, spot: bool) -> bool:
        return ((self.zone is None or self.zone == zone) and (self.region is None or self.region == _region(zone))
                and (self.spot is None or self.spot == spot))

    def fires(self) -> bool:
        """Counts one matching insert; whether this one fails."""
        return self._fires_after(self.after_n_ok_inserts)


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    query: dict[str, str]
    body: dict[str, Any] | None
    status: int
    authorization: str | None = None


@dataclass
class _State:
    instances: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # (zone, name)
    policies: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # (region, name)
    operations: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # (scope path, name)
    pending_errors: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    request_ids: dict[str, dict[str, Any]] = field(default_factory=dict)
    zones_seen: set[str] = field(default_factory=set)
    faults: list[Fault] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)


class GceServer(StandIn):
    def __init__(self, project: str = PROJECT, nat_prefix: str | None = None,
                 network_prefix: str | None = None, public_images: dict[tuple[str, str], str] | None = None) -> None:
        self.project = project
        self.public_images = dict(PUBLIC_IMAGES if public_images is None else public_images)
        self.nat_prefix = nat_prefix
        # The first interface's VPC address (networkIP) from this prefix, where tests run stand-ins: distinct from the
        # NAT address, so that a node-to-node service bound to the wrong one is seen (tests/cloud_nodes.py).
        self.network_prefix = network_prefix
        self._network_numbers = itertools.count(1)
        self.tokens: list[str] = []  # access tokens handed out by /token
        self._nat_numbers = itertools.count(1)
        self._state = _State()
        self._lock = threading.Lock()
        self._ids = itertools.count(1000)
        self._httpd: Served | None = None
        self.outage = OutageSwitch()

    # -- lifecycle ----------------------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        assert self._httpd is not None, "the server is not started"
        return f"http://127.0.0.1:{self._httpd.port}"

    def start(self) -> GceServer:
        handler = type("Handler", (_Handler,), {"gce": self})
        self._httpd = Served(handler, "gce-server")
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.stop()

    def reset(self) -> None:
        with self._lock:
            self._state = _State()
            self.outage.end()

    # -- what tests use -----------------------------------------------------------------------------------------

    def fail(self, code: str, *, zone: str | None = None, region: str | None = None, spot: bool | None = None,
             after_n_ok_inserts: int = 0, times: int | None = None, http_status: int | None = None,
             message: str | None = None) -> Fault:
        fault = Fault(code, zone, region, spot, after_n_ok_inserts, times, http_status, message)
        with self._lock:
            self._state.faults.append(fault)
        return fault

    def preempt(self, zone: str, name: str) -> None:
        """What GCE does to a Spot VM it reclaims: STOPPING, stamped, for the notice period before the delete."""
        with self._lock:
            instance = self._state.instances[(zone, name)]
            instance["status"] = "STOPPING"
            instance["lastStopTimestamp"] = _now()

    def instances(self, zone: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [copy.deepcopy(i) for (z, _), i in sorted(self._state.instances.items()) if zone in (None, z)]

    def policies(self, region: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [copy.deepcopy(p) for (r, _), p in sorted(self._state.policies.items()) if region in (None, r)]

    def calls(self, method: str | None = None, path: str = "") -> list[Call]:
        """The requests served so far; `path` is a regular expression searched in the request path."""
        with self._lock:
            return [c for c in self._state.calls if method in (None, c.method) and re.search(path, c.path)]

    def clear_calls(self) -> None:
        with self._lock:
            self._state.calls.clear()

    # -- the API ------------------------------------------------------------------------------------------------

    def handle(self, method: str, target: str, body: dict[str, Any] | None,
               authorization: str | None = None) -> tuple[int, dict[str, Any]]:
        parts = urlsplit(target)
        query = dict(parse_qsl(parts.query))
        with self._lock:
            try:
                self._out_of_service(method, parts.path)
                status, answer = 200, self._route(method, parts.path, query, body)
            except ApiError as exc:
                status, answer = exc.status, exc.body()
            self._state.calls.append(Call(method, parts.path, query, body, status, authorization))
        return status, answer

    def token(self) -> dict[str, Any]:
        """OAuth's answer to a service account's JWT bearer grant (the assertion is not checked)."""
        with self._lock:
            self.tokens.append(f"ya29.fake-{uuid.uuid4().hex}")
            return {"access_token": self.tokens[-1], "expires_in": 3600, "token_type": "Bearer"}

    def _out_of_service(self, method: str, path: str) -> None:
        if method != "GET" or not re.search(r"/(zones/[^/]+|aggregated)/instances(/[^/]+)?$", path):
            return
        phase = self.outage.phase()
        if phase == ERRORS:
            raise ApiError(503, "backendError", "Backend Error")
        if phase is not None:
            raise ApiError(429, "rateLimitExceeded", "Rate Limit Exceeded")

    def _route(self, method: str, path: str, query: dict[str, str], body: dict[str, Any] | None) -> dict[str, Any]:
        match = re.match(r"^/compute/v1/projects/([^/]+)/(.*)$", path)
        if not match:
            raise ApiError(404, "notFound", f"no such path: {path}")
        family = re.fullmatch(r"global/images/family/([^/]+)", match.group(2))
        if family and method == "GET":
            return self._image_from_family(match.group(1), family.group(1))
        if match.group(1) != self.project:
            raise ApiError(404, "notFound", f"The resource 'projects/{match.group(1)}' was not found")
        rest = match.group(2)
        routes: list[tuple[str, str, Callable[..., dict[str, Any]]]] = [
            ("POST", r"zones/([^/]+)/instances", self._insert_instance),
            ("GET", r"zones/([^/]+)/instances", self._list_instances),
            ("GET", r"zones/([^/]+)/instances/([^/]+)", self._get_instance),
            ("DELETE", r"zones/([^/]+)/instances/([^/]+)", self._delete_instance),
            ("POST", r"zones/([^/]+)/instances/([^/]+)/setLabels", self._set_labels),
            ("GET", r"aggregated/instances", self._aggregated_instances),
            ("POST", r"regions/([^/]+)/resourcePolicies", self._insert_policy),
            ("GET", r"regions/([^/]+)/resourcePolicies/([^/]+)", self._get_policy),
            ("DELETE", r"regions/([^/]+)/resourcePolicies/([^/]+)", self._delete_policy),
            ("GET", r"aggregated/resourcePolicies", self._aggregated_policies),
            ("GET", r"((?:zones|regions)/[^/]+)/operations/([^/]+)", self._get_operation),
            ("POST", r"((?:zones|regions)/[^/]+)/operations/([^/]+)/wait", self._get_operation),
        ]
        for verb, pattern, action in routes:
            found = re.fullmatch(pattern, rest)
            if found and verb == method:
                return action(*found.groups(), query=query, body=body)
        raise ApiError(404, "notFound", f"no such method: {method} {path}")

    def _url(self, path: str) -> str:
        return f"{API}/projects/{self.project}/{path}"

    def _image_from_family(self, project: str, family: str) -> dict[str, Any]:
        name = self.public_images.get((project, family))
        if name is None:
            raise ApiError(404, "notFound", f"The resource 'projects/{project}/global/images/family/{family}' was "
                           "not found")
        return {"kind": "compute#image", "id": str(abs(hash(name)) % 10**18), "name": name, "family": family,
                "status": "READY", "selfLink": f"{API}/projects/{project}/global/images/{name}"}

    def _operation(self, scope: str, kind: str, target: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        name = f"operation-{next(self._ids)}-{uuid.uuid4().hex[:12]}"
        scope_kind = "zone" if scope.startswith("zones/") else "region"
        operation = {
            "kind": "compute#operation", "id": str(next(self._ids)), "name": name, scope_kind: self._url(scope),
            "operationType": kind, "targetLink": self._url(target), "status": "PENDING", "progress": 0,
            "user": "trainpipe-test@example.iam.gserviceaccount.com", "insertTime": _now(),
            "selfLink": self._url(f"{scope}/operations/{name}"),
        }
        self._state.operations[(scope, name)] = operation
        if error is not None:
            self._state.pending_errors[(scope, name)] = error
        return copy.deepcopy(operation)

    def _get_operation(self, scope: str, name: str, **_: Any) -> dict[str, Any]:
        operation = self._state.operations.get((scope, name))
        if operation is None:
            raise ApiError(404, "notFound", f"The resource '{self._url(f'{scope}/operations/{name}')}' was not found")
        if operation["status"] != "DONE":
            operation.update(status="DONE", progress=100, startTime=operation["insertTime"], endTime=_now())
            operation.update(self._state.pending_errors.pop((scope, name), {}))
        return copy.deepcopy(operation)

    # -- instances ----------------------------------------------------------------------------------------------

    def _insert_instance(self, zone: str, query: dict[str, str], body: dict[str, Any] | None) -> dict[str, Any]:
        request_id = query.get("requestId")
        if request_id and request_id in self._state.request_ids:
            return copy.deepcopy(self._state.request_ids[request_id])  # GCE answers a repeated request once
        self._state.zones_seen.add(zone)
        instance = self._valid_instance(zone, body or {})
        name = instance["name"]
        spot = instance.get("scheduling", {}).get("provisioningModel") == "SPOT"
        fault = next((f for f in self._state.faults if f.matches(zone, spot) and f.fires()), None)
        target = f"zones/{zone}/instances/{name}"
        if fault is not None and fault.http_status is not None:
            raise ApiError(fault.http_status, fault.code, self._message(fault, zone, name, spot))
        if fault is not None:
            operation = self._operation(f"zones/{zone}", "insert", target, self._operation_error(fault, zone, name,
                                                                                                 spot))
        else:
            self._state.instances[(zone, name)] = self._created(zone, instance)
            operation = self._operation(f"zones/{zone}", "insert", target)
        if request_id:
            self._state.request_ids[request_id] = operation
        return operation

    def _valid_instance(self, zone: str, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("name", "")
        if not NAME.match(name):
            raise ApiError(400, "invalid", f"Invalid value for field 'resource.name': '{name}'. Must be a match of "
                           f"regex '{NAME.pattern}'")
        if (zone, name) in self._state.instances:
            raise ApiError(409, "alreadyExists", f"The resource 'projects/{self.project}/zones/{zone}/instances/"
                           f"{name}' already exists")
        for key, value in body.get("labels", {}).items():
            if not LABEL_KEY.match(key) or not LABEL_VALUE.match(value):
                raise ApiError(400, "invalid", f"Invalid value for field 'resource.labels': '{key}={value}'")
        if not re.fullmatch(rf"(?:.*/)?zones/{zone}/machineTypes/[a-z0-9-]+", body.get("machineType", "")):
            raise ApiError(400, "invalid", f"Invalid value for field 'resource.machineType': "
                           f"'{body.get('machineType')}'")
        disks = body.get("disks", [])
        if sum(1 for d in disks if d.get("boot")) != 1:
            raise ApiError(400, "invalid", "Invalid value for field 'resource.disks': exactly one boot disk")
        for disk in disks:
            if disk.get("type") == "SCRATCH" and not disk.get("initializeParams", {}).get("diskType", "").endswith(
                    f"zones/{zone}/diskTypes/local-ssd"):
                raise ApiError(400, "invalid", "Invalid value for field 'resource.disks': a SCRATCH disk must be "
                               "of type local-ssd in the instance's zone")
        if not body.get("networkInterfaces"):
            raise ApiError(400, "invalid", "Invalid value for field 'resource.networkInterfaces': none")
        for ref in body.get("resourcePolicies", []):
            found = POLICY_REF.search(ref)
            if not found or found.group(2) != _region(zone) or (found.group(2), found.group(3)) not in \
                    self._state.policies:
                raise ApiError(404, "notFound", f"The resource '{ref}' was not found")
        return body

    def _created(self, zone: str, body: dict[str, Any]) -> dict[str, Any]:
        number = next(self._ids)
        instance = copy.deepcopy(body)
        instance.update(
            kind="compute#instance", id=str(number), creationTimestamp=_now(), status="PROVISIONING",
            zone=self._url(f"zones/{zone}"), selfLink=self._url(f"zones/{zone}/instances/{body['name']}"),
            machineType=self._url(f"zones/{zone}/machineTypes/{body['machineType'].rsplit('/', 1)[-1]}"),
            labelFingerprint=uuid.uuid4().hex[:12],
            resourcePolicies=[self._policy_link(ref) for ref in body.get("resourcePolicies", [])])
        instance["metadata"] = {"kind": "compute#metadata", "fingerprint": uuid.uuid4().hex[:12],
                                **body.get("metadata", {})}
        instance["scheduling"] = {"provisioningModel": "STANDARD", "automaticRestart": True,
                                  "onHostMaintenance": "MIGRATE", **body.get("scheduling", {})}
        for index, nic in enumerate(instance["networkInterfaces"]):
            private = (f"{self.network_prefix}{next(self._network_numbers)}" if self.network_prefix and index == 0
                       else f"10.128.{index}.{number % 250}")
            nic.update(kind="compute#networkInterface", name=f"nic{index}", networkIP=private)
            nat = (f"{self.nat_prefix}{next(self._nat_numbers)}" if self.nat_prefix
                   else f"34.1.{number // 250 % 250}.{number % 250}")
            for access in nic.get("accessConfigs", []):
                access.update(kind="compute#accessConfig", natIP=nat, networkTier="PREMIUM")
        for index, disk in enumerate(instance["disks"]):
            scratch = disk.get("type") == "SCRATCH"
            disk.update(kind="compute#attachedDisk", index=index, mode="READ_WRITE",
                        type="SCRATCH" if scratch else "PERSISTENT",
                        deviceName=f"local-ssd-{index - 1}" if scratch else "persistent-disk-0")
        return instance

    def _policy_link(self, ref: str) -> str:
        """The full URL GCE stores for a policy reference given as a URL or a partial path (checked valid before)."""
        found = POLICY_REF.search(ref)
        assert found is not None
        return self._url(f"regions/{found.group(2)}/resourcePolicies/{found.group(3)}")

    def _message(self, fault: Fault, zone: str, name: str, spot: bool) -> str:
        if fault.message:
            return fault.message
        metric = f"{'PREEMPTIBLE_' if spot else ''}NVIDIA_A100_GPUS"
        return {
            "ZONE_RESOURCE_POOL_EXHAUSTED": f"The zone 'projects/{self.project}/zones/{zone}' does not have enough "
                                            "resources available to fulfill the request.  Try a different zone, or "
                                            "try again later.",
            "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS": f"The zone 'projects/{self.project}/zones/{zone}' does not "
                                                         "have enough resources available to fulfill the request.  "
                                                         "'(resource type:compute)'.",
            "QUOTA_EXCEEDED": f"Quota '{metric}' exceeded.  Limit: 0.0 in region {_region(zone)}.",
            "quotaExceeded": f"Quota '{metric}' exceeded.  Limit: 0.0 in region {_region(zone)}.",
            "forbidden": f"Required 'compute.instances.create' permission for 'projects/{self.project}/zones/{zone}/"
                         f"instances/{name}'",
        }.get(fault.code, f"injected {fault.code}")

    def _operation_error(self, fault: Fault, zone: str, name: str, spot: bool) -> dict[str, Any]:
        status, status_message = OPERATION_ERRORS.get(fault.code, (400, "BAD REQUEST"))
        error: dict[str, Any] = {"code": fault.code, "message": self._message(fault, zone, name, spot)}
        if fault.code == "QUOTA_EXCEEDED":
            metric = f"{'PREEMPTIBLE_' if spot else ''}NVIDIA_A100_GPUS"
            error["errorDetails"] = [{"quotaInfo": {
                "metricName": f"compute.googleapis.com/{metric.lower()}", "limitName": f"{metric}-per-project-region",
                "dimensions": {"region": _region(zone)}, "limit": 0}}]
        return {"error": {"errors": [error]}, "httpErrorStatusCode": status, "httpErrorMessage": status_message}

    def _read(self, instance: dict[str, Any]) -> dict[str, Any]:
        """The instance as this read sees it; a starting instance then moves one step on."""
        seen = copy.deepcopy(instance)
        instance["status"] = {"PROVISIONING": "STAGING", "STAGING": "RUNNING"}.get(instance["status"],
                                                                                   instance["status"])
        return seen

    def _instance(self, zone: str, name: str) -> dict[str, Any]:
        instance = self._state.instances.get((zone, name))
        if instance is None:
            raise ApiError(404, "notFound", f"The resource 'projects/{self.project}/zones/{zone}/instances/{name}' "
                           "was not found")
        return instance

    def _get_instance(self, zone: str, name: str, **_: Any) -> dict[str, Any]:
        return self._read(self._instance(zone, name))

    @staticmethod
    def _selected(query: dict[str, str]) -> Callable[[dict[str, Any]], bool]:
        text = query.get("filter")
        if not text:
            return lambda _: True
        match = FILTER.match(text)
        if not match:
            raise ApiError(400, "invalid", f"Invalid value for field 'filter': '{text}'. Invalid list filter "
                           "expression.")
        key, value, present = match.groups()
        if present:
            return lambda instance: key in instance.get("labels", {})
        return lambda instance: instance.get("labels", {}).get(key) == value

    def _list_instances(self, zone: str, query: dict[str, str], **_: Any) -> dict[str, Any]:
        selected = self._selected(query)
        found = [self._read(i) for (z, _), i in sorted(self._state.instances.items()) if z == zone and selected(i)]
        answer: dict[str, Any] = {"kind": "compute#instanceList", "id": f"projects/{self.project}/zones/{zone}/"
                                  "instances", "selfLink": self._url(f"zones/{zone}/instances")}
        if found:
            answer["items"] = found  # GCE leaves `items` out of an empty list
        return answer

    def _aggregated_instances(self, query: dict[str, str], **_: Any) -> dict[str, Any]:
        selected = self._selected(query)
        items: dict[str, Any] = {}
        for (zone, _), instance in sorted(self._state.instances.items()):
            if selected(instance):
                items.setdefault(f"zones/{zone}", {"instances": []})["instances"].append(self._read(instance))
        for zone in sorted(self._state.zones_seen - {k.split("/", 1)[1] for k in items}):
            items[f"zones/{zone}"] = {"warning": {
                "code": "NO_RESULTS_ON_PAGE", "message": f"There are no results for scope 'zones/{zone}' on this page.",
                "data": [{"key": "scope", "value": f"zones/{zone}"}]}}
        return {"kind": "compute#instanceAggregatedList", "id": f"projects/{self.project}/aggregated/instances",
                "items": items, "selfLink": self._url("aggregated/instances")}

    def _set_labels(self, zone: str, name: str, query: dict[str, str], body: dict[str, Any] | None) -> dict[str, Any]:
        instance = self._instance(zone, name)
        body = body or {}
        if body.get("labelFingerprint") != instance["labelFingerprint"]:
            raise ApiError(412, "conditionNotMet", "Labels fingerprint either invalid or resource labels have "
                           "changed")
        for key, value in body.get("labels", {}).items():
            if not LABEL_KEY.match(key) or not LABEL_VALUE.match(value):
                raise ApiError(400, "invalid", f"Invalid value for field 'labels': '{key}={value}'")
        instance["labels"] = dict(body.get("labels", {}))
        instance["labelFingerprint"] = uuid.uuid4().hex[:12]
        return self._operation(f"zones/{zone}", "setLabels", f"zones/{zone}/instances/{name}")

    def _delete_instance(self, zone: str, name: str, **_: Any) -> dict[str, Any]:
        self._instance(zone, name)
        del self._state.instances[(zone, name)]
        return self._operation(f"zones/{zone}", "delete", f"zones/{zone}/instances/{name}")

    # -- resource policies --------------------------------------------------------------------------------------

    def _insert_policy(self, region: str, query: dict[str, str], body: dict[str, Any] | None) -> dict[str, Any]:
        request_id = query.get("requestId")
        if request_id and request_id in self._state.request_ids:
            return copy.deepcopy(self._state.request_ids[request_id])
        body = body or {}
        name = body.get("name", "")
        if not NAME.match(name):
            raise ApiError(400, "invalid", f"Invalid value for field 'resource.name': '{name}'")
        if (region, name) in self._state.policies:
            raise ApiError(409, "alreadyExists", f"The resource 'projects/{self.project}/regions/{region}/"
                           f"resourcePolicies/{name}' already exists")
        self._state.policies[(region, name)] = {
            **copy.deepcopy(body), "kind": "compute#resourcePolicy", "id": str(next(self._ids)),
            "creationTimestamp": _now(), "region": self._url(f"regions/{region}"), "status": "READY",
            "selfLink": self._url(f"regions/{region}/resourcePolicies/{name}")}
        operation = self._operation(f"regions/{region}", "insert", f"regions/{region}/resourcePolicies/{name}")
        if request_id:
            self._state.request_ids[request_id] = operation
        return operation

    def _policy(self, region: str, name: str) -> dict[str, Any]:
        policy = self._state.policies.get((region, name))
        if policy is None:
            raise ApiError(404, "notFound", f"The resource 'projects/{self.project}/regions/{region}/"
                           f"resourcePolicies/{name}' was not found")
        return policy

    def _get_policy(self, region: str, name: str, **_: Any) -> dict[str, Any]:
        return copy.deepcopy(self._policy(region, name))

    def _delete_policy(self, region: str, name: str, **_: Any) -> dict[str, Any]:
        link = self._policy(region, name)["selfLink"]
        users = [i["selfLink"] for i in self._state.instances.values() if link in i.get("resourcePolicies", [])]
        if users:
            raise ApiError(400, "resourceInUseByAnotherResource", f"The resource_policy resource "
                           f"'projects/{self.project}/regions/{region}/resourcePolicies/{name}' is already being used "
                           f"by '{users[0].removeprefix(API + '/')}'")
        del self._state.policies[(region, name)]
        return self._operation(f"regions/{region}", "delete", f"regions/{region}/resourcePolicies/{name}")

    def _aggregated_policies(self, **_: Any) -> dict[str, Any]:
        items: dict[str, Any] = {}
        for (region, _), policy in sorted(self._state.policies.items()):
            items.setdefault(f"regions/{region}", {"resourcePolicies": []})["resourcePolicies"].append(
                copy.deepcopy(policy))
        return {"kind": "compute#resourcePolicyAggregatedList",
                "id": f"projects/{self.project}/aggregated/resourcePolicies", "items": items,
                "selfLink": self._url("aggregated/resourcePolicies")}


class _Handler(BaseHTTPRequestHandler):
    gce: GceServer
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's requests session expects

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if self.command == "POST" and urlsplit(self.path).path == "/token":
            status, answer = 200, self.gce.token()  # a form-encoded grant, as OAuth's are
        else:
            try:
                body = json.loads(raw) if raw.strip() else None
            except json.JSONDecodeError:
                status, answer = 400, ApiError(400, "parseError", "This API does not support parsing form-encoded "
                                               "input.").body()
            else:
                status, answer = self.gce.handle(self.command, self.path, body, self.headers.get("Authorization"))
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_DELETE = _serve

    def log_message(self, format: str, *args: Any) -> None:
        """Requests are recorded in GceServer.calls; stderr stays quiet."""
