"""The GCP provider against a simulated Compute Engine (tests/gce_server.py); no real GCE is reached.

The provider's own google-cloud-compute clients (REST transport, anonymous credentials) talk HTTP to the simulated
API. Stockouts, quota refusals, permission errors and transient failures are injected in the server and arrive in
the shapes GCE uses, so failover, rollback and teardown run through the real client code.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from gce_server import PROJECT, GceServer
from google.api_core import exceptions
from google.auth import exceptions as auth_exceptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1
from provider_checks import assert_reports_launched_cluster, unreached_key

import infra.compute.providers.gcp.api as gcp_api
import infra.compute.providers.gcp.provider as gcp_module
from infra.compute.access.hostkeys import generate_host_key
from infra.compute.catalog import Catalog, shipped_catalog
from infra.compute.failover import QuotaEverywhere
from infra.compute.providers import get_provider
from infra.compute.providers.base import CapacityError, InvalidRequestError, LaunchError, QuotaError
from infra.compute.providers.cloud import MOUNT
from infra.compute.providers.gcp.boot import startup_script
from infra.compute.providers.gcp.config import CLOUD_PLATFORM
from infra.compute.providers.gcp.errors import AuthError, classify, is_transient, operation_error
from infra.compute.providers.gcp.labels import (
    LABEL_CLUSTER,
    LABEL_CREATED,
    LABEL_OWNER,
    LABEL_RANK,
    LABEL_RUN,
    label_value,
    resource_name,
)
from infra.compute.providers.gcp.provider import GcpProvider
from infra.compute.spec import ClusterSpec

REGIONS = ("us-central1", "europe-west4")
LABEL_VALUE = re.compile(r"^[a-z0-9_-]{0,63}$")
NAME = re.compile(r"^[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?$")


@pytest.fixture(scope="module")
def gce() -> Iterator[GceServer]:
    with GceServer() as server:
        yield server


def small_catalog() -> Catalog:
    """a2-highgpu-8g takes its 8 local SSDs in the request; a3-highgpu-8g comes with its 16 attached."""
    shipped = shipped_catalog()
    return Catalog(tuple(i for i in shipped.for_provider("gcp") if i.name in ("a2-highgpu-8g", "a3-highgpu-8g")))


@pytest.fixture
def gcp(gce: GceServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> GcpProvider:
    gce.reset()
    # Launch checks the key nodes are reached with before paying for anything; the simulated instances are never
    # reached (no machine behind them), so the key is only read, and bootstrap is off (tests/test_cloud_ssh.py).
    monkeypatch.setenv("TRAINPIPE_SSH_KEY_FILE", str(unreached_key(tmp_path)))
    # The simulated API answers at once: poll and back off in milliseconds, not in the seconds GCE needs.
    monkeypatch.setattr(gcp_api, "POLL_FIRST_S", 0.005)
    monkeypatch.setattr(gcp_api, "POLL_MAX_S", 0.02)
    monkeypatch.setattr(gcp_api, "RETRY_FIRST_S", 0.01)
    monkeypatch.setattr(gcp_module, "FREE_FIRST_S", 0.01)
    monkeypatch.delenv("TRAINPIPE_GCP_ZONES", raising=False)
    return GcpProvider(catalog=small_catalog(), project=PROJECT, credentials=AnonymousCredentials(),
                       api_endpoint=gce.endpoint, bootstrap=False)


def spec(**fields: Any) -> ClusterSpec:
    base = {"provider": "gcp", "nodes": 2, "procs_per_node": 8, "accelerator": "A100", "local_nvme": True,
            "regions": REGIONS}
    return ClusterSpec(**{**base, **fields})


def inserts(gce: GceServer, zone: str | None = None) -> list[dict[str, Any]]:
    """Bodies of the instance inserts the server accepted (HTTP 200), in order."""
    where = zone or "[^/]+"
    return [c.body or {} for c in gce.calls("POST", rf"/zones/{where}/instances$") if c.status == 200]


def metadata(instance: dict[str, Any]) -> dict[str, str]:
    return {item["key"]: item["value"] for item in instance["metadata"]["items"]}


def left(gce: GceServer, cluster: str) -> list[str]:
    """Everything of the cluster still in the simulated project."""
    names = [i["name"] for i in gce.instances() if i["labels"].get(LABEL_CLUSTER) == cluster]
    return names + [p["name"] for p in gce.policies() if p["name"] == resource_name(cluster, "compact")]


def test_provider_is_registered_and_needs_no_credentials_to_build(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "TRAINPIPE_GCP_PROJECT", "GOOGLE_CLOUD_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setattr(gcp_api, "GCE_PRODUCT_FILE", tmp_path / "product_name")

    def no_lookup(*_: Any, **__: Any) -> None:
        raise AssertionError("google.auth.default() probes the network: not without credentials")

    monkeypatch.setattr(gcp_api.google.auth, "default", no_lookup)
    started = time.monotonic()
    provider = get_provider("gcp")
    assert provider.name == "gcp" and provider.list_clusters() == []
    assert provider.describe("tp-nothing") is None and provider.terminate("tp-nothing") is False
    assert time.monotonic() - started < 2.0


def test_launch_describe_labels_placement_then_teardown_leaves_nothing(gcp: GcpProvider, gce: GceServer) -> None:
    cluster = gcp.launch("tp-gcp-basic", spec(regions=("us-central1",)), "run-basic")

    assert [n.rank for n in cluster.nodes] == [0, 1] and cluster.run_id == "run-basic"
    assert (cluster.instance_type, cluster.market) == ("a2-highgpu-8g", "on-demand")
    assert [a.outcome for a in gcp.last_attempts] == ["launched"]
    assert all(n.workdir == f"{MOUNT}/trainpipe" and n.address for n in cluster.nodes)

    [policy_insert] = [c.body for c in gce.calls("POST", "/resourcePolicies$")]
    assert policy_insert is not None
    assert policy_insert["groupPlacementPolicy"] == {"collocation": "COLLOCATED"}
    [policy] = gce.policies("us-central1")
    bodies = inserts(gce)
    assert len(bodies) == 2 and len({c.query["requestId"] for c in gce.calls("POST", "/instances$")}) == 2
    for rank, body in enumerate(bodies):
        assert body["name"] == f"tp-gcp-basic-node-{rank}"
        assert body["serviceAccounts"] == [{"email": "default", "scopes": [CLOUD_PLATFORM]}]  # unless the job names one
        assert body["machineType"] == "zones/us-central1-a/machineTypes/a2-highgpu-8g"
        assert body["scheduling"] == {"provisioningModel": "STANDARD", "onHostMaintenance": "TERMINATE",
                                      "automaticRestart": False}
        assert body["resourcePolicies"] == [f"projects/{PROJECT}/regions/us-central1/resourcePolicies/{policy['name']}"]
        boot, *local = body["disks"]
        assert boot["boot"] and boot["autoDelete"]
        assert local == [{"type": "SCRATCH", "interface": "NVME", "autoDelete": True,
                          "initializeParams": {"diskType": "zones/us-central1-a/diskTypes/local-ssd"}}] * 8
        script = metadata(body)["startup-script"]
        assert "mdadm --create /dev/md0" in script and f"mount -o noatime \"$target\" {MOUNT}" in script
        assert metadata(body)[LABEL_RANK] == str(rank) and metadata(body)[LABEL_RUN] == "run-basic"
        labels = body["labels"]
        assert labels[LABEL_CLUSTER] == "tp-gcp-basic" and labels[LABEL_RUN] == "run-basic"
        assert labels[LABEL_OWNER] and labels[LABEL_CREATED] and labels[LABEL_RANK] == str(rank)
        assert all(LABEL_VALUE.match(v) for v in labels.values())
        assert body["networkInterfaces"][0]["accessConfigs"][0]["type"] == "ONE_TO_ONE_NAT"

    instances = gce.instances("us-central1-a")
    assert [i["status"] for i in instances] == ["RUNNING", "RUNNING"]
    # The exact owner (launching process) rides in the metadata; the label only holds a sanitised copy.
    assert metadata(instances[0])[LABEL_OWNER] == cluster.owner["owner"] and "@" in cluster.owner["owner"]

    assert_reports_launched_cluster(gcp, cluster, "tp-gcp-basic", "run-basic")

    # GCE refuses to delete a placement policy that instances use: the teardown must delete them first.
    with pytest.raises(exceptions.BadRequest) as in_use:
        gcp.policies.delete(project=PROJECT, region="us-central1", resource_policy=policy["name"])
    assert in_use.value.errors[0]["reason"] == "resourceInUseByAnotherResource"

    gce.clear_calls()
    assert gcp.terminate("tp-gcp-basic") is True
    deletes = [c.path.rsplit("/", 2)[-2] for c in gce.calls("DELETE")]
    assert deletes == ["instances", "instances", "resourcePolicies"]
    assert all(c.status == 200 for c in gce.calls("DELETE"))
    assert left(gce, "tp-gcp-basic") == [] and gce.policies() == []
    assert gcp.describe("tp-gcp-basic") is None
    assert gcp.nodes_alive(cluster) == {n.name: False for n in cluster.nodes}
    assert gcp.terminate("tp-gcp-basic") is False  # idempotent



def test_nodes_run_as_the_service_account_the_cluster_names(gcp: GcpProvider, gce: GceServer) -> None:
    """The nodes reach the dataset and checkpoints with their own credentials: the VMs' service account, under the
    scopes of cluster.gcp.service_account (short names become scope URLs)."""
    email = "trainer@trainpipe-test.iam.gserviceaccount.com"
    account = {"email": email, "scopes": ["devstorage.read_write", "compute"]}
    gcp.launch("tp-gcp-account", spec(regions=("us-central1",), gcp={"service_account": account}), "run-account")
    try:
        assert [b["serviceAccounts"] for b in inserts(gce)] == [[{"email": email, "scopes": [
            "https://www.googleapis.com/auth/devstorage.read_write", "https://www.googleapis.com/auth/compute"]}]] * 2
    finally:
        assert gcp.terminate("tp-gcp-account")

def test_spot_parameters_bundled_ssds_preemption_and_idempotent_relaunch(gcp: GcpProvider, gce: GceServer) -> None:
    job = spec(accelerator="H100", spot="only", zones=("us-central1-c",))
    first = gcp.launch("tp-gcp-spot", job, "run-spot")
    assert (first.instance_type, first.market, first.owner["zone"]) == ("a3-highgpu-8g", "spot", "us-central1-c")
    for body in inserts(gce):
        assert body["scheduling"] == {"provisioningModel": "SPOT", "instanceTerminationAction": "DELETE",
                                      "onHostMaintenance": "TERMINATE", "automaticRestart": False}
        # A3 comes with its local SSDs: the request names only the boot disk.
        assert [d.get("type", "PERSISTENT") for d in body["disks"]] == ["PERSISTENT"]

    # A retried launch (same cluster, same candidate, same names) adopts what is running: no second cluster.
    gce.clear_calls()
    again = gcp.launch("tp-gcp-spot", job, "run-spot")
    assert again.owner["instances"] == first.owner["instances"] and inserts(gce) == []
    assert len(gce.instances("us-central1-c")) == 2

    # GCE reclaims rank 1: STOPPING for the notice period, then it is deleted.
    before = time.time()
    gce.preempt("us-central1-c", first.nodes[1].name)
    [notice] = gcp.preemption_notices(first)
    assert notice.node == first.nodes[1].name and "spot preempted" in notice.reason
    assert before - 1 <= notice.deadline - gcp_module.SPOT_NOTICE_S <= time.time() + 1
    assert gcp.nodes_alive(first) == {first.nodes[0].name: True, first.nodes[1].name: False}

    assert gcp.terminate("tp-gcp-spot") and left(gce, "tp-gcp-spot") == []


def test_failover_through_capacity_and_a_partial_launch_that_is_rolled_back(gcp: GcpProvider,
                                                                           gce: GceServer) -> None:
    # Spot candidates in order: us-central1-a, -b, -c, europe-west4-a (same price; region preference breaks ties).
    gce.fail("ZONE_RESOURCE_POOL_EXHAUSTED", zone="us-central1-a")
    gce.fail("ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS", zone="us-central1-b", after_n_ok_inserts=1)  # rank 1
    gce.fail("UNSUPPORTED_OPERATION", zone="us-central1-c")
    cluster = gcp.launch("tp-gcp-failover", spec(spot="prefer"), "run-failover")

    assert [(a.zone, a.market, a.outcome) for a in gcp.last_attempts] == [
        ("us-central1-a", "spot", "capacity"), ("us-central1-b", "spot", "capacity"),
        ("us-central1-c", "spot", "capacity"), ("europe-west4-a", "spot", "launched")]
    assert "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS" in (gcp.last_attempts[1].error or "")
    assert cluster.owner["zone"] == "europe-west4-a" and len(gce.instances("europe-west4-a")) == 2
    # The partial launch in us-central1-b (rank 0 started, rank 1 refused) was rolled back, policy included.
    assert [c.path.rsplit("/", 1)[-1] for c in gce.calls("DELETE", "/zones/us-central1-b/")] == [
        "tp-gcp-failover-node-0"]
    assert gce.instances("us-central1-b") == [] and gce.policies("us-central1") == []
    assert [p["name"] for p in gce.policies("europe-west4")] == ["tp-gcp-failover-compact"]
    assert gcp.terminate("tp-gcp-failover") and left(gce, "tp-gcp-failover") == []


def test_quota_blocks_the_region_and_prefer_falls_back_to_on_demand(gcp: GcpProvider, gce: GceServer) -> None:
    gce.fail("ZONE_RESOURCE_POOL_EXHAUSTED", zone="us-central1-a", spot=True)
    gce.fail("QUOTA_EXCEEDED", region="us-central1", spot=True)  # PREEMPTIBLE_NVIDIA_A100_GPUS: spot only
    gce.fail("ZONE_RESOURCE_POOL_EXHAUSTED", zone="europe-west4-a", spot=True)
    cluster = gcp.launch("tp-gcp-quota", spec(spot="prefer"), "run-quota")

    assert [(a.zone, a.market, a.outcome) for a in gcp.last_attempts] == [
        ("us-central1-a", "spot", "capacity"), ("us-central1-b", "spot", "quota"),
        ("us-central1-c", "spot", "skipped"), ("europe-west4-a", "spot", "capacity"),
        ("us-central1-a", "on-demand", "launched")]
    assert "QUOTA_EXCEEDED" in (gcp.last_attempts[1].error or "") and "us-central1" in (gcp.last_attempts[1].error
                                                                                        or "")
    assert (cluster.market, cluster.owner["zone"]) == ("on-demand", "us-central1-a")
    assert gcp.terminate("tp-gcp-quota") and left(gce, "tp-gcp-quota") == []


def test_quota_everywhere_is_one_line_and_leaves_nothing(gcp: GcpProvider, gce: GceServer) -> None:
    # The other shape of a quota refusal: the insert itself answers 403 quotaExceeded.
    gce.fail("quotaExceeded", http_status=403)
    with pytest.raises(QuotaEverywhere) as caught:
        gcp.launch("tp-gcp-noquota", spec(zones=("us-central1-a", "europe-west4-a")), "run-noquota")
    assert [a.outcome for a in caught.value.attempts] == ["quota", "quota"]
    assert str(caught.value).startswith("no candidate launched (a2-highgpu-8g us-central1-a on-demand: quota; ")
    assert "\n" not in str(caught.value)
    # Each region's placement policy was created before the refused insert, and rolled back after it.
    assert len(gce.calls("DELETE", "/resourcePolicies/")) == 2 and gce.policies() == []
    assert left(gce, "tp-gcp-noquota") == []


@pytest.mark.parametrize(("code", "status", "error", "fix"), [
    ("forbidden", 403, AuthError, "roles/compute.instanceAdmin.v1"),
    ("accessNotConfigured", 403, AuthError, "gcloud services enable compute.googleapis.com"),
    ("invalid", 400, InvalidRequestError, "fix the request"),
])
def test_permission_and_invalid_requests_stop_at_once(gcp: GcpProvider, gce: GceServer, code: str, status: int,
                                                      error: type[Exception], fix: str) -> None:
    fault = gce.fail(code, http_status=status)
    with pytest.raises(error) as caught:
        gcp.launch("tp-gcp-stop", spec(spot="prefer"), "run-stop")
    message = str(caught.value)
    assert message.startswith(f"gcp: launch tp-gcp-stop on a2-highgpu-8g us-central1-a spot: {code}: ")
    assert fix in message and "\n" not in message
    assert [a.outcome for a in gcp.last_attempts] == ["invalid"]
    assert fault.fired == 1  # no further candidate was tried
    assert left(gce, "tp-gcp-stop") == [] and gcp.describe("tp-gcp-stop") is None


def test_a_refused_second_insert_rolls_back_the_first(gcp: GcpProvider, gce: GceServer) -> None:
    # Rank 0's insert is accepted (its operation still running), rank 1's is refused outright.
    gce.fail("invalid", zone="us-central1-a", http_status=400, after_n_ok_inserts=1)
    with pytest.raises(InvalidRequestError):
        gcp.launch("tp-gcp-half", spec(regions=("us-central1",)), "run-half")
    assert [c.path.rsplit("/", 1)[-1] for c in gce.calls("DELETE", "/instances/")] == ["tp-gcp-half-node-0"]
    assert left(gce, "tp-gcp-half") == [] and gce.policies() == []


def test_transient_api_errors_are_retried_with_the_same_request_id(gcp: GcpProvider, gce: GceServer,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    gce.fail("backendError", zone="us-central1-a", http_status=503, times=2)
    with caplog.at_level(logging.WARNING, logger="infra.compute.providers.gcp.api"):
        cluster = gcp.launch("tp-gcp-retry", spec(regions=("us-central1",)), "run-retry")
    assert [a.outcome for a in gcp.last_attempts] == ["launched"] and len(cluster.nodes) == 2
    posts = gce.calls("POST", "/zones/us-central1-a/instances$")
    assert [c.status for c in posts] == [503, 503, 200, 200]
    assert len({c.query["requestId"] for c in posts[:3]}) == 1  # a repeat of one request, never a second VM
    retries = [r.getMessage() for r in caplog.records if "transient ServiceUnavailable" in r.getMessage()]
    assert len(retries) == 2 and "retry 1 of 4" in retries[0] and "retry 2 of 4" in retries[1]
    assert gcp.terminate("tp-gcp-retry") and left(gce, "tp-gcp-retry") == []


def test_a_policy_left_by_a_crashed_teardown_is_listed_and_swept(gcp: GcpProvider, gce: GceServer) -> None:
    cluster = gcp.launch("tp-gcp-orphan", spec(nodes=1, regions=("europe-west4",)), "run-orphan")
    for node in cluster.nodes:  # a teardown that died after deleting the instances
        gcp.instances.delete_unary(project=PROJECT, zone=cluster.owner["zone"], instance=node.name)
    [record] = [r for r in gcp.list_clusters() if r.name == "tp-gcp-orphan"]
    assert (record.run_id, record.nodes, record.owner_alive) == ("run-orphan", 0, False)
    assert gcp.terminate("tp-gcp-orphan") is True and gce.policies() == []


def test_zones_scope_what_is_looked_at(gcp: GcpProvider, gce: GceServer, monkeypatch: pytest.MonkeyPatch) -> None:
    gcp.launch("tp-gcp-scope", spec(nodes=1, regions=("us-central1",)), "run-scope")
    monkeypatch.setenv("TRAINPIPE_GCP_ZONES", "europe-west4-a")
    elsewhere = GcpProvider(catalog=small_catalog(), project=PROJECT, credentials=AnonymousCredentials(),
                            api_endpoint=gce.endpoint, bootstrap=False)
    assert elsewhere.describe("tp-gcp-scope") is None and elsewhere.list_clusters() == []
    assert gcp.terminate("tp-gcp-scope") and left(gce, "tp-gcp-scope") == []


def test_names_and_labels_follow_gce_rules() -> None:
    owner = "Jane.Doe@Build-Host.example.com:4242:1700000000"
    assert LABEL_VALUE.match(label_value(owner)) and label_value("run_2024-01-01") == "run_2024-01-01"
    long = "x" * 100
    assert len(label_value(long)) == 63 and label_value(long) != label_value(long + "y")
    for cluster in ("tp-abc", "Tp_Run.7", "7-starts-with-digit", "tp-" + "a" * 80):
        for suffix in ("node-0", "node-15", "compact"):
            name = resource_name(cluster, suffix)
            assert NAME.match(name) and name.endswith(suffix), name
    assert resource_name("tp-" + "a" * 80, "node-0") != resource_name("tp-" + "a" * 81, "node-0")


def test_startup_script_is_valid_bash() -> None:
    script = startup_script(generate_host_key())
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    assert "google-local-nvme-ssd-" in script and f"{MOUNT}/trainpipe/ckpt" in script


def _operation(code: str, status: int) -> exceptions.GoogleAPICallError:
    error = operation_error(compute_v1.Operation(
        status=compute_v1.Operation.Status.DONE, http_error_status_code=status, http_error_message="SAID",
        error=compute_v1.Error(errors=[compute_v1.Errors(code=code, message="m")])))
    assert error is not None
    return error


def _http(reason: str, status: int) -> exceptions.GoogleAPICallError:
    return exceptions.from_http_status(status, "m", errors=[{"reason": reason, "message": "m", "domain": "global"}])


def test_the_watchs_reads_are_asked_once_while_compute_engine_fails_them(gcp: GcpProvider, gce: GceServer) -> None:
    """The preemption watch backs off on its own: the provider's 5 attempts under each of its reads (15 s of
    backoff, 19 s measured) only blocked its round. Other calls keep their retries."""
    cluster = gcp.launch("tp-gcp-watch", spec(regions=("us-central1",)), "run-watch")
    gce.clear_calls()
    gce.outage.start(60)
    try:
        for read in (gcp.nodes_alive, gcp.preemption_notices):
            with pytest.raises(LaunchError, match="backendError"):
                read(cluster)
        assert len(gce.calls("GET", r"/instances$")) == 2
    finally:
        gce.outage.end()
    assert gcp.terminate("tp-gcp-watch")


@pytest.mark.parametrize(("error", "kind"), [
    *[(_operation(code, 503), CapacityError) for code in ("ZONE_RESOURCE_POOL_EXHAUSTED",
                                                          "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
                                                          "REGION_RESOURCE_POOL_EXHAUSTED", "GCE_STOCKOUT")],
    (_operation("UNSUPPORTED_OPERATION", 400), CapacityError),
    (_operation("QUOTA_EXCEEDED", 403), QuotaError),
    (_operation("PREEMPTIBLE_GPUS_QUOTA_EXCEEDED", 403), QuotaError),
    (_http("quotaExceeded", 403), QuotaError),
    (_http("rateLimitExceeded", 403), CapacityError),
    (_http("forbidden", 403), AuthError),
    (_http("insufficientPermissions", 403), AuthError),
    (_http("accessNotConfigured", 403), AuthError),
    (_http("required", 401), AuthError),
    (_http("invalid", 400), InvalidRequestError),
    (_http("notFound", 404), InvalidRequestError),
    (_operation("INVALID_FIELD_VALUE", 400), InvalidRequestError),
])
def test_launch_errors_are_classified(error: exceptions.GoogleAPICallError, kind: type[Exception]) -> None:
    classified = classify(error, "launch x")
    code = error.errors[0]["reason"] if isinstance(error.errors[0], dict) else error.errors[0].code
    assert type(classified) is kind and str(classified).startswith(f"gcp: launch x: {code}: m: ")


def test_operation_errors_have_the_shape_extended_operation_raises() -> None:
    error = _operation("ZONE_RESOURCE_POOL_EXHAUSTED", 503)
    assert isinstance(error, exceptions.ServiceUnavailable) and error.message == "SAID"
    assert operation_error(compute_v1.Operation(status=compute_v1.Operation.Status.DONE)) is None


@pytest.mark.parametrize(("error", "kind", "words"), [
    (auth_exceptions.DefaultCredentialsError("none"), AuthError, "gcloud auth application-default login"),
    (auth_exceptions.RefreshError("expired"), AuthError, "GOOGLE_APPLICATION_CREDENTIALS"),
    (requests.ConnectionError("reset"), LaunchError, "check the network"),
    (_http("backendError", 500), LaunchError, "retry later"),
])
def test_errors_outside_the_api_are_classified(error: Exception, kind: type[Exception], words: str) -> None:
    classified = classify(error, "launch x")
    assert type(classified) is kind and words in str(classified)
    assert classified.transient == (kind is LaunchError)


@pytest.mark.parametrize(("error", "transient"), [
    (_http("backendError", 503), True), (_http("internalError", 500), True), (_http("rateLimitExceeded", 429), True),
    (_http("rateLimitExceeded", 403), True), (requests.ConnectionError("reset"), True),
    (_http("forbidden", 403), False), (_http("quotaExceeded", 403), False), (_http("invalid", 400), False),
    (_operation("ZONE_RESOURCE_POOL_EXHAUSTED", 503), True),
])
def test_which_api_errors_are_retried(error: Exception, transient: bool) -> None:
    # A stockout is a 503 too, but it only ever comes out of an operation, never out of the call that is repeated.
    assert is_transient(error) is transient


def test_the_lazily_imported_compute_module_is_whole_for_threads_that_touch_it_at_once() -> None:
    """A launch and its heartbeat thread reach compute_v1 together; importlib's LazyLoader (Python 3.11) let 7 of 8
    such threads see the module half-executed (AttributeError: no attribute 'Operation'). A fresh interpreter: this
    one imported the module long ago."""
    script = (
        "import sys, threading\n"
        "from infra.compute.providers.gcp import provider\n"
        "assert 'google.cloud.compute_v1' not in sys.modules, 'imported before first use'\n"
        "errors, start = [], threading.Barrier(8)\n"
        "def touch():\n"
        "    start.wait()\n"
        "    try:\n"
        "        provider.compute_v1.Operation.Status.DONE, provider.compute_v1.InstancesClient\n"
        "    except Exception as exc:\n"
        "        errors.append(repr(exc))\n"
        "threads = [threading.Thread(target=touch) for _ in range(8)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "print(errors)\n"
        "sys.exit(1 if errors else 0)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stdout + done.stderr
