"""One trainpipe run as one MLflow run: found again by its trainpipe run id, fed by a bounded background sender.

Imported only when a job has a tracking.mlflow section (mlflow-skinny is an optional extra). The orchestrator logs
from its polling loop; nothing here may hold a run up: every request has a timeout, a server that does not answer is
logged once and its metrics wait in a bounded buffer (the oldest dropped past it, counted), and close() gives the
rest one deadline to drain. What was not recorded is said in the outcome, which the run's summary holds.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.exceptions import RestException

from infra.job.tracking_spec import MlflowSpec, experiment_name

RUN_ID_TAG = "trainpipe.run_id"
# log_batch's own limits per request (MLflow's REST API).
MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100
MAX_VALUE = 6000  # a param's value (MLflow 2.x and later); a longer one is cut and says so
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)  # between tries while the server does not answer
CLOSING_RETRY_S = 0.25
_BAD_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")
# Statuses a run ends in: trainpipe's (summary.status) to MLflow's.
FINAL_STATUS = {"completed": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}


class TrackingError(RuntimeError):
    """The tracking server cannot be used: one line naming the field and the fix, never a credential."""


def use_credentials(spec: MlflowSpec, credentials: Mapping[str, str]) -> None:
    """The client's request bounds and credentials, where MLflow's client reads them: the process environment.

    MLflow takes its credentials (MLFLOW_TRACKING_TOKEN, ...) only from there. Its own retries are cut to one, at
    once (unless set): the sender below retries with its own bound, where MLflow's backoff would hold a request for
    minutes; the one retry takes a fresh connection where the pool's was closed by a server that restarted."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, math.ceil(spec.send_timeout_s))))
    os.environ.update({name: value for name, value in credentials.items()})


def client_for(spec: MlflowSpec) -> MlflowClient:
    return MlflowClient(tracking_uri=spec.uri, registry_uri=spec.uri)


def describe_failure(spec: MlflowSpec, exc: Exception) -> str:
    """Why a request failed, without anything the server echoed back (it may quote a credential)."""
    # RestException: the server answered with an error; any other failure (MLflow wraps a refused connection or a
    # timeout in a plain MlflowException) is a server that did not answer.
    if isinstance(exc, RestException):
        status = exc.get_http_status_code()
        if status in (401, 403):
            return (f"tracking.mlflow.secrets: {spec.uri} refused the credentials (HTTP {status}): check "
                    "MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD")
        # A refusal of the request itself (a bad source, a name): its own words; the server's words on other
        # failures may echo what was sent.
        said = f": {exc.message[:200]}" if 400 <= status < 500 else ""
        return f"tracking.mlflow.uri: {spec.uri} answered {exc.error_code} (HTTP {status}){said}"
    cause = exc.__cause__ or exc.__context__ or exc  # MLflow's wrapper says less than what it wraps
    return f"tracking.mlflow.uri: {spec.uri} does not answer ({type(cause).__name__}): start the server or fix the URI"


def writable_experiment(client: MlflowClient, spec: MlflowSpec, job_name: str) -> str:
    """The experiment's id, created when missing; a tag written to it proves the credentials may write. Raises
    TrackingError. What plan checks before anything is launched, and what a run opens its MLflow run in."""
    name = experiment_name(spec, job_name)
    try:
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            experiment_id = client.create_experiment(name, tags={"trainpipe.job": job_name})
        elif experiment.lifecycle_stage != "active":
            raise TrackingError(f"tracking.mlflow.experiment: {name} is deleted on {spec.uri}: restore it "
                                "(mlflow experiments restore) or name another")
        else:
            experiment_id = experiment.experiment_id
        client.set_experiment_tag(experiment_id, "trainpipe.job", job_name)
    except TrackingError:
        raise
    except Exception as exc:
        raise TrackingError(describe_failure(spec, exc)) from None
    return str(experiment_id)


def check_server(spec: MlflowSpec, job_name: str, credentials: Mapping[str, str]) -> str:
    """Plan's check: the server answers and the experiment can be written; its id."""
    use_credentials(spec, credentials)
    return writable_experiment(client_for(spec), spec, job_name)


def flatten(data: Mapping[str, Any], drop: Iterable[str] = ()) -> dict[str, str]:
    """A nested record as MLflow params: dotted keys, lists as JSON, values cut to MLflow's bound. drop: dotted
    prefixes left out (the secrets' references)."""
    dropped = tuple(drop)
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if prefix and any(prefix == d or prefix.startswith(f"{d}.") for d in dropped):
            return
        if isinstance(value, Mapping) and value:
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
            return
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        flat[prefix] = text if len(text) <= MAX_VALUE else text[:MAX_VALUE - 12] + "…(cut)"

    walk("", data)
    return flat


def metric_key(name: str) -> str:
    return _BAD_KEY.sub("_", name)


def numeric_metrics(record: Mapping[str, Any], skip: Iterable[str] = ("step", "time", "total_steps")) -> dict[
        str, float]:
    """Every numeric key of a metrics record (nested ones dotted), booleans and non-finite values left out."""
    skipped = set(skip)
    out: dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out[metric_key(prefix)] = float(value)

    for key, value in record.items():
        if key not in skipped:
            walk(str(key), value)
    return out


@dataclass
class TrackingOutcome:
    """What the run's summary says of its MLflow run (summary.tracking)."""

    uri: str
    experiment: str
    mlflow_run_id: str | None = None
    continued: bool = False  # a recovery's or a rerun's: the run id's MLflow run was found and continued
    points_sent: int = 0
    points_dropped: int = 0  # past the buffer's bound while the server did not answer (the oldest first)
    points_unsent: int = 0  # still buffered when close()'s deadline passed
    api_calls: int = 0
    unreachable_s: float = 0.0  # how long the server did not answer, all spells together
    errors: list[str] = field(default_factory=list)  # one line each: what was not recorded and why
    latency_s: list[float] = field(default_factory=list)  # per metrics record: its line's time to MLflow's answer
    # What tracking cost the run's own thread (open, every log call, close and the mirror): the sender's requests
    # run beside it and are not counted.
    foreground_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        lat = sorted(data.pop("latency_s"))
        data["foreground_s"] = round(data["foreground_s"], 3)
        data["latency_s"] = ({"median": round(lat[len(lat) // 2], 3), "max": round(lat[-1], 3), "records": len(lat)}
                             if lat else None)
        return data


@dataclass(frozen=True)
class _Point:
    metric: Metric
    line_time: float | None  # the script's own time of the record (the first metric of a record carries it)


class MlflowRun:
    """The MLflow run of one trainpipe run. log_* queue; one daemon thread sends; close() ends it with a status."""

    def __init__(self, spec: MlflowSpec, client: MlflowClient, mlflow_run_id: str, outcome: TrackingOutcome,
                 logger: logging.Logger | logging.LoggerAdapter[Any]) -> None:
        self.spec, self.client, self.id, self.outcome, self.logger = spec, client, mlflow_run_id, outcome, logger
        self._points: deque[_Point] = deque()
        self._tags: dict[str, str] = {}
        self._wake = threading.Condition()
        self._closing = False
        self._closed = False
        self._in_flight = 0  # points and tags taken by the sender, not yet answered
        self._in_flight_points = 0
        self._retry_now = threading.Event()
        self._down_since: float | None = None
        self._said_down = False
        self._sender = threading.Thread(target=self._send_loop, name=f"mlflow-{mlflow_run_id[:8]}", daemon=True)
        self._sender.start()

    # -- opening ----------------------------------------------------------------------------------------------------

    @classmethod
    def open(cls, spec: MlflowSpec, job_name: str, run_id: str, credentials: Mapping[str, str],
             params: Mapping[str, str], tags: Mapping[str, str],
             logger: logging.Logger | logging.LoggerAdapter[Any]) -> MlflowRun:
        """The run id's MLflow run: found by its tag and continued (a recovery, a rerun), else created with the
        params. Raises TrackingError where the server cannot be used at all."""
        started = time.perf_counter()
        use_credentials(spec, credentials)
        client = client_for(spec)
        experiment_id = writable_experiment(client, spec, job_name)
        outcome = TrackingOutcome(spec.uri, experiment_name(spec, job_name))
        try:
            found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{run_id}'",
                                       max_results=2)
            outcome.api_calls += 1
            if found:
                run = found[0]
                client.update_run(run.info.run_id, status="RUNNING")
                outcome.api_calls += 1
                outcome.continued = True
            else:
                run = client.create_run(experiment_id, run_name=run_id, tags={RUN_ID_TAG: run_id, **tags})
                items = [Param(k, v) for k, v in params.items()]
                for start in range(0, len(items), MAX_PARAMS):
                    client.log_batch(run.info.run_id, params=items[start:start + MAX_PARAMS])
                outcome.api_calls += 1 + math.ceil(len(items) / MAX_PARAMS)
        except Exception as exc:
            raise TrackingError(describe_failure(spec, exc)) from None
        outcome.mlflow_run_id = run.info.run_id
        tracked = cls(spec, client, run.info.run_id, outcome, logger)
        if outcome.continued:
            tracked.set_tags(tags)  # a recovery's attempt count and cluster: newer than the first attempt's
        outcome.foreground_s += time.perf_counter() - started
        return tracked

    # -- logging (never blocks, never raises) -------------------------------------------------------------------------

    def log_metrics(self, values: Mapping[str, float], step: int, line_time: float | None = None) -> None:
        started = time.perf_counter()
        stamp = int((line_time or time.time()) * 1000)
        with self._wake:
            for i, (key, value) in enumerate(values.items()):
                if len(self._points) >= self.spec.buffer:
                    self._points.popleft()
                    self.outcome.points_dropped += 1
                self._points.append(_Point(Metric(key, value, stamp, step), line_time if i == 0 else None))
            self._wake.notify()
            self.outcome.foreground_s += time.perf_counter() - started

    def log_record(self, record: Mapping[str, Any]) -> None:
        """A record of the script's metrics file: every numeric key at its step (records without one: step 0)."""
        step = record.get("step")
        values = numeric_metrics(record)
        if values:
            line_time = record.get("time")
            self.log_metrics(values, step if isinstance(step, int) and not isinstance(step, bool) else 0,
                             float(line_time) if isinstance(line_time, int | float) else None)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        with self._wake:
            self._tags.update({k: v[:MAX_VALUE] for k, v in tags.items()})
            self._wake.notify()

    # -- the sender ---------------------------------------------------------------------------------------------------

    def _take(self) -> tuple[list[_Point], dict[str, str]]:
        points = [self._points.popleft() for _ in range(min(MAX_METRICS, len(self._points)))]
        tags = dict(list(self._tags.items())[:MAX_TAGS])
        for key in tags:
            del self._tags[key]
        return points, tags

    def _put_back(self, points: list[_Point], tags: dict[str, str]) -> None:
        self._points.extendleft(reversed(points))
        while len(self._points) > self.spec.buffer:
            self._points.popleft()
            self.outcome.points_dropped += 1
        self._tags = {**tags, **self._tags}

    def _send_loop(self) -> None:
        failures = 0
        while True:
            with self._wake:
                while not self._points and not self._tags and not self._closing:
                    self._wake.wait()
                if not self._points and not self._tags:
                    return  # closing, nothing left
                points, tags = self._take()
                self._in_flight = len(points) + len(tags)
                self._in_flight_points = len(points)
            try:
                self.client.log_batch(self.id, metrics=[p.metric for p in points],
                                      tags=[RunTag(k, v) for k, v in tags.items()])
            except Exception as exc:
                with self._wake:
                    self.outcome.api_calls += 1
                    self._in_flight = self._in_flight_points = 0
                    if self._closed:  # close() counted these as unsent when its deadline passed
                        return
                    self._put_back(points, tags)
                    self.logger.debug("MLflow: log_batch failed: %s", describe_failure(self.spec, exc))
                    self._went_down(exc)
                    self._wake.notify_all()
                failures += 1
                # New points do not cut the backoff short (the poll brings some every second); close() does, and
                # then tries every CLOSING_RETRY_S until its deadline.
                if self._retry_now.is_set():
                    time.sleep(CLOSING_RETRY_S)
                else:
                    self._retry_now.wait(BACKOFF_S[min(failures, len(BACKOFF_S)) - 1])
                continue
            now = time.time()
            with self._wake:
                if self._closed:  # answered after close()'s deadline: sent after all
                    self.outcome.points_unsent -= len(points)
                self.outcome.api_calls += 1
                self.outcome.points_sent += len(points)
                self.outcome.latency_s.extend(now - p.line_time for p in points if p.line_time is not None)
                self._in_flight = self._in_flight_points = 0
                failures = 0
                self._came_back()
                self._wake.notify_all()

    def _went_down(self, exc: Exception) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
        if not self._said_down:  # said once a run: a server away for an hour is one line, not thousands
            self._said_down = True
            self.logger.warning("MLflow: %s; metrics are buffered (at most %d points) and sent when it answers "
                                "again: the run goes on", describe_failure(self.spec, exc), self.spec.buffer)

    def _came_back(self) -> None:
        if self._down_since is not None:
            spell = time.monotonic() - self._down_since
            self.outcome.unreachable_s = round(self.outcome.unreachable_s + spell, 3)
            self._down_since = None
            self.logger.info("MLflow: %s answers again after %.1fs; the buffered metrics are sent", self.spec.uri,
                             spell)

    # -- closing ------------------------------------------------------------------------------------------------------

    def _pending(self) -> bool:
        return bool(self._points or self._tags or self._in_flight)

    def flush(self, deadline_s: float) -> bool:
        """Waits up to deadline_s for what is buffered to be sent (the sender keeps its backoff); True when it was."""
        end = time.monotonic() + deadline_s
        with self._wake:
            while self._pending() and (left := end - time.monotonic()) > 0:
                self._wake.wait(left)
            return not self._pending()

    def log_artifact(self, path: str) -> None:
        try:
            self.client.log_artifact(self.id, path)
            self.outcome.api_calls += 1
        except Exception as exc:
            self.outcome.errors.append(f"artifact {os.path.basename(path)} not recorded: "
                                       f"{describe_failure(self.spec, exc)}")

    def close(self, status: str, deadline_s: float) -> TrackingOutcome:
        """Drains what is buffered within deadline_s, then ends the MLflow run with the status (FINISHED, FAILED,
        KILLED). What could not be sent by then is counted and said, not waited for."""
        RunStatus.from_string(status)  # a status MLflow does not know is this code's error, found before the drain
        started = time.perf_counter()
        end = time.monotonic() + deadline_s
        with self._wake:
            self._closing = True
            self._wake.notify_all()
        self._retry_now.set()  # from here the sender tries again at once, until the deadline
        self._sender.join(max(0.0, end - time.monotonic()))
        with self._wake:
            self._closed = True
            self.outcome.points_unsent = len(self._points) + self._in_flight_points
            self._points.clear()
            self._tags.clear()
            if self._down_since is not None:
                self.outcome.unreachable_s = round(self.outcome.unreachable_s + time.monotonic() - self._down_since,
                                                   3)
            self._wake.notify_all()
        if self.outcome.points_unsent or self.outcome.points_dropped:
            self.outcome.errors.append(f"{self.outcome.points_unsent + self.outcome.points_dropped} metric points "
                                       f"not recorded in MLflow ({self.outcome.points_dropped} dropped past the "
                                       f"buffer's {self.spec.buffer}, {self.outcome.points_unsent} unsent at the end)")
        while True:  # the status is tried until the deadline, like the metrics before it
            try:
                self.client.set_terminated(self.id, status=status)
                self.outcome.api_calls += 1
                break
            except Exception as exc:
                self.outcome.api_calls += 1
                if time.monotonic() + CLOSING_RETRY_S >= end:
                    self.outcome.errors.append(f"status {status} not recorded: {describe_failure(self.spec, exc)}")
                    break
                time.sleep(CLOSING_RETRY_S)
        self.outcome.foreground_s += time.perf_counter() - started
        return self.outcome
