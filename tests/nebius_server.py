"""A stand-in for the Nebius API, the way moto stands in for EC2: a real gRPC server answering the services the
nebius provider calls (compute.v1 InstanceService and GpuClusterService, common.v1 OperationService, vpc.v1
SubnetService), built from the SDK's own service descriptors and message classes (the SDK ships no servicer
classes: each method's handler is made from its descriptor, its request parsed and its reply serialized by the SDK's
messages). The provider's SDK client reaches it over an insecure channel (TRAINPIPE_NEBIUS_ENDPOINT=http://...).

What it keeps: projects (one per region, each with one subnet), GPU clusters, instances with their labels, specs and
addresses (public 127.77.3.N, private 127.78.3.N: distinct, so a test fails when the wrong one is used), and
operations, which end at the first poll. It checks what Nebius checks and a fake could miss: the bearer token,
names unique per project, label values, the GPU cluster of an instance existing, a GPU cluster not deleted while
instances are in it. On demand: capacity errors (the create's operation ends RESOURCE_EXHAUSTED with a
NotEnoughResources detail, as Nebius reports a fabric without free GPUs), quota errors (QuotaFailure), throttling of
the next calls (UNAVAILABLE), and preemption (a preemptible instance STOPPING, the machine behind it told, then
STOPPED). An outage of the instance reads (Get, GetByName, List: what the run's preemption watch reads) is started
with `fake.outage.start()` (tests/outage.py): UNAVAILABLE, then Nebius's throttling, RESOURCE_EXHAUSTED with a
TooManyRequests service error in the status details.
"""

from __future__ import annotations

import itertools
import re
import shlex
import sys
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from nebius.api.google.rpc import Status
from nebius.api.nebius.common import v1 as common
from nebius.api.nebius.common.v1 import OperationServiceClient
from nebius.api.nebius.compute import v1 as compute
from nebius.api.nebius.compute.v1 import GpuClusterServiceClient, InstanceServiceClient
from nebius.api.nebius.iam import v1 as iam
from nebius.api.nebius.iam.v1 import TokenExchangeServiceClient
from nebius.api.nebius.vpc import v1 as vpc
from nebius.api.nebius.vpc.v1 import SubnetServiceClient
from outage import ERRORS, OutageSwitch

REGISTRY = InstanceServiceClient.__registry__
PROJECTS = {"eu-north1": "project-e00north1fake", "eu-west1": "project-e01west1fake",
            "us-central1": "project-u00central1fake"}
TOKEN = "nebius-test-token"  # what the provider must present (NEBIUS_IAM_TOKEN in the tests)
LABEL_VALUE = re.compile(r"^[a-z0-9_.-]{0,63}$")
RESOURCE_EXHAUSTED, OK = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], grpc.StatusCode.OK.value[0]
INSTANCE_READS = frozenset({"Get", "GetByName", "List"})
THROTTLED_MESSAGE = "too many requests, retry later"


@dataclass
class Call:
    service: str
    method: str
    request: Any
    authorization: str
    idempotency_key: str


@dataclass
class Refusal:
    """Creates refused on demand: of this platform, project and preemptibility (any when None), after `after` more
    creates succeed."""

    kind: str  # capacity | quota
    platform: str | None = None
    project: str | None = None
    preemptible: bool | None = None
    after: int = 0

    def applies(self, request: Any) -> bool:
        return (self.platform in (None, request.spec.resources.platform)
                and self.project in (None, request.metadata.parent_id)
                and self.preemptible in (None, request.spec.HasField("preemptible")))


@dataclass
class FakeNebius:
    public_prefix: str = "127.77.3."
    private_prefix: str = "127.78.3."
    instances: dict[str, Any] = field(default_factory=dict)  # id → compute.Instance
    gpu_clusters: dict[str, Any] = field(default_factory=dict)  # id → compute.GpuCluster
    operations: dict[str, tuple[Any, Status]] = field(default_factory=dict)  # id → (Operation, its end)
    refusals: list[Refusal] = field(default_factory=list)
    unavailable: int = 0  # the next calls answered UNAVAILABLE
    outage: OutageSwitch = field(default_factory=OutageSwitch)
    calls: list[Call] = field(default_factory=list)
    # Service account keys the token exchange accepts: key id → (service account id, public key PEM).
    service_accounts: dict[str, tuple[str, bytes]] = field(default_factory=dict)
    # Told when a preempted machine stops (tests/cloud_nodes.py powers its stand-in off).
    on_stop: Callable[[Any], None] | None = None
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _lock: threading.RLock = field(default_factory=threading.RLock)

    # -- plumbing -------------------------------------------------------------------------------------------------

    def _id(self, kind: str) -> str:
        return f"{kind}-e00fake{next(self._ids):06d}"

    def _operation(self, resource_id: str, end: Status, description: str) -> Any:
        operation = common.Operation(id=self._id("op"), resource_id=resource_id, description=description)
        self.operations[operation.id] = (operation, end)
        return operation

    def out_of_service(self, service: str, method: str, context: grpc.ServicerContext) -> None:
        """The instance reads refused while the outage lasts, as Nebius refuses them."""
        if not service.endswith("InstanceService") or method not in INSTANCE_READS:
            return
        phase = self.outage.phase()
        if phase == ERRORS:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the API is unavailable, try again")
        if phase is not None:
            throttled = Status(code=RESOURCE_EXHAUSTED, message=THROTTLED_MESSAGE, details=[REGISTRY.pack_any(
                common.ServiceError(service="compute", code="TooManyRequests",
                                    too_many_requests=common.TooManyRequests(violation="instance reads per second")))])
            context.set_trailing_metadata([("grpc-status-details-bin", throttled.SerializeToString())])
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, THROTTLED_MESSAGE)

    @staticmethod
    def _service_error(kind: str, message: str) -> Status:
        detail = {"capacity": common.ServiceError(service="compute", code="NotEnoughResources",
                                                  not_enough_resources=common.NotEnoughResources()),
                  "quota": common.ServiceError(service="compute", code="QuotaFailure",
                                               quota_failure=common.QuotaFailure())}[kind]
        return Status(code=RESOURCE_EXHAUSTED, message=message, details=[REGISTRY.pack_any(detail)])

    def _named(self, table: dict[str, Any], project: str, name: str) -> Any | None:
        return next((r for r in table.values() if r.metadata.parent_id == project and r.metadata.name == name), None)

    @staticmethod
    def _check_labels(labels: dict[str, str], context: grpc.ServicerContext) -> None:
        bad = {k: v for k, v in labels.items() if not LABEL_VALUE.match(k) or not LABEL_VALUE.match(v)}
        if bad:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid labels: {bad}")

    @staticmethod
    def _page(items: list[Any], request: Any) -> tuple[list[Any], str]:
        start = int(request.page_token or 0)
        size = request.page_size or 100
        end = start + size
        return items[start:end], (str(end) if end < len(items) else "")

    @staticmethod
    def _found(found: Any, what: str, context: grpc.ServicerContext) -> Any:
        """`found`, or the call aborted with NOT_FOUND naming `what`, as the API answers."""
        if found is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"{what} not found")
        return found

    def _page_in_project(self, resources: dict[str, Any], request: Any) -> tuple[list[Any], str]:
        """One page of a List: the resources of the request's project."""
        return self._page([r for r in resources.values() if r.metadata.parent_id == request.parent_id], request)

    # -- instances ------------------------------------------------------------------------------------------------

    def instance_create(self, request: Any, context: grpc.ServicerContext) -> Any:
        project, name = request.metadata.parent_id, request.metadata.name
        self._check_labels(dict(request.metadata.labels), context)
        if project not in PROJECTS.values():
            context.abort(grpc.StatusCode.NOT_FOUND, f"project {project} not found")
        if self._named(self.instances, project, name) is not None:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"instance {name} already exists")
        gpu_cluster = request.spec.gpu_cluster.id
        if gpu_cluster and gpu_cluster not in self.gpu_clusters:
            context.abort(grpc.StatusCode.NOT_FOUND, f"gpu cluster {gpu_cluster} not found")
        for refusal in self.refusals:
            if refusal.applies(request):
                if refusal.after > 0:
                    refusal.after -= 1
                    break
                what = "not enough resources: no free GPUs in the fabric" if refusal.kind == "capacity" else \
                    "quota exceeded: gpu count limit for the project"
                return self._operation("", self._service_error(refusal.kind, what), f"create {name}")
        number = next(self._ids) % 250 + 1
        instance = compute.Instance(
            metadata=common.ResourceMetadata(id=self._id("computeinstance"), parent_id=project, name=name,
                                             labels=dict(request.metadata.labels)),
            spec=request.spec,
            status=compute.InstanceStatus(
                state=compute.InstanceStatus.InstanceState.CREATING,
                network_interfaces=[compute.NetworkInterfaceStatus(
                    index=0, name="eth0",
                    ip_address=compute.IPAddressStatus(address=f"{self.private_prefix}{number}/32"),
                    public_ip_address=compute.PublicIPAddressStatus(address=f"{self.public_prefix}{number}/32"))]))
        self.instances[instance.metadata.id] = instance
        if gpu_cluster:
            self.gpu_clusters[gpu_cluster].status.instances.append(instance.metadata.id)
        return self._operation(instance.metadata.id, Status(code=OK), f"create {name}")

    def instance_get(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._found(self.instances.get(request.id), f"instance {request.id}", context)

    def instance_get_by_name(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._found(self._named(self.instances, request.parent_id, request.name), f"instance {request.name}",
                           context)

    def instance_list(self, request: Any, context: grpc.ServicerContext) -> Any:
        items, token = self._page_in_project(self.instances, request)
        return compute.ListInstancesResponse(items=items, next_page_token=token)

    def instance_delete(self, request: Any, context: grpc.ServicerContext) -> Any:
        instance = self._found(self.instances.pop(request.id, None), f"instance {request.id}", context)
        gpu_cluster = self.gpu_clusters.get(instance.spec.gpu_cluster.id)
        if gpu_cluster is not None:
            gpu_cluster.status.instances = [i for i in gpu_cluster.status.instances if i != request.id]
        return self._operation(request.id, Status(code=OK), f"delete {instance.metadata.name}")

    def instance_stop(self, request: Any, context: grpc.ServicerContext) -> Any:
        """What a guest powering itself off amounts to (Nebius stops the VM; trainpipe itself never calls it)."""
        instance = self._found(self.instances.get(request.id), f"instance {request.id}", context)
        instance.status.state = compute.InstanceStatus.InstanceState.STOPPED
        return self._operation(request.id, Status(code=OK), f"stop {instance.metadata.name}")

    # -- GPU clusters -------------------------------------------------------------------------------------------

    def gpu_cluster_create(self, request: Any, context: grpc.ServicerContext) -> Any:
        project, name = request.metadata.parent_id, request.metadata.name
        self._check_labels(dict(request.metadata.labels), context)
        if self._named(self.gpu_clusters, project, name) is not None:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"gpu cluster {name} already exists")
        if not request.spec.infiniband_fabric:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "infiniband_fabric is required")
        gpu_cluster = compute.GpuCluster(
            metadata=common.ResourceMetadata(id=self._id("computegpucluster"), parent_id=project, name=name,
                                             labels=dict(request.metadata.labels)),
            spec=request.spec, status=compute.GpuClusterStatus())
        self.gpu_clusters[gpu_cluster.metadata.id] = gpu_cluster
        return self._operation(gpu_cluster.metadata.id, Status(code=OK), f"create {name}")

    def gpu_cluster_get_by_name(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._found(self._named(self.gpu_clusters, request.parent_id, request.name),
                           f"gpu cluster {request.name}", context)

    def gpu_cluster_list(self, request: Any, context: grpc.ServicerContext) -> Any:
        items, token = self._page_in_project(self.gpu_clusters, request)
        return compute.ListGpuClustersResponse(items=items, next_page_token=token)

    def gpu_cluster_update(self, request: Any, context: grpc.ServicerContext) -> Any:
        found = self._found(self.gpu_clusters.get(request.metadata.id), f"gpu cluster {request.metadata.id}", context)
        self._check_labels(dict(request.metadata.labels), context)
        found.metadata.labels = dict(request.metadata.labels)
        return self._operation(found.metadata.id, Status(code=OK), f"update {found.metadata.name}")

    def gpu_cluster_delete(self, request: Any, context: grpc.ServicerContext) -> Any:
        found = self._found(self.gpu_clusters.get(request.id), f"gpu cluster {request.id}", context)
        if found.status.instances:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"gpu cluster {request.id} has instances: "
                          f"{', '.join(found.status.instances)}")
        del self.gpu_clusters[request.id]
        return self._operation(request.id, Status(code=OK), f"delete {found.metadata.name}")

    # -- operations and subnets ---------------------------------------------------------------------------------

    def operation_get(self, request: Any, context: grpc.ServicerContext) -> Any:
        """An operation ends at its first poll; a create that ended well leaves its instance RUNNING."""
        found = self._found(self.operations.get(request.id), f"operation {request.id}", context)
        operation, end = found
        operation.status = end
        instance = self.instances.get(operation.resource_id)
        if instance is not None and instance.status.state == compute.InstanceStatus.InstanceState.CREATING:
            instance.status.state = compute.InstanceStatus.InstanceState.RUNNING
        return operation

    def subnet_list(self, request: Any, context: grpc.ServicerContext) -> Any:
        if request.parent_id not in PROJECTS.values():
            return vpc.ListSubnetsResponse()
        return vpc.ListSubnetsResponse(items=[vpc.Subnet(metadata=common.ResourceMetadata(
            id=f"vpcsubnet-{request.parent_id.removeprefix('project-')}", parent_id=request.parent_id,
            name="default-subnet"))])

    def token_exchange(self, request: Any, context: grpc.ServicerContext) -> Any:
        """IAM's token exchange: a JWT the service account signed with its key (what the SDK makes from a credentials
        file) for an access token. The signature is checked with the key registered for its key id."""
        import jwt

        try:
            kid = jwt.get_unverified_header(request.subject_token).get("kid", "")
            account, public_key = self.service_accounts[kid]
            claims = jwt.decode(request.subject_token, public_key, algorithms=["RS256"],
                                options={"verify_aud": False})
        except (KeyError, jwt.PyJWTError) as exc:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"subject token refused: {exc!r}")
        if claims.get("sub") != account:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"subject token names {claims.get('sub')}, not {account}")
        return iam.CreateTokenResponse(access_token=TOKEN, issued_token_type="urn:ietf:params:oauth:token-type:"
                                       "access_token", token_type="Bearer", expires_in=3600)

    def credentials_file(self, path: Any, account: str = "serviceaccount-e00trainpipe") -> Any:
        """A service account's credentials.json (what `nebius iam auth-public-key generate` writes), its key
        registered here so that the exchange accepts what the SDK signs with it."""
        import json

        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        kid = f"publickey-e00{len(self.service_accounts):06d}"
        self.service_accounts[kid] = (account, key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode()
        path.write_text(json.dumps({"subject-credentials": {"type": "JWT", "alg": "RS256", "private-key": pem,
                                                            "kid": kid, "iss": account, "sub": account}}))
        path.chmod(0o600)
        return path

    # -- what tests do ------------------------------------------------------------------------------------------

    def preempt(self, instance_name: str) -> None:
        """What Nebius does to a preemptible VM it reclaims: STOPPING (the guest's shutdown: the machine behind it
        is told), then STOPPED."""
        with self._lock:
            instance = next(i for i in self.instances.values() if i.metadata.name == instance_name)
            assert instance.spec.HasField("preemptible"), f"{instance_name} is not preemptible"
            instance.status.state = compute.InstanceStatus.InstanceState.STOPPING
        if self.on_stop is not None:
            self.on_stop(instance)
        with self._lock:
            instance.status.state = compute.InstanceStatus.InstanceState.STOPPED

    def running(self) -> list[Any]:
        with self._lock:
            return [i for i in self.instances.values()
                    if i.status.state == compute.InstanceStatus.InstanceState.RUNNING]

    def creates(self) -> list[Any]:
        return [c.request for c in self.calls if c.service.endswith("InstanceService") and c.method == "Create"]

    def reset(self) -> None:
        with self._lock:
            self.instances.clear()
            self.gpu_clusters.clear()
            self.operations.clear()
            self.refusals.clear()
            self.calls.clear()
            self.unavailable = 0
            self.outage.end()
            self.on_stop = None


class NebiusServer:
    """The fake on a loopback port; `with NebiusServer() as server:` starts and stops it."""

    def __init__(self, public_prefix: str = "127.77.3.", private_prefix: str = "127.78.3.") -> None:
        self.fake = FakeNebius(public_prefix, private_prefix)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        fake = self.fake
        self._server.add_generic_rpc_handlers([
            self._handler(InstanceServiceClient, {"Create": fake.instance_create, "Get": fake.instance_get,
                                                  "GetByName": fake.instance_get_by_name,
                                                  "List": fake.instance_list, "Delete": fake.instance_delete,
                                                  "Stop": fake.instance_stop}),
            self._handler(GpuClusterServiceClient, {"Create": fake.gpu_cluster_create,
                                                    "GetByName": fake.gpu_cluster_get_by_name,
                                                    "List": fake.gpu_cluster_list, "Update": fake.gpu_cluster_update,
                                                    "Delete": fake.gpu_cluster_delete}),
            self._handler(OperationServiceClient, {"Get": fake.operation_get}),
            self._handler(SubnetServiceClient, {"List": fake.subnet_list}),
            self._handler(TokenExchangeServiceClient, {"Exchange": fake.token_exchange}),
        ])
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    def _handler(self, client: Any, methods: dict[str, Callable[[Any, grpc.ServicerContext], Any]]) -> Any:
        """The generic handler of one service, from the SDK's descriptor of it: every method the fake answers, its
        request parsed and its reply serialized by the SDK's message classes."""
        descriptor = client.get_descriptor()
        handlers = {}
        for method in descriptor.methods:
            if method.name not in methods:
                continue
            request_class = REGISTRY.message_class(method.input_type.full_name)
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                self._answer(descriptor.full_name, method.name, methods[method.name]),
                request_deserializer=request_class.FromString,
                response_serializer=lambda message: message.SerializeToString())
        return grpc.method_handlers_generic_handler(descriptor.full_name, handlers)

    def _answer(self, service: str, method: str,
                implementation: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[[Any, grpc.ServicerContext],
                                                                                         Any]:
        fake = self.fake

        def answer(request: Any, context: grpc.ServicerContext) -> Any:
            metadata = dict(context.invocation_metadata())
            authorization = metadata.get("authorization", "")
            with fake._lock:
                fake.calls.append(Call(service, method, request, authorization,
                                       metadata.get("x-idempotency-key", "")))
                # The exchange is how a token is got: the only call made without one.
                if authorization != f"Bearer {TOKEN}" and method != "Exchange":
                    context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid or missing bearer token")
                if fake.unavailable > 0:
                    fake.unavailable -= 1
                    context.abort(grpc.StatusCode.UNAVAILABLE, "the API is unavailable, try again")
                fake.out_of_service(service, method, context)
                return implementation(request, context)

        return answer

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """What the provider (and a trainpipe command of its own) needs to use this fake."""
        return {"TRAINPIPE_NEBIUS_ENDPOINT": self.endpoint, "NEBIUS_IAM_TOKEN": TOKEN,
                "TRAINPIPE_NEBIUS_PROJECTS": ",".join(f"{r}={p}" for r, p in PROJECTS.items())}

    def __enter__(self) -> NebiusServer:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)


# -- the machines behind the instances (tests/cloud_nodes.py) ---------------------------------------------------------

NOTICE_PROGRAM = re.compile(r"<<'TRAINPIPE_NOTICE'\n(.*?)TRAINPIPE_NOTICE\n", re.DOTALL)


def public_address(instance: Any) -> str:
    """Where trainpipe reaches an instance (its first interface's public address, less the prefix length)."""
    return instance.status.network_interfaces[0].public_ip_address.address.split("/")[0]


def private_address(instance: Any) -> str:
    """An instance's address in its subnet: what its peers reach it by."""
    return instance.status.network_interfaces[0].ip_address.address.split("/")[0]


def nebius_instances(server: NebiusServer) -> Callable[[], list[Any]]:
    """The running instances as the stand-ins boot them: public address, name, region, cloud-init user data, private
    address."""
    from cloud_nodes import Instance

    region_of = {project: region for region, project in PROJECTS.items()}

    def found() -> list[Instance]:
        return [Instance(public_address(i), i.metadata.name, region_of[i.metadata.parent_id],
                         i.spec.cloud_init_user_data, private_address(i)) for i in server.fake.running()]

    return found


def nebius_power_off(server: NebiusServer) -> Callable[[Any], str]:
    """Nebius: a guest that powers off is stopped (the instance, and its bill for disks, stays until deleted)."""

    def body(node: Any) -> str:
        stop = f"""
from nebius.api.nebius.common.v1 import GetByNameRequest
from nebius.api.nebius.compute.v1 import InstanceServiceClient, StopInstanceRequest
from nebius.base.options import INSECURE
from nebius.base.resolver import Constant
from nebius.sdk import SDK
address = {server.endpoint.split("://", 1)[1]!r}
sdk = SDK(resolver=Constant(address), address_options={{address: [(INSECURE, True)]}}, credentials={TOKEN!r},
          user_agent_prefix="stand-in/1")
client = InstanceServiceClient(sdk)
found = client.get_by_name(GetByNameRequest(parent_id={PROJECTS[node.instance.zone]!r},
                                            name={node.instance.cloud_id!r})).wait()
client.stop(StopInstanceRequest(id=found.metadata.id)).wait().sync_wait(interval=0.1, timeout=30)
sdk.sync_close()
"""
        return f"{shlex.quote(sys.executable)} -c {shlex.quote(stop)} >> {node.root}/poweroff.log 2>&1\n"

    return body
