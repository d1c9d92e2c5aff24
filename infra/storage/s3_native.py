"""S3's native engine: awscrt's S3 client (the C client under Mountpoint for S3) moves whole files.

GETs write straight into the landing file (`recv_filepath`, O_DIRECT) and are checked in C against the expected
CRC64NVME (or CRC32C / sha256) as they arrive; PUTs read straight from the file (`send_filepath`) and carry their
CRC64NVME in a header, so the store checks it. No byte passes through Python. Listing, HEAD and the multipart
calls go through this client too (s3_control.py); boto3 is left for small objects and the python engine.

A custom endpoint (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL: rclone, MinIO, moto) is reached through the Host header
with path-style keys, TLS off for http://; the CRT keeps connections per host name (not per port), so there is one
client per endpoint. The CRT's own multipart upload needs `<InitiateMultipartUploadResult>` in the reply to
CreateMultipartUpload; a server that answers otherwise (rclone: `<InitiateMultipartUpload>`) gets its large files
part by part instead: the upload is started and completed by CRT requests of our own (s3_control.py), each part is
one CRT request reading its range of the file, and the part CRCs join into the object's CRC64NVME,
sent with the completion.

Retries of failed part requests are the CRT's (its standard strategy, bounded by the engine's RetryPolicy); each
one is logged through Python logging by the bridge below, like the engine's own retries.
"""

from __future__ import annotations

import concurrent.futures
import io
import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from awscrt import auth, http, s3
from awscrt import io as awscrt_io
from awscrt.exceptions import AwsCrtError

from infra.storage.base import ChecksumMismatch, StorageError
from infra.storage.checksum import CRC32C, CRC64NVME, SHA256, Checksum, Crc, PartCrcs, checksum_file
from infra.storage.cloud import TransientStorageError
from infra.storage.crt_traffic import TRAFFIC
from infra.storage.pool import TICK_S
from infra.storage.records import FileJob, TransferConfig
from infra.storage.retry import Cancelled, gave_up, log_retry
from infra.storage.stall import StallWatch, ended_after_cancel

log = logging.getLogger(__name__)

MIN_PART_SIZE = 5 << 20  # S3's smallest part (except the last)
MAX_PARTS = 10_000
_ALGORITHMS = {CRC64NVME: s3.S3ChecksumAlgorithm.CRC64NVME, CRC32C: s3.S3ChecksumAlgorithm.CRC32C,
               SHA256: s3.S3ChecksumAlgorithm.SHA256}
# CRT errors of the connection or the server's health: the CRT already retried them; the engine reports them as
# transient so a caller's own retry loop (the checkpoint syncer's) tries again later.
_TRANSIENT_CRT = re.compile(r"SOCKET|CONNECTION|TIMEOUT|TIMED_OUT|SLOW_DOWN|INTERNAL_ERROR|HTTP_SERVER_CLOSED|"
                            r"CONNECTION_CLOSED|STREAM_RESET|DNS|RETRY")


@dataclass(frozen=True)
class Endpoint:
    """Where requests go: the Host header, path-style or virtual-hosted keys, TLS or not."""

    url: str | None  # a custom endpoint (AWS_ENDPOINT_URL...), None for AWS itself
    region: str

    def host(self, bucket: str) -> str:
        if self.url is None:
            return f"{bucket}.s3.{self.region}.amazonaws.com"
        return self.url.split("://", 1)[1].rstrip("/")

    def path(self, bucket: str, name: str) -> str:
        encoded = quote(name, safe="/~")
        return f"/{bucket}/{encoded}" if self.url is not None else f"/{encoded}"

    @property
    def tls(self) -> bool:
        return self.url is None or self.url.startswith("https://")


# -- the CRT's log, through Python logging --------------------------------------------------------------

_RETRY_LINE = re.compile(r"Request failed from error \d+ \((?P<reason>[^)]*)\)\.? \(request=[^,]*, response "
                         r"status=(?P<status>\d+)\)\. Try to setup a retry")


class _CrtLog(logging.Handler):
    """The CRT logs each part request it retries (at its Error level): that becomes one warning here. Its other
    errors are raised to the caller as exceptions anyway, and stay at debug."""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        retry = _RETRY_LINE.search(message)
        if retry is not None:
            log.warning("S3 request failed (%s, HTTP %s): the CRT retries it with backoff",
                        retry["reason"].rstrip("."), retry["status"])
        else:
            log.debug("awscrt: %s", message)


# What the CRT says (at its Error level) of every request we cancel: it is the cancel we asked for.
_CANCELLED_LINE = re.compile(r"Meta request cannot recover from error \d+ \(Request successfully cancelled\)")
_META_REQUEST_LOGGER = "awscrt.s3.S3MetaRequest"  # where awscrt.logging puts the CRT's meta request lines


class _CancelledIsDebug(logging.Filter):
    """The line for a cancel we asked for, lowered to debug where it is logged, so no handler anywhere (the
    bridge's, a host program's, pytest's) shows it as an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG and _CANCELLED_LINE.search(record.getMessage()):
            record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return True


_log_bridge_lock = threading.Lock()
_log_bridge_on = False


def _bridge_crt_log() -> None:
    global _log_bridge_on
    with _log_bridge_lock:
        if _log_bridge_on:
            return
        import awscrt.logging

        crt_logger = logging.getLogger("awscrt")
        crt_logger.propagate = False
        crt_logger.addHandler(_CrtLog())
        logging.getLogger(_META_REQUEST_LOGGER).addFilter(_CancelledIsDebug())
        try:
            awscrt.logging.init_logging(logging.ERROR)
        except RuntimeError as exc:  # the host program set CRT logging up itself: its choice stands
            log.debug("CRT logging already initialised (%s): its retries are logged where it says", exc)
        _log_bridge_on = True


# -- clients ----------------------------------------------------------------------------------------


def _credentials_provider(credentials: Any) -> auth.AwsCredentialsProvider:
    """Resolved credentials (botocore's, refreshed by botocore when they expire, or the environment's) as a CRT
    provider."""

    def current() -> auth.AwsCredentials:
        frozen = credentials.get_frozen_credentials()
        return auth.AwsCredentials(frozen.access_key, frozen.secret_key, frozen.token)

    return auth.AwsCredentialsProvider.new_delegate(current)


_bootstrap_lock = threading.Lock()
_bootstrap: awscrt_io.ClientBootstrap | None = None


# A loop thread writes each part it receives to its file itself (an O_DIRECT pwrite: ~8 ms per 8 MiB part here, a
# third of a loop's time in a 0.6 GB download), receiving nothing meanwhile: two loops per CPU keep one receiving
# while the other waits on the disk (2-core machine, 0.6 GB, 10 runs each: 0.91 s against 0.93-0.96 s with one per
# CPU; more than two moved nothing further).
EVENT_LOOPS_PER_CPU = 2


def _client_bootstrap() -> awscrt_io.ClientBootstrap:
    """EVENT_LOOPS_PER_CPU event loops per CPU this process may run on, shared by every client. The CRT's static
    default put all of a client's connections and file writes on one loop thread here (measured: one thread at
    ~1 core, the others idle), so the transfer could never use more than a core however many were free."""
    global _bootstrap
    with _bootstrap_lock:
        if _bootstrap is None:
            threads = EVENT_LOOPS_PER_CPU * len(os.sched_getaffinity(0))
            _bootstrap = awscrt_io.ClientBootstrap(awscrt_io.EventLoopGroup(threads),
                                                   awscrt_io.DefaultHostResolver(awscrt_io.EventLoopGroup(1)))
        return _bootstrap


def new_client(endpoint: Endpoint, credentials: Any, config: TransferConfig) -> s3.S3Client:
    _bridge_crt_log()
    signing = s3.create_default_s3_signing_config(
        region=endpoint.region, credential_provider=_credentials_provider(credentials)
    )
    policy = config.retry
    retry = s3.S3RetryConfig(
        max_retries=max(1, policy.attempts - 1),
        backoff_scale_factor_ms=max(1, round(policy.base_s * 1000)),
        max_backoff_secs=max(1, round(policy.max_s)),
    )
    return s3.S3Client(
        bootstrap=_client_bootstrap(),
        region=endpoint.region,
        signing_config=signing,
        tls_mode=s3.S3RequestTlsMode.ENABLED if endpoint.tls else s3.S3RequestTlsMode.DISABLED,
        part_size=max(config.part_size, MIN_PART_SIZE),
        throughput_target_gbps=config.throughput_target_gbps,
        memory_limit=config.memory_limit,
        retry_config=retry,
        max_active_connections_override=config.connections_per_cpu * len(os.sched_getaffinity(0)),
    )


# -- errors -----------------------------------------------------------------------------------------

_CODE = re.compile(rb"<Code>([^<]+)</Code>")
_MESSAGE = re.compile(rb"<Message>([^<]+)</Message>")


def error_code(exc: BaseException) -> tuple[str, int, str] | None:
    """(S3 error code, HTTP status, message) of a CRT failure that came from a server response."""
    if not isinstance(exc, s3.S3ResponseError) or not exc.status_code:
        return None
    body = exc.body or b""
    code = _CODE.search(body)
    message = _MESSAGE.search(body)
    status = int(exc.status_code)
    return (code[1].decode() if code else str(status)), status, (message[1].decode() if message else "")


def crt_failure(exc: AwsCrtError, url: str, action: str) -> StorageError:
    """A CRT failure that is not a server's error response, as one line."""
    detail = f"{exc.name}: {exc.message}"
    if exc.name == "AWS_ERROR_S3_RESPONSE_CHECKSUM_MISMATCH":
        return ChecksumMismatch(url)  # the caller names the checksum
    if _TRANSIENT_CRT.search(exc.name):
        return TransientStorageError(f"{url}: cannot {action}: {detail}: check the network and the store, run again")
    return StorageError(f"{url}: cannot {action}: {detail}")


# -- requests ---------------------------------------------------------------------------------------


def wait(request: s3.S3Request, cancel: threading.Event, watch: StallWatch, what: str) -> None:
    """Block until the request finishes; cancelling it and raising Cancelled once cancel is set, or StalledRequest
    once watch says it moved no byte for the stall bound."""
    while True:
        try:
            request.finished_future.result(timeout=TICK_S)
            return
        except concurrent.futures.TimeoutError:
            if cancel.is_set() or watch.stalled():
                stalled = None if cancel.is_set() else watch.error(what)
                request.cancel()
                ended_after_cancel([request.finished_future], what)
                raise stalled or Cancelled() from None


class FileGrowth:
    """Progress of a GET into a file, from the file's size: the file grows part by part, in order, as the CRT's
    callbacks would report it (infra.storage.crt_traffic)."""

    def __init__(self, path: Path, on_bytes: Callable[[int], None]) -> None:
        self.path, self.on_bytes, self.reported = path, on_bytes, 0

    def __call__(self) -> int | None:
        """The file's size now (None before it exists), its growth reported."""
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            return None  # not created yet
        self.report(size)
        return size

    def report(self, size: int) -> None:
        if size > self.reported:
            self.on_bytes(size - self.reported)
            self.reported = size


class Headers:
    """Response headers a request reports (on_headers), by lowercase name."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def __call__(self, status_code: int, headers: list[tuple[str, str]], **kwargs: Any) -> None:
        self.values.update((name.lower(), value) for name, value in headers)

    def checksum(self, algorithm: str) -> Checksum | None:
        value = self.values.get(f"x-amz-checksum-{algorithm}")
        return Checksum(algorithm, value) if value else None


def get_request(endpoint: Endpoint, bucket: str, name: str) -> http.HttpRequest:
    return http.HttpRequest("GET", endpoint.path(bucket, name), http.HttpHeaders([("Host", endpoint.host(bucket))]))


@dataclass(frozen=True)
class _Attempt:
    request: s3.S3Request
    headers: Headers
    validated: list[s3.S3ChecksumAlgorithm | None]


class CrtGet:
    """A GET the CRT runs into a file (infra.storage.native.PendingFetch): no thread waits for it. One that moves
    no byte for the stall bound is cancelled and started again (its file truncated), up to the retry policy's
    attempts, each retry logged."""

    def __init__(self, launch: Callable[[], _Attempt], growth: FileGrowth, expected: Checksum | None,
                 failure: Callable[[AwsCrtError], StorageError], job: FileJob, what: str) -> None:
        self.launch, self.growth, self.expected, self.failure, self.what = launch, growth, expected, failure, what
        self.policy = job.config.retry
        self.watch = StallWatch(job.config.stall_timeout_s, link=TRAFFIC.idle_s)
        self.attempts = 0
        self.attempt: _Attempt | None = None
        self.error: BaseException | None = None  # why it ended without a request to ask (given up, cancelled)
        self.ended: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._lock = threading.Lock()
        self._start()

    def _start(self) -> None:
        self.attempts += 1
        attempt = self.launch()  # a CRT error here (a bad request) is the caller's, raised as the store's error
        with self._lock:
            self.attempt = attempt
        attempt.request.finished_future.add_done_callback(lambda _future: self._attempt_ended(attempt))

    def _attempt_ended(self, attempt: _Attempt) -> None:
        with self._lock:
            if attempt is not self.attempt:
                return  # cancelled for a stall: its retry is what ends the GET
        self._end(None)

    def _end(self, error: BaseException | None) -> None:
        with self._lock:
            if self.ended.done():
                return
            self.error = error
        self.ended.set_result(None)

    def _take_attempt(self) -> _Attempt | None:
        """The request in flight, no longer current (so its end does not end the GET); None once it ended."""
        with self._lock:
            if self.ended.done():
                return None
            attempt, self.attempt = self.attempt, None
            return attempt

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        self.ended.add_done_callback(lambda _future: callback())

    def poll(self) -> None:
        self.watch.saw(self.growth())
        if not self.watch.stalled():
            # Bytes arriving that have not landed yet still count as moving for the pool's own deadline
            # (infra.storage.pool: a part can take minutes to land on a slow, shared link).
            self.growth.on_bytes(0)
            return
        stalled = self.watch.error(self.what)
        attempt = self._take_attempt()
        if attempt is None:
            return
        attempt.request.cancel()
        ended_after_cancel([attempt.request.finished_future], self.what)
        if self.attempts >= self.policy.attempts:
            self._end(gave_up(self.what, self.attempts, stalled))
            return
        # No backoff: the stall bound was the wait, and the retry goes out on a new connection.
        log_retry(self.what, stalled, self.attempts, self.policy, 0.0)
        try:
            self._start()
        except AwsCrtError as exc:
            self._end(self.failure(exc))
        self.watch.moved()

    def cancel(self) -> None:
        attempt = self._take_attempt()
        if attempt is not None:
            attempt.request.cancel()
            ended_after_cancel([attempt.request.finished_future], self.what)
        self._end(Cancelled())

    def result(self) -> Checksum | None:
        """The checksum the bytes were checked against: expected, else the store's full-object one, else None."""
        with self._lock:
            error, attempt = self.error, self.attempt
        if error is not None:
            raise error
        assert attempt is not None, "a GET ends with its last attempt or an error"
        try:
            attempt.request.finished_future.result()
        except AwsCrtError as exc:
            raise self.failure(exc) from None
        self.growth()
        if self.expected is not None:
            return self.expected
        validated = attempt.validated[0] if attempt.validated else None
        algorithm = next((name for name, value in _ALGORITHMS.items() if value == validated), None)
        return attempt.headers.checksum(algorithm) if algorithm is not None else None


def start_get(client: s3.S3Client, request: http.HttpRequest, path: Path, expected: Checksum | None, job: FileJob,
              failure: Callable[[AwsCrtError], StorageError], what: str) -> CrtGet:
    """Begin the GET of the object into path, its bytes checked by the CRT as they arrive: against expected, or
    else against the full-object checksum the store keeps; failure turns a CRT error into the store's."""
    if expected is not None:
        checksum_config = s3.S3ChecksumConfig(
            expected_checksum=expected.b64,
            expected_checksum_algorithm=_ALGORITHMS[expected.algorithm],
            response_validation_mode=s3.S3ChecksumValidationMode.FULL_OBJECT,
        )
    else:
        checksum_config = s3.S3ChecksumConfig(
            validate_response=True, response_validation_mode=s3.S3ChecksumValidationMode.FULL_OBJECT
        )

    def launch() -> _Attempt:
        headers = Headers()
        validated: list[s3.S3ChecksumAlgorithm | None] = []

        def done(*, did_validate_checksum: bool = False, checksum_validation_algorithm: Any = None, **kwargs: Any
                 ) -> None:
            validated.append(checksum_validation_algorithm if did_validate_checksum else None)

        crt_request = client.make_request(
            type=s3.S3RequestType.GET_OBJECT,
            request=request,
            recv_filepath=str(path),
            checksum_config=checksum_config,
            part_size=max(job.config.part_size, MIN_PART_SIZE),
            fio_options=s3.S3FileIoOptions(direct_io=True) if job.config.direct_io else None,
            on_headers=headers,
            on_done=done,
        )
        return _Attempt(crt_request, headers, validated)

    return CrtGet(launch, FileGrowth(path, job.on_bytes), expected, failure, job, what)


def put_request(endpoint: Endpoint, bucket: str, name: str, size: int, query: str = "",
                body: io.RawIOBase | None = None) -> http.HttpRequest:
    headers = http.HttpHeaders([("Host", endpoint.host(bucket)), ("Content-Length", str(size)),
                                ("Content-Type", "application/octet-stream")])
    return http.HttpRequest("PUT", endpoint.path(bucket, name) + query, headers, body)


def send(client: s3.S3Client, request: http.HttpRequest, path: Path, job: FileJob, what: str) -> Checksum | None:
    """PUT the file with its CRC64NVME in a header (the CRT computes it from the bytes it sends; the store checks
    it). Returns the CRC when the store echoed it (AWS does; rclone and moto do not)."""
    headers = Headers()
    watch = StallWatch(job.config.stall_timeout_s, link=TRAFFIC.idle_s)

    def progress(count: int) -> None:
        watch.moved()
        job.on_bytes(count)

    crt_request = client.make_request(
        type=s3.S3RequestType.PUT_OBJECT,
        request=request,
        send_filepath=str(path),
        checksum_config=s3.S3ChecksumConfig(algorithm=s3.S3ChecksumAlgorithm.CRC64NVME,
                                            location=s3.S3ChecksumLocation.HEADER),
        part_size=max(job.config.part_size, MIN_PART_SIZE),
        multipart_upload_threshold=max(job.config.multipart_threshold, MIN_PART_SIZE),
        on_progress=progress,
        on_headers=headers,
    )
    wait(crt_request, job.cancel, watch, what)
    return headers.checksum(CRC64NVME)


class FileRange(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file, as a request body the CRT reads straight into its own
    buffer (os.preadv); the CRC of what was read is kept, and starts over when the CRT rewinds for a retry."""

    def __init__(self, fd: int, offset: int, length: int, watch: StallWatch) -> None:
        super().__init__()
        self.fd, self.offset, self.length, self.watch = fd, offset, length, watch
        self.position = 0
        self.crc = Crc(CRC64NVME)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        if base + offset != 0 and base + offset != self.position:
            raise OSError(f"part body seek to {base + offset}: only a rewind to 0 is supported")
        if base + offset == 0:
            self.position, self.crc = 0, Crc(CRC64NVME)
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer: Any) -> int:
        want = min(len(buffer), self.length - self.position)
        if want <= 0:
            return 0
        view = memoryview(buffer)[:want]
        count = os.preadv(self.fd, [view], self.offset + self.position)
        if count == 0:
            raise OSError(f"the file ended {self.length - self.position} bytes early in a part: it changed size")
        self.crc.update(view[:count])
        self.position += count
        self.watch.moved()
        return count


def send_parts(
    client: s3.S3Client,
    endpoint: Endpoint,
    bucket: str,
    name: str,
    path: Path,
    size: int,
    upload_id: str,
    job: FileJob,
    what: str,
) -> tuple[list[str], Checksum]:
    """Every part of the file as its own CRT UploadPart request (all in flight at once; the CRT schedules them).

    Returns the parts' ETags in order and the object's CRC64NVME, joined from the CRCs of the bytes sent.
    """
    part_size = max(job.config.part_size, MIN_PART_SIZE, -(-size // MAX_PARTS))
    crcs = PartCrcs(CRC64NVME)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    requests: list[tuple[s3.S3Request, Headers, FileRange]] = []
    # One watch for all parts: the upload stalls when none of them moves (a part's body is read when it is sent)
    # and the engine's connections are quiet too: a file whose parts wait behind other files' in the CRT's queue
    # shows no progress of its own while the link is busy (on a loaded machine such files were retried until they
    # failed). One stalled connection among moving ones is left to the CRT's throughput check, as for GETs.
    watch = StallWatch(job.config.stall_timeout_s, link=TRAFFIC.idle_s)
    try:
        for number, offset in enumerate(range(0, size, part_size), start=1):
            length = min(part_size, size - offset)
            body = FileRange(fd, offset, length, watch)
            headers = Headers()
            query = f"?partNumber={number}&uploadId={quote(upload_id, safe='')}"

            def done(*, error: BaseException | None = None, length: int = length, **kwargs: Any) -> None:
                if error is None:
                    watch.moved()
                    job.on_bytes(length)

            request = client.make_request(
                type=s3.S3RequestType.DEFAULT,
                operation_name="UploadPart",
                request=put_request(endpoint, bucket, name, length, query, body),
                on_headers=headers,
                on_done=done,
            )
            requests.append((request, headers, body))
        for request, _, _ in requests:
            wait(request, job.cancel, watch, what)
    except BaseException:
        for request, _, _ in requests:
            request.cancel()
        ended_after_cancel([request.finished_future for request, _, _ in requests], what)
        raise
    finally:
        os.close(fd)
    etags = []
    for _request, headers, body in requests:
        etags.append(headers.values.get("etag", ""))
        crcs.add_crc(body.offset, body.length, body.crc.value)
    return etags, crcs.total(size)


def checksum_after_put(echoed: Checksum | None, kept: Checksum | None, path: Path) -> Checksum:
    """The object's CRC64NVME: as the store echoed or keeps it, else computed from the file that was sent."""
    if echoed is not None:
        return echoed
    if kept is not None:
        return kept
    log.debug("%s: the store keeps no CRC64NVME for it: computing it from the file", path)
    return checksum_file(path, CRC64NVME)
