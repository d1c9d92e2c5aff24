"""No signature in any message: a storage error never carries a query string, a SAS signature or a key, whether the
client library put it into its own message or a URL with a token reached ours."""

from __future__ import annotations

import logging
import socket
import traceback

import pytest

from infra.storage import StorageError, open_store
from infra.storage.base import REDACTED, redact

SIG = "c2VjcmV0LXNpZ25hdHVyZS1mb3ItdGVzdHM%3D"


@pytest.mark.parametrize(("text", "secret"), [
    (f"GET http://acct.blob.core.windows.net/c/k?sv=2021-08-06&se=2030&sp=r&sig={SIG} failed", SIG),
    ("https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4&X-Amz-Signature=deadbeefcafe&X-Amz-Expires=60: 403",
     "deadbeefcafe"),
    ("BlobEndpoint=http://h/a;SharedAccessSignature=sv=2021&sig=abc123secret", "abc123secret"),
    ("DefaultEndpointsProtocol=https;AccountName=a;AccountKey=S3cr3tK3y==;EndpointSuffix=x", "S3cr3tK3y"),
    ("refused: token=eyJhbGciOiJIUzI1NiJ9.payload.sig", "eyJhbGciOiJIUzI1NiJ9"),
])
def test_redact_removes_every_kind_of_secret(text: str, secret: str) -> None:
    cleaned = redact(text)
    assert secret not in cleaned and REDACTED in cleaned
    assert secret not in str(StorageError(text))


def test_redact_keeps_what_names_the_object() -> None:
    text = "s3://bucket/runs/r1/step-00000100/manifest.json: no such object: check the key"
    assert redact(text) == text


def _closed_port() -> int:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        return listener.getsockname()[1]  # closed on exit: connections to it are refused


def test_a_sas_connection_string_refused_leaves_no_signature_anywhere(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The SDK's connection error names the request URL, SAS signature included: neither the error, its traceback
    nor what the store logs while retrying it may carry that."""
    port = _closed_port()
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                       f"BlobEndpoint=http://127.0.0.1:{port}/devstoreaccount1;"
                       f"SharedAccessSignature=sv=2021-08-06&ss=b&srt=sco&sp=rwdlac&se=2030-01-01&sig={SIG}")
    for name in ("AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY", "AZURE_STORAGE_BLOB_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    store = open_store("az://container/prefix")
    with caplog.at_level(logging.DEBUG), pytest.raises(StorageError) as caught:
        store.get_bytes("model/step-1/manifest.json")
    rendered = "".join(traceback.format_exception(caught.value))
    assert "Connection" in rendered or "refused" in rendered.lower(), rendered  # it is the refusal, named
    for where, text in (("message", str(caught.value)), ("traceback", rendered), ("log", caplog.text)):
        assert SIG not in text and "sp=rwdlac" not in text, f"the SAS signature reached the {where}: {text[-600:]}"
