"""A simulated Azure Resource Manager: a stdlib HTTPS server on a free loopback port, in a thread.

No Azure subscription can be reached from here and no emulator of ARM's compute and network providers exists, so the
Azure provider's tests point the real SDK clients (azure-mgmt-resource, -compute, -network) at this stand-in. It
serves the ARM endpoints the provider calls, with ARM's shapes:

- resource groups: PUT, GET, PATCH (tags), DELETE (202 + Location, cascading to everything in the group), and the
  subscription's list with `$filter=tagName eq '…'`;
- Microsoft.Compute proximityPlacementGroups, availabilitySets (synchronous PUT/GET/DELETE) and virtualMachines;
  Microsoft.Network virtualNetworks, networkSecurityGroups, publicIPAddresses, networkInterfaces: PUT answers 201 with
  an Azure-AsyncOperation header whose operation is InProgress once, then Succeeded (or Failed with the error an
  allocation failure carries); DELETE answers 202 with a Location that answers 202 once, then 200;
- ARM's rules the provider must respect: a VM's NIC, availability set and PPG must exist in the VM's group and
  region, an availability set and its VMs share the PPG, a NIC in use by a VM and a PPG holding VMs cannot be
  deleted; a VM deleted (or evicted) takes the NIC and public IP it was told to (`deleteOption: Delete`) with it.

Faults arrive as from ARM: SkuNotAvailable (409) and quota (OperationNotAllowed, 409, quota text) refuse the VM PUT
outright; AllocationFailed and OverconstrainedAllocationRequest accept it and fail its operation. A Spot VM is evicted
with `evict()`: a Scheduled Event `Preempt` appears in the instance metadata service this server also answers (IMDS,
at /metadata/scheduledevents), then `complete_eviction()` deletes it as eviction policy Delete does.

It also answers the managed-identity token endpoint of azure-identity's App Service protocol (IDENTITY_ENDPOINT /
IDENTITY_HEADER), so an orchestrator started as a command gets a token the way it would on Azure; and, per VM (under
`imds_of(group, vm)`, since one server stands in for every VM's 169.254.169.254), IMDS's own endpoints a node calls:
`/metadata/identity/oauth2/token` (a token of a user-assigned identity the VM carries, named by `msi_res_id` or
`client_id`; else IMDS's 400 "Identity not found") and `/metadata/instance/compute` (its name, group, subscription).
A request that carries such a token is checked as ARM would: issued here, for Resource Manager's audience, and of an
identity granted a role whose actions cover the request's (`grant`: by default the role trainpipe ships,
examples/azure-self-delete-role.json, read from that file), else 401 or 403 AuthorizationFailed; any other token
passes.
Public addresses come from `public_prefix`, private ones from `private_prefix` (distinct: a test fails if the wrong
one is bound). An outage of the VM reads (GET of a VM or of a group's VMs: what the run's preemption watch reads) is
started with `outage.start()` (tests/outage.py): 503 ServiceUnavailable, then ARM's throttling, 429 TooManyRequests
with a Retry-After (`throttle_retry_after_s`).
"""

from __future__ import annotations

import copy
import datetime
import fnmatch
import ipaddress
import itertools
import json
import re
import ssl
import threading
import uuid
from dataclasses import dataclass, field
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from fault_budget import FaultBudget
from http_stub import Served, StandIn
from outage import ERRORS, OutageSwitch

SUBSCRIPTION = "00000000-0000-0000-0000-0000000000aa"
IDENTITY_HEADER = "trainpipe-test-identity-header"
MANAGEMENT = "https://management.azure.com/"  # the audience of Resource Manager's tokens
IMDS_TOKEN_PREFIX = "imds-"  # tokens this fake's IMDS issued to a VM's identity (the only ones it checks)
VM_IMDS = re.compile(r"^/vms/([^/]+)/([^/]+)(/metadata/.*)$")
# Types whose PUT is a long-running operation (the SDK's begin_create_or_update); the others answer at once.
LRO_TYPES = {"microsoft.compute/virtualmachines", "microsoft.network/virtualnetworks",
             "microsoft.network/networksecuritygroups", "microsoft.network/publicipaddresses",
             "microsoft.network/networkinterfaces"}
CAPACITY_IN_OPERATION = {"AllocationFailed", "OverconstrainedAllocationRequest", "ZonalAllocationFailed"}
RESOURCE = re.compile(r"^/subscriptions/([^/]+)/resourcegroups/([^/]+)/providers/([^/]+)/([^/]+)(?:/([^/]+))?$",
                      re.IGNORECASE)
GROUP = re.compile(r"^/subscriptions/([^/]+)/resourcegroups(?:/([^/]+))?$", re.IGNORECASE)
# The custom role trainpipe ships for the nodes' self-delete: what `grant` gives by default.
SELF_DELETE_ROLE = Path(__file__).resolve().parent.parent / "examples" / "azure-self-delete-role.json"
PREEMPT_NOTICE_S = 30.0  # Azure gives a Spot VM at least 30 s between the Preempt event and the eviction


class ArmError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message}}


@dataclass
class Fault(FaultBudget):
    """Refuse VM PUTs that match (region; spot, regular or both): the first `after` pass, then `times` (None: all)
    fail with `code`."""

    code: str
    region: str | None = None
    spot: bool | None = None
    after: int = 0
    times: int | None = None
    passed: int = 0
    fired: int = 0

    def fires(self, region: str, spot: bool) -> bool:
        if self.region not in (None, region) or self.spot not in (None, spot):
            return False
        return self._fires_after(self.after)


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    status: int
    body: dict[str, Any] | None
    query: dict[str, str] = field(default_factory=dict)
    authorization: str = ""


@dataclass
class _State:
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)  # lower name → group
    resources: dict[str, dict[str, Any]] = field(default_factory=dict)  # lower id → resource
    operations: dict[str, dict[str, Any]] = field(default_factory=dict)  # id → {polls, error, resource}
    deletions: dict[str, int] = field(default_factory=dict)  # Location id → polls left
    faults: list[Fault] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # Scheduled Events
    tokens: dict[str, dict[str, str]] = field(default_factory=dict)  # IMDS token → {identity, resource}
    # lower identity ID -> the actions of the role granted to it on the subscription (ARM's patterns: * matches)
    roles: dict[str, tuple[str, ...]] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)


class ArmServer(StandIn):
    def __init__(self, root: Path, public_prefix: str = "127.77.4.", private_prefix: str = "127.78.4.") -> None:
        self.root = root
        self.public_prefix, self.private_prefix = public_prefix, private_prefix
        self._numbers = itertools.count(1)
        self._state = _State()
        self._lock = threading.Lock()
        self._incarnation = itertools.count(1)
        self._httpd: Served | None = None
        self._imds: Served | None = None
        self.ca_file = root / "arm-ca.pem"
        self.outage = OutageSwitch()
        self.throttle_retry_after_s = 3  # what a throttled read is told to wait (ARM sends whole seconds)

    # -- lifecycle ----------------------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        assert self._httpd is not None
        return f"https://127.0.0.1:{self._httpd.port}"

    @property
    def imds(self) -> str:
        """The instance metadata service's base URL: plain HTTP, as Azure's (http://169.254.169.254) is. It also
        answers the managed-identity token endpoint."""
        assert self._imds is not None
        return f"http://127.0.0.1:{self._imds.port}"

    def imds_of(self, group: str, vm: str) -> str:
        """The instance metadata service as VM `vm` of `group` sees it (its identity token, its compute metadata)."""
        return f"{self.imds}/vms/{group}/{vm}"

    def env(self) -> dict[str, str]:
        """What an orchestrator of its own needs to reach this ARM as it would reach Azure's."""
        return {"AZURE_SUBSCRIPTION_ID": SUBSCRIPTION, "TRAINPIPE_AZURE_ENDPOINT": self.endpoint,
                "IDENTITY_ENDPOINT": f"{self.imds}/msi/token", "IDENTITY_HEADER": IDENTITY_HEADER,
                "REQUESTS_CA_BUNDLE": str(self.ca_file), "TRAINPIPE_AZURE_METADATA_URL": self.imds}

    def start(self) -> ArmServer:
        self.root.mkdir(parents=True, exist_ok=True)
        key_file = self.root / "arm-key.pem"
        _self_signed(self.ca_file, key_file)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.ca_file, key_file)
        handler = type("Handler", (_Handler,), {"arm": self})
        self._httpd = Served(handler, "arm-server", tls=context)
        self._imds = Served(handler, "arm-imds")
        return self

    def stop(self) -> None:
        for server in (self._httpd, self._imds):
            if server is not None:
                server.stop()

    def reset(self) -> None:
        with self._lock:
            self._state = _State()
            self.outage.end()

    # -- what tests use -----------------------------------------------------------------------------------------

    def fail(self, code: str, *, region: str | None = None, spot: bool | None = None, after: int = 0,
             times: int | None = None) -> Fault:
        fault = Fault(code, region, spot, after, times)
        with self._lock:
            self._state.faults.append(fault)
        return fault

    def grant(self, identity: str, actions: tuple[str, ...] | None = None) -> None:
        """A role on the subscription for a user-assigned identity (its resource ID): the actions given, else those
        of the custom role trainpipe ships for self-delete."""
        if actions is None:
            actions = tuple(json.loads(SELF_DELETE_ROLE.read_text())["Actions"])
        with self._lock:
            self._state.roles[identity.lower()] = actions

    def resources(self, kind: str = "", group: str | None = None) -> list[dict[str, Any]]:
        """Resources whose type ends with kind (e.g. "virtualMachines"), of one group or all."""
        with self._lock:
            return [copy.deepcopy(r) for r in self._state.resources.values()
                    if r["type"].lower().endswith(kind.lower())
                    and group in (None, r["id"].split("/")[4].lower())]

    def groups(self) -> list[dict[str, Any]]:
        with self._lock:
            return [copy.deepcopy(g) for g in self._state.groups.values()]

    def calls(self, method: str | None = None, path: str = "") -> list[Call]:
        with self._lock:
            return [c for c in self._state.calls if method in (None, c.method) and re.search(path, c.path, re.I)]

    def clear_calls(self) -> None:
        with self._lock:
            self._state.calls.clear()

    def evict(self, group: str, vm: str) -> None:
        """Azure reclaiming a Spot VM: the Scheduled Event Preempt names it, at least 30 s before the eviction."""
        with self._lock:
            resource = self._state.resources[_id(group, "Microsoft.Compute/virtualMachines", vm)]
            not_before = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=PREEMPT_NOTICE_S)
            self._state.events.append({
                "EventId": str(uuid.uuid4()), "EventType": "Preempt", "ResourceType": "VirtualMachine",
                "Resources": [resource["name"]], "EventStatus": "Scheduled",
                "NotBefore": format_datetime(not_before, usegmt=True), "Description": "Spot eviction",
                "EventSource": "Platform", "DurationInSeconds": -1})

    def complete_eviction(self, group: str, vm: str) -> None:
        """Eviction policy Delete: the VM goes, with what it was told to take along; the event ends."""
        with self._lock:
            self._delete_vm(_id(group, "Microsoft.Compute/virtualMachines", vm))
            self._state.events = [e for e in self._state.events if vm not in e["Resources"]]

    # -- the API ------------------------------------------------------------------------------------------------

    def handle(self, method: str, target: str, body: dict[str, Any] | None,
               headers: dict[str, str]) -> tuple[int, Any, dict[str, str]]:
        parts = urlsplit(target)
        query = dict(parse_qsl(parts.query))
        with self._lock:
            try:
                self._out_of_service(method, parts.path.rstrip("/"))
                status, answer, extra = self._route(method, parts.path.rstrip("/"), query, body, headers)
            except ArmError as exc:
                status, answer, extra = exc.status, exc.body(), exc.headers
            self._state.calls.append(Call(method, parts.path, status, body, query, headers.get("authorization", "")))
        return status, answer, extra

    def _out_of_service(self, method: str, path: str) -> None:
        found = RESOURCE.fullmatch(path)
        if method != "GET" or not found or f"{found.group(3)}/{found.group(4)}".lower() != \
                "microsoft.compute/virtualmachines":
            return
        phase = self.outage.phase()
        if phase == ERRORS:
            raise ArmError(503, "ServiceUnavailable", "The service is temporarily unavailable. Please retry later.")
        if phase is not None:
            retry_after = {"Retry-After": str(self.throttle_retry_after_s)}
            raise ArmError(429, "TooManyRequests", "The request is being throttled as the limit has been reached "
                           "for operation type - Read_ObservationWindow_00:05:00.", retry_after)

    def _route(self, method: str, path: str, query: dict[str, str], body: dict[str, Any] | None,
               headers: dict[str, str]) -> tuple[int, Any, dict[str, str]]:
        if path == "/msi/token":
            if headers.get("x-identity-header") != IDENTITY_HEADER:
                raise ArmError(401, "Unauthorized", "X-IDENTITY-HEADER missing or wrong")
            expires = int(datetime.datetime.now(datetime.UTC).timestamp()) + 3600
            return 200, {"access_token": f"fake-{uuid.uuid4().hex}", "expires_on": str(expires),
                         "resource": query.get("resource", ""), "token_type": "Bearer"}, {}
        vm_imds = VM_IMDS.fullmatch(path)
        if vm_imds:
            return self._vm_imds(*vm_imds.groups(), query, headers)
        if path == "/metadata/scheduledevents":
            if headers.get("metadata") != "true":
                raise ArmError(400, "BadRequest", "Required metadata header not specified")
            return 200, {"DocumentIncarnation": next(self._incarnation), "Events": copy.deepcopy(
                self._state.events)}, {}
        operation = re.fullmatch(r"/subscriptions/[^/]+/providers/Fake\.Arm/(operations|locations)/([^/]+)", path)
        if operation:
            return self._poll(operation.group(1), operation.group(2))
        group = GROUP.fullmatch(path)
        if group:
            if group.group(1) != SUBSCRIPTION:
                raise ArmError(404, "SubscriptionNotFound", f"The subscription '{group.group(1)}' could not be found.")
            return self._group(method, group.group(2), query, body)
        found = RESOURCE.fullmatch(path)
        if found:
            _, rg, namespace, kind, name = found.groups()
            self._check_identity_token(headers.get("authorization", ""), method, f"{namespace}/{kind}", path)
            return self._resource(method, rg, f"{namespace}/{kind}", name, body)
        raise ArmError(404, "NotFound", f"no such path: {method} {path}")

    def _vm_imds(self, rg: str, name: str, path: str, query: dict[str, str],
                 headers: dict[str, str]) -> tuple[int, Any, dict[str, str]]:
        """IMDS as one VM sees it. Its errors are IMDS's shape (error, error_description), not ARM's."""
        if headers.get("metadata") != "true":
            return 400, {"error": "invalid_request", "error_description": "Required metadata header not specified"}, {}
        vm = self._state.resources.get(_id(rg, "Microsoft.Compute/virtualMachines", name))
        if vm is None:
            return 404, {"error": "not_found", "error_description": f"no VM {rg}/{name} behind this address"}, {}
        if path == "/metadata/instance/compute":
            return 200, {"name": vm["name"], "resourceGroupName": vm["id"].split("/")[4],
                         "subscriptionId": SUBSCRIPTION, "location": vm["location"],
                         "vmId": vm["properties"].get("vmId", ""), "resourceId": vm["id"]}, {}
        if path != "/metadata/identity/oauth2/token":
            return 404, {"error": "not_found", "error_description": f"no such IMDS path {path}"}, {}
        carried = {i.lower() for i in (vm.get("identity") or {}).get("userAssignedIdentities") or {}}
        wanted = query.get("msi_res_id", "").lower() or next(
            (i for i in carried if query.get("client_id") and query["client_id"] == _client_id(i)), "")
        if not query.get("resource") or wanted not in carried:
            return 400, {"error": "invalid_request", "error_description": "Identity not found"}, {}
        token = f"{IMDS_TOKEN_PREFIX}{uuid.uuid4().hex}"
        self._state.tokens[token] = {"identity": wanted, "resource": query["resource"]}
        return 200, {"access_token": token, "expires_in": "86399", "resource": query["resource"],
                     "token_type": "Bearer", "client_id": _client_id(wanted)}, {}

    def _check_identity_token(self, authorization: str, method: str, kind: str, path: str) -> None:
        """A VM identity's token (one this fake's IMDS issued) reaches ARM only with Resource Manager's audience and a
        role granted to its identity whose actions cover the request's."""
        token = authorization.removeprefix("Bearer ")
        if not token.startswith(IMDS_TOKEN_PREFIX):
            return
        issued = self._state.tokens.get(token)
        if issued is None:
            raise ArmError(401, "InvalidAuthenticationToken", "The access token is invalid.")
        if issued["resource"].rstrip("/") != MANAGEMENT.rstrip("/"):
            raise ArmError(401, "InvalidAuthenticationTokenAudience", "The access token has been obtained for wrong "
                           f"audience or resource '{issued['resource']}'.")
        action = f"{kind}/{'delete' if method == 'DELETE' else 'write' if method in ('PUT', 'PATCH') else 'read'}"
        granted = self._state.roles.get(issued["identity"], ())
        if not any(fnmatch.fnmatchcase(action.lower(), pattern.lower()) for pattern in granted):
            raise ArmError(403, "AuthorizationFailed", f"The client '{_client_id(issued['identity'])}' does not have "
                           f"authorization to perform action '{action}' over scope '{path}' or the scope is invalid.")

    def _poll(self, kind: str, key: str) -> tuple[int, Any, dict[str, str]]:
        if kind == "locations":
            left = self._state.deletions.get(key)
            if left is None:
                raise ArmError(404, "NotFound", f"no operation {key}")
            if left > 0:
                self._state.deletions[key] = left - 1
                return 202, None, {"Location": f"{self.endpoint}{_operation_path('locations', key)}"}
            return 200, None, {}
        operation = self._state.operations.get(key)
        if operation is None:
            raise ArmError(404, "NotFound", f"no operation {key}")
        if operation["polls"] > 0:
            operation["polls"] -= 1
            return 200, {"status": "InProgress"}, {}
        resource = self._state.resources.get(operation["resource"])
        if operation["error"] is not None:
            if resource is not None:
                resource["properties"]["provisioningState"] = "Failed"
            return 200, {"status": "Failed", "error": operation["error"]}, {}
        if resource is not None:
            resource["properties"]["provisioningState"] = "Succeeded"
        return 200, {"status": "Succeeded"}, {}

    # -- resource groups ----------------------------------------------------------------------------------------

    def _group(self, method: str, name: str | None, query: dict[str, str],
               body: dict[str, Any] | None) -> tuple[int, Any, dict[str, str]]:
        if name is None:
            if method != "GET":
                raise ArmError(405, "MethodNotAllowed", method)
            return 200, {"value": [copy.deepcopy(g) for g in self._state.groups.values()
                                   if _tag_filter(query.get("$filter"))(g)]}, {}
        key = name.lower()
        existing = self._state.groups.get(key)
        if method == "PUT":
            if not re.fullmatch(r"[-\w._()]{1,90}", name) or name.endswith("."):
                raise ArmError(400, "InvalidResourceGroup", f"The resource group name '{name}' is invalid.")
            body = body or {}
            if existing is not None and existing["location"] != body.get("location"):
                raise ArmError(409, "InvalidResourceGroupLocation", f"Invalid resource group location "
                               f"'{body.get('location')}'. The Resource group already exists in location "
                               f"'{existing['location']}'.")
            group = {"id": f"/subscriptions/{SUBSCRIPTION}/resourceGroups/{name}", "name": name,
                     "type": "Microsoft.Resources/resourceGroups", "location": body.get("location"),
                     "tags": dict(body.get("tags") or {}), "properties": {"provisioningState": "Succeeded"}}
            _check_tags(group["tags"])
            self._state.groups[key] = group
            return (200 if existing else 201), copy.deepcopy(group), {}
        if existing is None:
            raise ArmError(404, "ResourceGroupNotFound", f"Resource group '{name}' could not be found.")
        if method == "GET":
            return 200, copy.deepcopy(existing), {}
        if method == "PATCH":
            if body and "tags" in body:
                _check_tags(body["tags"] or {})
                existing["tags"] = dict(body["tags"] or {})
            return 200, copy.deepcopy(existing), {}
        if method == "DELETE":
            for resource_id in [i for i in self._state.resources if i.split("/")[4] == key]:
                self._state.resources.pop(resource_id, None)
            del self._state.groups[key]
            return 202, None, self._deleting()
        raise ArmError(405, "MethodNotAllowed", method)

    def _deleting(self) -> dict[str, str]:
        key = uuid.uuid4().hex
        self._state.deletions[key] = 1
        return {"Location": f"{self.endpoint}{_operation_path('locations', key)}", "Retry-After": "0"}

    # -- resources ----------------------------------------------------------------------------------------------

    def _resource(self, method: str, rg: str, kind: str, name: str | None,
                  body: dict[str, Any] | None) -> tuple[int, Any, dict[str, str]]:
        group = self._state.groups.get(rg.lower())
        if group is None:
            raise ArmError(404, "ResourceGroupNotFound", f"Resource group '{rg}' could not be found.")
        canonical = _canonical(kind)
        if name is None:
            if method != "GET":
                raise ArmError(405, "MethodNotAllowed", method)
            listed = [r for r in self._state.resources.values()
                      if r["type"].lower() == kind.lower() and r["id"].split("/")[4].lower() == rg.lower()]
            return 200, {"value": copy.deepcopy(listed)}, {}
        resource_id = _id(rg, canonical, name)
        existing = self._state.resources.get(resource_id)
        if method == "GET":
            if existing is None:
                raise ArmError(404, "ResourceNotFound", f"The Resource '{canonical}/{name}' under resource group "
                               f"'{rg}' was not found.")
            return 200, copy.deepcopy(existing), {}
        if method == "DELETE":
            if existing is None:
                return 204, None, {}
            self._check_deletable(existing)
            if canonical == "Microsoft.Compute/virtualMachines":
                self._delete_vm(resource_id)
            else:
                del self._state.resources[resource_id]
            if kind.lower() in LRO_TYPES:
                return 202, None, self._deleting()
            return 200, None, {}
        if method == "PUT":
            return self._put(group, rg, canonical, name, body or {}, existing)
        raise ArmError(405, "MethodNotAllowed", method)

    def _put(self, group: dict[str, Any], rg: str, kind: str, name: str, body: dict[str, Any],
             existing: dict[str, Any] | None) -> tuple[int, Any, dict[str, str]]:
        location = body.get("location")
        if location != group["location"]:
            raise ArmError(400, "LocationNotAvailableForResourceGroup" if location else "LocationRequired",
                           f"{kind} {name}: location '{location}' is not the resource group's "
                           f"'{group['location']}'.")
        _check_tags(body.get("tags") or {})
        resource = copy.deepcopy(body)
        resource.update(id=f"/subscriptions/{SUBSCRIPTION}/resourceGroups/{rg}/providers/{kind}/{name}", name=name,
                        type=kind)
        properties = resource.setdefault("properties", {})
        error = None
        if kind == "Microsoft.Compute/virtualMachines":
            error = self._check_vm(rg, resource)
            properties["vmId"] = (existing or {}).get("properties", {}).get("vmId") or str(uuid.uuid4())
        elif kind == "Microsoft.Network/networkInterfaces":
            self._check_nic(rg, resource, existing)
        elif kind == "Microsoft.Network/publicIPAddresses":
            old = (existing or {}).get("properties", {}).get("ipAddress")
            properties["ipAddress"] = old or f"{self.public_prefix}{next(self._numbers)}"
        elif kind == "Microsoft.Network/virtualNetworks":
            for subnet in properties.get("subnets", []):
                subnet["id"] = f"{resource['id']}/subnets/{subnet['name']}"
                subnet.setdefault("properties", {})["provisioningState"] = "Succeeded"
        elif kind == "Microsoft.Compute/availabilitySets":
            self._check_ppg_ref(rg, properties.get("proximityPlacementGroup"), f"availability set {name}")
        resource_id = _id(rg, kind, name)
        if kind.lower() not in LRO_TYPES:
            properties["provisioningState"] = "Succeeded"
            self._state.resources[resource_id] = resource
            # ARM answers an availability set's PUT 200 whether it created it or not.
            created = existing is None and kind != "Microsoft.Compute/availabilitySets"
            return (201 if created else 200), copy.deepcopy(resource), {}
        properties["provisioningState"] = "Creating" if existing is None else "Updating"
        self._state.resources[resource_id] = resource
        key = uuid.uuid4().hex
        self._state.operations[key] = {"polls": 1, "error": error, "resource": resource_id}
        return (200 if existing else 201), copy.deepcopy(resource), {
            "Azure-AsyncOperation": f"{self.endpoint}{_operation_path('operations', key)}", "Retry-After": "0"}

    def _check_vm(self, rg: str, vm: dict[str, Any]) -> dict[str, Any] | None:
        """ARM's checks of a VM PUT: what it refers to exists here, and the injected faults. Returns the error its
        operation will end with (an allocation failure), raises what ARM refuses outright."""
        properties = vm["properties"]
        size = properties.get("hardwareProfile", {}).get("vmSize", "")
        if not size:
            raise ArmError(400, "InvalidParameter", "Required parameter 'hardwareProfile.vmSize' is missing.")
        for reference in properties.get("networkProfile", {}).get("networkInterfaces", []):
            nic = self._state.resources.get(reference["id"].lower())
            if nic is None:
                raise ArmError(400, "InvalidResourceReference", f"Resource {reference['id']} referenced by "
                               f"resource {vm['id']} was not found.")
            vm_ref = nic["properties"].get("virtualMachine")
            if vm_ref and vm_ref["id"].lower() != vm["id"].lower():
                raise ArmError(400, "NicInUse", f"Network interface {reference['id']} is used by {vm_ref['id']}.")
            nic["properties"]["virtualMachine"] = {"id": vm["id"]}
        availability_set = properties.get("availabilitySet")
        if availability_set:
            found = self._state.resources.get(availability_set["id"].lower())
            if found is None:
                raise ArmError(404, "NotFound", f"Availability set {availability_set['id']} was not found.")
            ppg = found["properties"].get("proximityPlacementGroup")
            if (ppg or {}).get("id", "").lower() != (properties.get("proximityPlacementGroup") or {}).get(
                    "id", "").lower():
                raise ArmError(400, "InvalidParameter", "The VM and its availability set must be in the same "
                               "proximity placement group.")
        self._check_ppg_ref(rg, properties.get("proximityPlacementGroup"), f"virtual machine {vm['name']}")
        spot = properties.get("priority") == "Spot"
        if spot and properties.get("evictionPolicy") not in ("Delete", "Deallocate"):
            raise ArmError(400, "InvalidParameter", "evictionPolicy must be given for a Spot VM.")
        region = vm["location"]
        fault = next((f for f in self._state.faults if f.fires(region, spot)), None)
        if fault is None:
            return None
        message = _fault_message(fault.code, size, region, spot)
        if fault.code in CAPACITY_IN_OPERATION:
            return {"code": fault.code, "message": message}
        raise ArmError(403 if fault.code == "AuthorizationFailed" else 409, fault.code, message)

    def _check_ppg_ref(self, rg: str, reference: dict[str, Any] | None, what: str) -> None:
        if reference and reference.get("id", "").lower() not in self._state.resources:
            raise ArmError(404, "NotFound", f"{what}: proximity placement group {reference.get('id')} not found.")

    def _check_nic(self, rg: str, nic: dict[str, Any], existing: dict[str, Any] | None) -> None:
        for config in nic["properties"].get("ipConfigurations", []):
            properties = config.setdefault("properties", {})
            subnet = properties.get("subnet", {}).get("id", "")
            vnet_id = subnet.lower().split("/subnets/")[0]
            if vnet_id not in self._state.resources:
                raise ArmError(400, "InvalidResourceReference", f"Subnet {subnet} was not found.")
            public = properties.get("publicIPAddress")
            if public and public.get("id", "").lower() not in self._state.resources:
                raise ArmError(400, "InvalidResourceReference", f"Public IP {public.get('id')} was not found.")
            old = (existing or {}).get("properties", {}).get("ipConfigurations", [{}])[0].get("properties", {})
            properties["privateIPAddress"] = old.get("privateIPAddress") or \
                f"{self.private_prefix}{next(self._numbers)}"
            properties["privateIPAllocationMethod"] = "Dynamic"
            config["id"] = f"{nic['id']}/ipConfigurations/{config['name']}"
        if existing and existing["properties"].get("virtualMachine"):
            nic["properties"]["virtualMachine"] = existing["properties"]["virtualMachine"]

    def _check_deletable(self, resource: dict[str, Any]) -> None:
        kind = resource["type"]
        users = []
        if kind == "Microsoft.Network/networkInterfaces" and resource["properties"].get("virtualMachine"):
            users = [resource["properties"]["virtualMachine"]["id"]]
        elif kind in ("Microsoft.Compute/proximityPlacementGroups", "Microsoft.Network/publicIPAddresses"):
            users = [r["id"] for r in self._state.resources.values() if resource["id"].lower() in
                     json.dumps(r["properties"]).lower() and r["id"] != resource["id"]]
        if users:
            raise ArmError(400, "InUseCannotBeDeleted" if "proximity" in kind else "InUse",
                           f"{resource['id']} is in use by {users[0]} and cannot be deleted.")

    def _delete_vm(self, vm_id: str) -> None:
        vm = self._state.resources.pop(vm_id.lower())
        for reference in vm["properties"].get("networkProfile", {}).get("networkInterfaces", []):
            nic = self._state.resources.get(reference["id"].lower())
            if nic is None:
                continue
            nic["properties"].pop("virtualMachine", None)
            if reference.get("properties", {}).get("deleteOption") == "Delete":
                del self._state.resources[reference["id"].lower()]
                for config in nic["properties"].get("ipConfigurations", []):
                    reference = config.get("properties", {}).get("publicIPAddress") or {}
                    public = self._state.resources.get(reference.get("id", "").lower())
                    if public and public["properties"].get("deleteOption") == "Delete":
                        del self._state.resources[reference["id"].lower()]


def _canonical(kind: str) -> str:
    names = {k.lower(): k for k in ("Microsoft.Compute/virtualMachines", "Microsoft.Compute/availabilitySets",
                                    "Microsoft.Compute/proximityPlacementGroups",
                                    "Microsoft.Network/virtualNetworks", "Microsoft.Network/networkSecurityGroups",
                                    "Microsoft.Network/publicIPAddresses", "Microsoft.Network/networkInterfaces")}
    if kind.lower() not in names:
        raise ArmError(400, "NoRegisteredProviderFound", f"No registered resource provider found for {kind}.")
    return names[kind.lower()]


def _id(rg: str, kind: str, name: str) -> str:
    return f"/subscriptions/{SUBSCRIPTION}/resourcegroups/{rg}/providers/{kind}/{name}".lower()


def _client_id(identity: str) -> str:
    """A user-assigned identity's client ID, made up from its resource ID (stable, so a test can name it)."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, identity.lower()))


def _operation_path(kind: str, key: str) -> str:
    return f"/subscriptions/{SUBSCRIPTION}/providers/Fake.Arm/{kind}/{key}"


def _check_tags(tags: dict[str, str]) -> None:
    for key, value in tags.items():
        if re.search(r"[<>%&\\?/]", key) or len(key) > 512 or len(str(value)) > 256:
            raise ArmError(400, "InvalidTagNameCharacters", f"The tag name '{key}' has invalid characters or the "
                           "value is too long.")


def _tag_filter(text: str | None) -> Any:
    if not text:
        return lambda _: True
    match = re.fullmatch(r"tagName eq '([^']*)'(?: and tagValue eq '([^']*)')?", text.strip())
    if not match:
        raise ArmError(400, "InvalidFilterInQueryString", f"Invalid $filter '{text}'.")
    name, value = match.groups()
    return lambda group: name in group["tags"] and value in (None, group["tags"][name])


def _fault_message(code: str, size: str, region: str, spot: bool) -> str:
    family = "standardNDSH100v5Family" if "H100" in size else "standardNDASv4_A100Family"
    return {
        "SkuNotAvailable": f"The requested VM size for resource '{size}' is currently not available in location "
                           f"'{region}'. Please try another size or deploy to a different location or different zone.",
        "AllocationFailed": "Allocation failed. We do not have sufficient capacity for the requested VM size in this "
                            "region.",
        "OverconstrainedAllocationRequest": "Allocation failed. VM(s) with the following constraints cannot be "
                                            "allocated, because the condition is too restrictive: proximity "
                                            "placement group.",
        "OperationNotAllowed": f"Operation could not be completed as it results in exceeding approved "
                               f"{'LowPriorityCores' if spot else family} Cores quota. Location: {region}, Current "
                               "Limit: 0, Current Usage: 0, Additional Required: 96.",
        "AuthorizationFailed": "The client does not have authorization to perform action "
                               "'Microsoft.Compute/virtualMachines/write'.",
    }.get(code, f"injected {code}")


def _self_signed(cert_file: Path, key_file: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "trainpipe-test-arm")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))


class _Handler(BaseHTTPRequestHandler):
    arm: ArmServer
    protocol_version = "HTTP/1.1"

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw.strip() else None
        except json.JSONDecodeError:
            status, answer, extra = 400, ArmError(400, "InvalidRequestContent", "not JSON").body(), {}
        else:
            headers = {k.lower(): v for k, v in self.headers.items()}
            status, answer, extra = self.arm.handle(self.command, self.path, body, headers)
        data = b"" if answer is None else json.dumps(answer).encode()
        self.send_response(status)
        for name, value in extra.items():
            self.send_header(name, value)
        if answer is not None:
            self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("x-ms-request-id", str(uuid.uuid4()))
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PUT = do_PATCH = do_DELETE = do_POST = _serve

    def log_message(self, format: str, *args: Any) -> None:
        """Requests are recorded in ArmServer.calls."""
