"""Azure Resource Manager as the Azure provider calls it: the three SDK clients (resources, compute, network) on one
credential, the subscription and endpoint they use, and long-running operations waited for under a deadline that a
cancelled run ends.

Transient failures (429, 5xx, dropped connections) are retried by azure-core's own RetryPolicy (exponential backoff
with jitter, honouring Retry-After, logged by azure-core) under the limits set here; what outlives them is classified
(errors.classify). ARM's create-or-update is idempotent by name, so a repeated PUT never starts a second resource."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from azure.core.exceptions import ResourceNotFoundError
from azure.core.polling import LROPoller

from infra.cancel import CANCEL
from infra.compute.providers.azure.errors import API_ERRORS, InvalidRequestError, classify
from infra.compute.providers.cloud_errors import retry_later
from infra.compute.providers.operations import raise_first

T = TypeVar("T")

SUBSCRIPTION_ENVS = ("TRAINPIPE_AZURE_SUBSCRIPTION", "AZURE_SUBSCRIPTION_ID")
ENDPOINT_ENV = "TRAINPIPE_AZURE_ENDPOINT"  # another ARM endpoint (a sovereign cloud, a proxy)
WAIT_S = 900.0  # for one long-running operation (a VM allocation takes minutes on Azure)
POLL_S = 2.0  # between polls of an operation when ARM sends no Retry-After
WAIT_STEP_S = 0.2  # how often a wait looks at the run's cancellation
API_RETRIES = 4  # azure-core's retries of one call that fails transiently
RETRY_FIRST_S = 0.8  # its backoff factor: 0.8, 1.6, 3.2 s… with jitter


class ArmApi:
    """The provider's ARM plumbing (a base of AzureProvider, whose constructor sets these)."""

    _subscription: str | None
    _credential: Any
    _endpoint: str | None
    _clients: dict[str, Any]
    _lock: threading.Lock

    @property
    def subscription(self) -> str:
        found = self._subscription or next((os.environ[n] for n in SUBSCRIPTION_ENVS if os.environ.get(n)), None)
        if not found:
            raise InvalidRequestError("azure: no subscription: set AZURE_SUBSCRIPTION_ID (az account show --query id)")
        return found

    @property
    def arm_endpoint(self) -> str | None:
        """The Resource Manager endpoint the provider (and its nodes) call; None: Azure's own."""
        return self._endpoint or os.environ.get(ENDPOINT_ENV) or None

    def _has_subscription(self) -> bool:
        """Whether anything of ours can exist, decided locally: without a subscription there is nowhere to look, and
        `trainpipe status` and sweeps ask every provider on machines that never use Azure."""
        return bool(self._subscription or any(os.environ.get(n) for n in SUBSCRIPTION_ENVS))

    def _client(self, kind: str) -> Any:
        """One client per kind, built on first use on the given credential, else DefaultAzureCredential (environment,
        workload identity, managed identity, Azure CLI: the SDK's own sources, never a command line)."""
        with self._lock:
            if kind not in self._clients:
                if self._credential is None:
                    from azure.identity import DefaultAzureCredential

                    self._credential = DefaultAzureCredential(exclude_interactive_browser_credential=True)
                endpoint = self.arm_endpoint
                options = {"polling_interval": POLL_S, "retry_total": API_RETRIES,
                           "retry_backoff_factor": RETRY_FIRST_S}
                if kind == "resources":
                    from azure.mgmt.resource.resources import ResourceManagementClient as client_class
                elif kind == "compute":
                    from azure.mgmt.compute import ComputeManagementClient as client_class
                else:
                    from azure.mgmt.network import NetworkManagementClient as client_class
                self._clients[kind] = client_class(self._credential, self.subscription, base_url=endpoint, **options)
            return self._clients[kind]

    @property
    def resources(self) -> Any:
        return self._client("resources")

    @property
    def compute(self) -> Any:
        return self._client("compute")

    @property
    def network(self) -> Any:
        return self._client("network")

    def _call(self, doing: str, action: Callable[[], T]) -> T:
        """action, with every ARM failure that outlived the retries turned into the LaunchError failover acts on."""
        try:
            return action()
        except API_ERRORS as exc:
            raise classify(exc, doing) from None

    @staticmethod
    def _get(action: Callable[[], Any]) -> dict[str, Any] | None:
        """A resource as ARM's JSON, None when it does not exist."""
        try:
            return json_of(action())
        except ResourceNotFoundError:
            return None

    @staticmethod
    def _wait(pollers: list[LROPoller[Any]], doing: str) -> list[BaseException]:
        """Wait for every operation (each polls in its own thread); the errors of those that failed. A cancel stops
        the wait, not the operations: what they create is tagged, and the caller's cleanup looks for it."""
        deadline = time.monotonic() + WAIT_S
        failures: list[BaseException] = []
        for poller in pollers:
            while not poller.done():
                if time.monotonic() > deadline:
                    raise retry_later(f"azure: {doing}: an operation was not done after {WAIT_S:.0f}s: retry later")
                CANCEL.wait(WAIT_STEP_S)
            try:
                poller.result()
            except API_ERRORS as exc:
                failures.append(exc)
        return failures

    def _finish(self, pollers: list[LROPoller[Any]], doing: str) -> None:
        """Wait for every operation; the first failure, classified, is raised (the others logged)."""
        raise_first([classify(failure, doing) for failure in self._wait(pollers, doing)], f"azure: {doing}")


def json_of(model: Any) -> dict[str, Any]:
    """ARM's JSON of an SDK model (the azure-mgmt models are mappings over it)."""
    return dict(model.as_dict()) if hasattr(model, "as_dict") else dict(model)
