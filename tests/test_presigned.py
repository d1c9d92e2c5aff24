"""ObjectStore.presigned_get: a URL a node without credentials reads one object with (the agent's wheels travel so),
against the real servers: rclone's S3 (which checks Signature V4) and Azurite (which checks the SAS). The GCS
emulator takes no credentials, so a GCS URL is checked for its signature fields only, made with a service-account
key generated here; the emulator's anonymous client and file:// give none."""

from __future__ import annotations

import hashlib
import logging
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from infra.compute.access.agent_env import Bundle
from infra.compute.access.agent_store import AGENT_PREFIX, StoreSource
from infra.storage import StorageError, open_store
from infra.storage.gcs import GcsStore
from infra.storage.s3 import S3Store

DATA = b"a wheel's bytes\n" * 1000


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return bytes(answer.read())


def _refused(url: str) -> int:
    with pytest.raises(urllib.error.HTTPError) as refused:
        _get(url)
    return refused.value.code


@pytest.mark.parametrize(("root", "signature"), [("s3_url", "X-Amz-Signature="), ("az_url", "sig=")],
                         ids=["s3", "azure"])
def test_a_presigned_url_reads_its_object_and_no_other(root: str, signature: str,
                                                        request: pytest.FixtureRequest) -> None:
    store = open_store(f"{request.getfixturevalue(root)}/run/_agent")
    store.put_bytes("abc/pip-24.whl", DATA)
    store.put_bytes("abc/pip-25.whl", DATA)
    url = store.presigned_get("abc/pip-24.whl", 600)
    assert url is not None and signature in url
    assert _get(url) == DATA
    parts = urllib.parse.urlsplit(url)
    other = urllib.parse.urlunsplit(parts._replace(path=parts.path.replace("pip-24", "pip-25")))
    assert _refused(other) == 403, "the signature covers the key"
    assert _refused(url.replace(signature, f"{signature}0")) == 403, "a tampered signature"


def test_gcs_signs_with_a_service_account_key_and_gives_none_without_one(gs_url: str) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from google.cloud import storage
    from google.oauth2 import service_account

    store = open_store(f"{gs_url}/run/_agent")
    assert isinstance(store, GcsStore)
    assert store.presigned_get("abc/pip-24.whl", 600) is None, "the emulator's anonymous client cannot sign"

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    info = {"type": "service_account", "project_id": "trainpipe-test", "private_key_id": "k1", "private_key": pem,
            "client_email": "agent@trainpipe-test.iam.gserviceaccount.com", "client_id": "1",
            "token_uri": "https://oauth2.googleapis.com/token"}
    store.client = storage.Client(project="trainpipe-test",
                                  credentials=service_account.Credentials.from_service_account_info(info))
    store.bucket = store.client.bucket(store.bucket_name)
    url = store.presigned_get("abc/pip-24.whl", 600)
    assert url is not None
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qs(parts.query)
    assert parts.path.endswith(f"/{store.bucket_name}/run/_agent/abc/pip-24.whl")
    assert query["X-Goog-Algorithm"] == ["GOOG4-RSA-SHA256"] and query["X-Goog-Expires"] == ["600"]
    assert query["X-Goog-Credential"][0].startswith("agent@trainpipe-test.iam.gserviceaccount.com/")
    assert len(query["X-Goog-Signature"][0]) == 512  # RSA-2048, hex


def test_a_file_store_gives_no_url(tmp_path: Path) -> None:
    assert open_store(f"file://{tmp_path}/run/_agent").presigned_get("abc/pip-24.whl", 600) is None


def test_a_store_that_refuses_to_sign_serves_no_wheels_and_says_why_once(
        s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """An identity refused what signing needs (Azure's user delegation key, say) is not a failed bootstrap: the store
    serves nothing and the wheels are copied from the orchestrator."""
    wheel = tmp_path / "pip-24.whl"
    wheel.write_bytes(DATA)
    bundle = Bundle(key="k", content="c", agent_version="0", files={wheel.name: wheel},
                    hashes={wheel.name: hashlib.sha256(DATA).hexdigest()})

    def refused(self: S3Store, key: str, expires_s: float) -> str | None:
        raise StorageError(f"{self.url_for(key)}: cannot sign a URL for: access denied")

    monkeypatch.setattr(S3Store, "presigned_get", refused)
    source = StoreSource(f"{s3_url}/run/{AGENT_PREFIX}")
    with caplog.at_level(logging.INFO):
        assert not source.serves(bundle) and not source.serves(bundle)
    said = [r.getMessage() for r in caplog.records if "do not go through" in r.getMessage()]
    assert len(said) == 1 and "access denied" in said[0], said
    assert source.uploaded_bytes == 0 and list(open_store(source.url).list()) == []
