"""A cloud job's nodes reach its stores with their own credentials (an instance profile, a service account), never
the orchestrator's: plan refuses, with one line naming the fix, a job whose nodes could not, before launch and
bootstrap are paid for and staging fails."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO, run_trainpipe

from infra.job.secrets import SecretRef
from infra.job.spec import parse_job
from infra.job.store_access import store_access_problem


def cloud_job(provider: str, dataset: str, checkpoints: str, code: str | None = None, **section: Any) -> Any:
    training: dict[str, Any] = {"command": ["train.py"]}
    if code is not None:
        training["code"] = code
    return parse_job({"cluster": {"provider": provider, "nodes": 2, **section},
                      "dataset": {"url": dataset}, "checkpoints": {"url": checkpoints}, "training": training})


PROFILE = {"aws": {"instance_profile": "trainpipe-node"}}


def azure_secrets(job: Any, *names: str) -> Any:
    """The job with the Azure variables handed to its nodes as secrets (from the orchestrator's environment)."""
    training = job.training.model_copy(update={"secrets": {name: SecretRef(env=name) for name in names}})
    return job.model_copy(update={"training": training})
STORAGE_LESS = {"gcp": {"service_account": {"scopes": ["compute"]}}}


@pytest.mark.parametrize(("job", "problem"), [
    (cloud_job("aws", "s3://b/data", "s3://b/ckpt", **PROFILE), None),
    (cloud_job("aws", "s3://b/data", "s3://b/ckpt"),
     "dataset.url s3://b/data: the aws nodes have no AWS credentials: set cluster.aws.instance_profile"),
    (cloud_job("aws", "s3://b/data", "gs://b/ckpt", **PROFILE),
     "checkpoints.url gs://b/ckpt: aws nodes have no credentials for gs:// stores: use a s3:// store (or run the "
     "job on gcp)"),
    (cloud_job("aws", "s3://b/data", "s3://b/ckpt", code="gs://b/code.tar.gz", **PROFILE),
     "training.code gs://b/code.tar.gz: aws nodes have no credentials for gs:// stores"),
    (cloud_job("gcp", "gs://b/data", "gs://b/ckpt"), None),  # the default account, under cloud-platform
    (cloud_job("gcp", "gs://b/data", "gs://b/ckpt", **STORAGE_LESS),
     "dataset.url gs://b/data: the gcp nodes' service account has no storage scope: add cloud-platform or "
     "devstorage.read_write to cluster.gcp.service_account.scopes"),
    (cloud_job("gcp", "s3://b/data", "gs://b/ckpt"),
     "dataset.url s3://b/data: gcp nodes have no credentials for s3:// stores: use a gs:// store (or run the job on "
     "aws)"),
    (cloud_job("local", "s3://b/data", "gs://b/ckpt"), None),  # a machine of one's own has its own credentials
    (cloud_job("aws", "s3://b/data", "az://c/ckpt", **PROFILE),
     "checkpoints.url az://c/ckpt: aws nodes have no Azure credentials: hand them over as training.secrets"),
    (azure_secrets(cloud_job("gcp", "az://c/data", "gs://b/ckpt"), "AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY"),
     None),
    (azure_secrets(cloud_job("aws", "s3://b/data", "az://c/ckpt", **PROFILE), "AZURE_STORAGE_ACCOUNT"),
     "checkpoints.url az://c/ckpt: aws nodes have no Azure credentials"),  # an account alone reaches nothing
], ids=["aws-profile", "aws-none", "aws-gs", "aws-gs-code", "gcp-default", "gcp-no-storage-scope", "gcp-s3",
        "local", "aws-az", "gcp-az-key", "aws-az-account-only"])
def test_which_stores_the_nodes_can_reach(job: Any, problem: str | None) -> None:
    found = store_access_problem(job)
    assert found == problem if problem is None else (found or "").startswith(problem), found


def test_plan_refuses_the_aws_example_without_its_instance_profile(tmp_path: Path, workspace: Path) -> None:
    """Before the dataset or the bucket is looked at: nothing of the example's bucket exists here."""
    config = yaml.safe_load((REPO / "examples" / "aws.yaml").read_text())
    del config["cluster"]["aws"]
    (tmp_path / "aws.yaml").write_text(yaml.safe_dump(config))
    result = run_trainpipe("plan", str(tmp_path / "aws.yaml"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: dataset.url s3://my-training-bucket/datasets/regression-csv: the aws nodes have no AWS credentials: "
        "set cluster.aws.instance_profile to an instance profile whose role may read and write it"]


@pytest.mark.parametrize("value", ["has space", "arn:aws:iam::12:instance-profile/x", ""])
def test_a_malformed_instance_profile_is_a_config_error(value: str) -> None:
    from infra.job.spec import ConfigError

    with pytest.raises(ConfigError, match=r"cluster.aws.instance_profile: instance_profile .* is neither an instance "
                                          r"profile name nor its ARN"):
        cloud_job("aws", "s3://b/data", "s3://b/ckpt", aws={"instance_profile": value})


def test_with_the_config_naming_the_azure_account_a_key_is_enough() -> None:
    job = cloud_job("aws", "s3://b/data", "az://c/ckpt", **PROFILE)
    job = job.model_copy(update={"storage": job.storage.model_copy(update={"azure_account": "acct1"})})
    assert store_access_problem(azure_secrets(job, "AZURE_STORAGE_KEY")) is None
    assert store_access_problem(azure_secrets(job, "AZURE_CLIENT_ID", "AZURE_TENANT_ID", "AZURE_CLIENT_SECRET")) is None
    assert store_access_problem(job) == (
        "checkpoints.url az://c/ckpt: aws nodes have no Azure credentials: hand them over as training.secrets "
        "(AZURE_STORAGE_KEY of storage.azure_account acct1, or a service principal's AZURE_CLIENT_ID, AZURE_TENANT_ID "
        "and AZURE_CLIENT_SECRET)")
