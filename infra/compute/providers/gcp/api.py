"""The Compute Engine API as the GCP provider calls it: the lazily imported client library, one client per kind on
Application Default Credentials (or the ones given), every call repeated with backoff while it fails transiently,
operations polled to the end, and where instances and policies are looked for (TRAINPIPE_GCP_ZONES)."""

from __future__ import annotations

import importlib
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import google.auth
import requests
from google.api_core import exceptions
from google.auth import exceptions as auth_exceptions
from google.auth.credentials import Credentials

from infra.compute.providers.gcp.errors import InvalidRequestError, LaunchError, classify, is_transient, operation_error
from infra.compute.providers.operations import call_retrying, wait_done


class _LazyModule:
    """A module imported on first attribute access: google.cloud.compute_v1 takes ~1.5 s to import, and every
    `trainpipe status` and sweep builds this provider, mostly on machines that never call GCP.

    Not importlib's LazyLoader: on Python 3.11 two threads touching it at once (a launch and its heartbeat thread) can
    see the module half-executed (AttributeError on a class it defines). The import here happens once, under a lock."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        module = self._module
        if module is None:
            with self._lock:
                if self._module is None:
                    self._module = importlib.import_module(self._name)
                module = self._module
        return getattr(module, attr)


compute_v1: Any = sys.modules.get("google.cloud.compute_v1") or _LazyModule("google.cloud.compute_v1")

T = TypeVar("T")

SCOPES = ["https://www.googleapis.com/auth/cloud-platform"]
WAIT_S = 600.0  # for an operation to finish / instances to reach RUNNING
POLL_FIRST_S = 0.2
POLL_MAX_S = 3.0
API_ATTEMPTS = 5  # one call, repeated while it fails transiently
RETRY_FIRST_S = 1.0
API_TIMEOUT_S = 60.0
GCE_PRODUCT_FILE = Path("/sys/class/dmi/id/product_name")
API_ERRORS = (exceptions.GoogleAPICallError, auth_exceptions.GoogleAuthError, requests.RequestException)


def region_of(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def short_name(url: str) -> str:
    return url.rsplit("/", 1)[-1]


class ComputeApi:
    """The provider's API plumbing (a base of GcpProvider, whose constructor sets these)."""

    _zones: tuple[str, ...] | None
    _project: str | None
    _credentials: Credentials | None
    _api_endpoint: str | None
    _clients: dict[type, Any]

    @property
    def project(self) -> str:
        """The constructor's, else TRAINPIPE_GCP_PROJECT, else the one Application Default Credentials name."""
        if self._project is None:
            try:
                _, self._project = google.auth.default(scopes=SCOPES)
            except auth_exceptions.DefaultCredentialsError:
                self._project = None
            if not self._project:
                raise InvalidRequestError("gcp: no project: set TRAINPIPE_GCP_PROJECT or run "
                                          "`gcloud config set project PROJECT`")
        return self._project

    def _client(self, kind: type) -> Any:
        """One client per kind, built on first use: Application Default Credentials unless some were given."""
        if kind not in self._clients:
            if self._credentials is None:
                self._credentials, found = google.auth.default(scopes=SCOPES)
                self._project = self._project or found
            options = {"api_endpoint": self._api_endpoint} if self._api_endpoint else None
            # REST is the only transport Compute Engine offers; it also lets tests point it at a local server.
            self._clients[kind] = kind(credentials=self._credentials, transport="rest", client_options=options)
        return self._clients[kind]

    @property
    def instances(self) -> compute_v1.InstancesClient:
        return self._client(compute_v1.InstancesClient)

    @property
    def images(self) -> compute_v1.ImagesClient:
        return self._client(compute_v1.ImagesClient)

    @property
    def policies(self) -> compute_v1.ResourcePoliciesClient:
        return self._client(compute_v1.ResourcePoliciesClient)

    def _has_credentials(self) -> bool:
        """Whether Application Default Credentials could exist, decided locally: google.auth.default() would probe
        the metadata server over the network, seconds lost on every machine that is not on GCE."""
        if self._credentials is not None or os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
            return True
        config = os.environ.get("CLOUDSDK_CONFIG") or (
            Path(os.environ["APPDATA"]) / "gcloud" if os.name == "nt" and "APPDATA" in os.environ
            else Path.home() / ".config" / "gcloud")
        if (Path(config) / "application_default_credentials.json").is_file():
            return True
        try:
            return GCE_PRODUCT_FILE.read_text().strip().startswith("Google")
        except OSError:
            return False

    def _in_scope(self, zone_or_region: str) -> bool:
        """TRAINPIPE_GCP_ZONES limits where clusters are looked for; without it every zone is (one aggregated call
        covers them all, and limiting to the catalog's zones would only hide leftovers in zones it no longer has)."""
        if self._zones is None:
            return True
        return zone_or_region in self._zones or zone_or_region in {region_of(z) for z in self._zones}

    def _api(self, doing: str, call: Callable[[], T], attempts: int = API_ATTEMPTS) -> T:
        """One Compute Engine call, repeated with backoff while it fails transiently; every retry is logged. Calls
        pass retry=None so that the library's own silent retries do not stack under these."""
        return call_retrying(call, lambda exc: isinstance(exc, API_ERRORS) and is_transient(exc),
                             lambda exc: f"{type(exc).__name__} ({' '.join(str(exc).split())})", f"gcp: {doing}",
                             attempts, RETRY_FIRST_S)

    def _get(self, doing: str, call: Callable[[], T]) -> T | None:
        try:
            return self._api(doing, call)
        except exceptions.NotFound:
            return None

    def _call(self, doing: str, action: Callable[[], T]) -> T:
        try:
            return action()
        except API_ERRORS as exc:
            raise classify(exc, doing) from None

    def _wait(self, operation: compute_v1.Operation, doing: str) -> compute_v1.Operation:
        """The finished operation. Polls from 0.2 s up to 3 s apart with its own operations clients: the library's
        ExtendedOperation polls from 1 s up to 20 s (slow for an insert done in seconds), and its poller is built
        without the client's api_endpoint, so it would not even ask the endpoint the provider was given."""
        return wait_done(operation, lambda op: op.status == compute_v1.Operation.Status.DONE,
                         lambda op: self._api(doing, lambda: self._refresh(op)),
                         f"gcp: {doing}: operation {operation.name}", WAIT_S, POLL_FIRST_S, POLL_MAX_S)

    def _refresh(self, operation: compute_v1.Operation) -> compute_v1.Operation:
        if operation.zone:
            return self._client(compute_v1.ZoneOperationsClient).get(
                project=self.project, zone=short_name(operation.zone), operation=operation.name, retry=None,
                timeout=API_TIMEOUT_S)
        return self._client(compute_v1.RegionOperationsClient).get(
            project=self.project, region=short_name(operation.region), operation=operation.name, retry=None,
            timeout=API_TIMEOUT_S)

    def _done(self, operation: compute_v1.Operation, doing: str) -> None:
        error = operation_error(self._wait(operation, doing))
        if error is not None:
            raise classify(error, doing)

    def _finish(self, operations: list[compute_v1.Operation], doing: str) -> list[LaunchError]:
        """Wait for every operation (the list then holds the finished ones); the errors of those that failed."""
        failures = []
        for index, operation in enumerate(operations):
            operations[index] = self._wait(operation, doing)
            error = operation_error(operations[index])
            if error is not None:
                failures.append(classify(error, doing))
        return failures
