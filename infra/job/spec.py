"""The job specification: what a retraining job needs, validated before anything is paid for.

Every model here is also the Prefect parameter schema of the retrain flow, so field descriptions
are what a user reads in the UI form. The job composes the sections each room defines: the cluster (infra.compute.spec,
with each provider's own section from that provider's package), the dataset and inputs (infra.dataset.spec) and the
recovery policy (infra.job.recovery_spec); checkpoints, training, evaluate and promote are the job's own.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from infra.checkpoints.formats import CheckpointFormat
from infra.compute.providers.table import CHAOS_PROVIDERS
from infra.compute.spec import ClusterSpec
from infra.dataset.spec import DatasetSpec, InputSpec
from infra.job.recovery_spec import ChaosSpec, RecoverySpec
from infra.job.secrets import SecretRef
from infra.job.tracking_spec import TrackingSpec, node_environment
from infra.registry.refs import NAME, parse_model_ref
from infra.storage import store_url
from infra.storage.azure_account import JobAccount
from infra.strict_model import StrictModel
from infra.workload.code import ARCHIVE_SUFFIXES
from infra.workload.contract import check_command


class ConfigError(ValueError):
    """A job config that cannot run; the message is one line naming the field and the fix."""


INPUT_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def _input_entry(value: object) -> object:
    """An input given as a string: a model alias ('model@alias') stays one; a URL or path is {url: ...}."""
    # "<model>@<alias>": a model in the checkpoint store's registry (resolved at plan, plan.resolve_input_url)
    if isinstance(value, str) and parse_model_ref(value) is None:
        return {"url": value}
    return value


class CheckpointSpec(StrictModel):
    url: str = Field(description="Where committed checkpoints live; each run writes under <url>/<run-id>/.")
    format: CheckpointFormat = Field(
        "auto", description="How a complete checkpoint is recognised in TRAINPIPE_CHECKPOINT_DIR: dcp and torchtitan "
        "(a folder with .metadata), hf (checkpoint-N/ with trainer_state.json), lightning (a closed .ckpt), marker "
        "(X next to X.complete), file (one file overwritten in place), auto (whichever appears).")
    keep: int = Field(3, ge=1, description="Committed checkpoints kept in the store (the newest is never deleted).")
    flush_deadline_s: float = Field(
        # torchrun's agent SIGKILLs its workers 30 s after forwarding SIGTERM to them.
        20.0, gt=0, le=25, description="On SIGTERM (spot notice, cancel): seconds the script has to finish a last "
        "save; whatever checkpoint is complete by then is committed."
    )
    sync_poll_s: float = Field(0.5, gt=0, le=10, description="How often each node's syncer looks for new "
                               "checkpoints (lower it for a script that waits for its uploads).")
    store_outage_s: float = Field(
        300.0, ge=5, le=86400, description="How long each node's syncer rides out a store that fails transiently "
        "(5xx, refused or dropped connections), retrying with backoff; past it, training stops and the run fails "
        "saying so, rather than train on checkpoints that cannot be committed.")
    final_upload_timeout_s: float = Field(
        900.0, gt=0, le=86400, description="When training ends (done, failed or stopped): seconds the syncers have "
        "to upload and commit every checkpoint complete on the nodes' disks; separate from flush_deadline_s (the "
        "script's last save). Size it for the largest checkpoint at the store's speed.")
    peer_replica: bool | None = Field(
        None, description="Each node keeps a copy of its ring buddy's part of the newest committed checkpoint, "
        "pulled over the cluster network from the buddy (never from the store) and verified against the manifest, "
        "so a preempted node's replacement is restored from its peers alone. Default (null): on with 2+ nodes; "
        "false turns it off (it costs each node the disk of one more node's part).")
    keep_local: int = Field(
        2, ge=1, description="How many complete checkpoints the script keeps on a node's disk (the bundled "
        "trainer's --keep-local): the node's disk budget at plan counts that many whole checkpoints.")
    size_bytes: int | None = Field(
        None, ge=1, description="An estimate of one whole checkpoint's size, for the disk budget at plan when the "
        "run neither resumes its own commit nor warm-starts from training.init_from (whose manifests say it). "
        "null: the budget leaves the checkpoints out and says so.")

    @field_validator("url")
    @classmethod
    def _normalise_url(cls, value: str) -> str:
        return store_url(value)


class TrainingSpec(StrictModel):
    code: str | None = Field(None, description="The training code, shipped to every node: a local dir, or an "
                             "s3://, gs://, az:// or file:// URL of a .tar.gz. None: the command runs from the nodes' "
                             "environment (a module installed there, like the bundled trainer.train).")
    setup: tuple[str, ...] = Field((), description="Shell commands run once per node in the code dir before "
                                   "training, e.g. 'pip install -r requirements.txt'.")
    command: tuple[str, ...] = Field(min_length=1, description="What torchrun starts on every node, in the code "
                                     "dir: a .py of the code and its arguments, or [-m, module, ...]. Placeholders "
                                     "{data_dir} {checkpoint_dir} {resume_from} {run_id} ... stand for the values "
                                     "of the TRAINPIPE_* variables.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for setup and training. Its "
                                "values are flow-run parameters, shown in the Prefect UI: put tokens and keys in "
                                "training.secrets.")
    secrets: dict[str, SecretRef] = Field(
        default_factory=dict, description="Environment variables for setup and training whose values are secret: "
        "each names where its value is kept, {env: VARIABLE} (the orchestrator's environment) or {prefect_secret: "
        "block-name} (a Prefect Secret block). Resolved when the run starts the node commands; the value is never a "
        "flow parameter, in the summary or on a command line.")
    image: str | None = Field(None, description="A container image the setup, torchrun with the command and "
                              "evaluate run in on every node (e.g. nvcr.io/nvidia/pytorch:24.12-py3): pulled on every "
                              "node beside staging, run with the node's engine (training.engine) or, on Slurm, "
                              "cluster.slurm.containers. It needs python3 with torch; trainpipe adds nothing to it.")
    python: str | None = Field(None, description="An interpreter already on every node that has torch (a venv, a "
                               "conda env), for nodes without containers, e.g. /opt/conda/envs/train/bin/python. "
                               "Neither image nor python: the nodes' own python3, which must have torch. trainpipe "
                               "never installs anything into it.")
    engine: Literal["auto", "docker", "podman"] = Field("auto", description="The container engine that runs "
                                                        "training.image on SSH, cloud and local nodes (auto: docker "
                                                        "if the node has it, else podman).")
    threads_per_proc: int = Field(1, ge=1, description="CPU threads per training process (OMP_NUM_THREADS).")
    timeout_s: float = Field(3600, gt=0, description="Fail training that runs longer than this.")
    hang_timeout_s: float = Field(
        1800.0, ge=0, description="A hung training: no rank reported a new step (TRAINPIPE_METRICS_FILE or the "
        "framework's log lines) and no new complete checkpoint appeared for this long. Every rank prints its Python "
        "stacks into the run folder, the ranks are stopped on every node and restarted on the same nodes from the "
        "latest commit (a recovery, counted against recovery.max_recoveries); a second hang at the same step fails "
        "the run. Armed by the attempt's first step or checkpoint. 0: off.")
    exit_grace_s: float = Field(
        120.0, ge=0, description="Once every rank of one node has exited 0 and the newest checkpoint is committed: "
        "seconds the other nodes get to exit too; past it their ranks are stopped and the run completes, naming "
        "the node that hung at exit (e.g. a rank stuck tearing down its process group).")
    init_from: str | None = Field(
        None, description="Warm start: a committed checkpoint to start a new schedule from — the step URL `trainpipe "
        "run` prints, a run's checkpoint root (its latest commit) or MODEL@ALIAS (e.g. mymodel@production). Checked "
        "at plan, restored onto every node before training as TRAINPIPE_INIT_FROM / {init_from}; not restored again "
        "when the run resumes its own checkpoint after a preemption. Resolved once, at the run's first attempt, and "
        "kept with the run: a recovery or a rerun of the run id starts from that same checkpoint even if the alias "
        "moved since.")

    @field_validator("code")
    @classmethod
    def _code_source(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if "://" in value:
            url = store_url(value)
            if not url.endswith(ARCHIVE_SUFFIXES):
                raise ValueError(f"code URL {url} is not a .tar.gz: pack the code (tar czf code.tar.gz -C dir .) "
                                 "or give a local dir")
            return url
        return str(Path(value).expanduser().resolve())

    @field_validator("command")
    @classmethod
    def _known_placeholders(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        check_command(value)
        return value

    @model_validator(mode="after")
    def _grace_within_timeout(self) -> TrainingSpec:
        if self.exit_grace_s >= self.timeout_s:
            raise ValueError(f"exit_grace_s {self.exit_grace_s:g}: must be below timeout_s {self.timeout_s:g}: "
                             "lower it (a minute or two is plenty for ranks to exit)")
        return self

    @model_validator(mode="after")
    def _one_environment(self) -> TrainingSpec:
        if self.image is not None and self.python is not None:
            raise ValueError(f"image {self.image} and python {self.python}: name one training environment: the "
                             "image's own python3 runs in a container")
        if self.engine != "auto" and self.image is None:
            raise ValueError(f"engine {self.engine} without image: set training.image or remove training.engine")
        return self

    @field_validator("image", "python")
    @classmethod
    def _no_blanks(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and (not value.strip() or any(c.isspace() for c in value)):
            raise ValueError(f"{info.field_name} {value!r}: one word, no spaces: an image reference or an "
                             "interpreter's path")
        return value

    @field_validator("init_from")
    @classmethod
    def _checkpoint_ref(cls, value: str | None) -> str | None:
        # MODEL@ALIAS is the registry's; anything else is a URL or a path.
        if value is None or parse_model_ref(value) is not None:
            return value
        return store_url(value)

    @field_validator("env", "secrets")
    @classmethod
    def _shell_names(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        for name in value:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
                raise ValueError(f"{info.field_name} name {name!r} is not a valid environment variable name")
            if name.startswith("TRAINPIPE_"):
                raise ValueError(f"{info.field_name} {name}: TRAINPIPE_* variables are set by trainpipe: use another "
                                 "name")
        return value

    @model_validator(mode="after")
    def _secrets_apart_from_env(self) -> TrainingSpec:
        if both := sorted(self.env.keys() & self.secrets.keys()):
            raise ValueError(f"{both[0]} is in both env and secrets: keep it in secrets only")
        return self


# The evaluate command's own placeholders, beside every training one.
EVAL_PLACEHOLDERS = ("checkpoint", "eval_file")


class EvaluateSpec(StrictModel):
    """The evaluation gate: a command run on the cluster once the final checkpoint is committed."""

    command: tuple[str, ...] = Field(
        min_length=1, description="Run once on node 0, in the code dir, after the final checkpoint is committed and "
        "before teardown (a plain process, not under torchrun): a .py of the code and its arguments, or [-m, module, "
        "...]. It must write its metrics as a JSON object of numbers to TRAINPIPE_EVAL_FILE ({eval_file}). "
        "{checkpoint} is the committed checkpoint restored on that node; every training placeholder works too.")
    timeout_s: float = Field(1800, gt=0, description="Fail the gate when the evaluation runs longer than this.")

    @field_validator("command")
    @classmethod
    def _known_placeholders(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        check_command(value, extra=EVAL_PLACEHOLDERS)
        return value


class PromoteSpec(StrictModel):
    """The promotion gate: move MODEL@ALIAS to the new checkpoint only when its metric beats the champion's."""

    model: str = Field(pattern=rf"^{NAME}$", description="The model name in the registry (letters, digits, '.', '_', "
                       "'-'); "
                       "its aliases live under <checkpoints.url>/_registry/<model>/.")
    alias: str = Field("production", pattern=rf"^{NAME}$", description="The alias the run may move (e.g. production).")
    metric: str = Field("eval_loss", min_length=1, description="The key of the evaluate file's JSON compared "
                        "with the champion's (the checkpoint the alias points at now).")
    mode: Literal["min", "max"] = Field("min", description="min: lower is better (a loss); max: higher is better "
                                        "(an accuracy).")
    min_delta: float = Field(0.0, ge=0, description="Promote only when the metric beats the champion's by more than "
                             "this. The first run of a model is promoted.")


class StorageSpec(StrictModel):
    """Which accounts the job's stores reach; their keys stay in the environment or training.secrets."""

    azure_account: str | None = Field(
        None, pattern=r"^[a-z0-9]{3,24}$", description="The Azure storage account every az:// store of the run "
        "reaches (3-24 lowercase letters and digits), on the orchestrator and on every node; it wins over "
        "AZURE_STORAGE_ACCOUNT. Its key comes from AZURE_STORAGE_KEY (or a connection string for this same "
        "account) where trainpipe runs, or from training.secrets for cloud nodes; with none, an identity "
        "(DefaultAzureCredential). null: the account comes from the environment.")
    azure_blob_endpoint: str | None = Field(
        None, pattern=r"^https?://[^\s/]+(/\S*)?$", description="The account's blob endpoint where it is not "
        "https://<azure_account>.blob.core.windows.net: a sovereign cloud's, or Azurite's "
        "(http://127.0.0.1:10000/devstoreaccount1). Needs azure_account.")

    @model_validator(mode="after")
    def _endpoint_needs_account(self) -> StorageSpec:
        if self.azure_blob_endpoint is not None and self.azure_account is None:
            raise ValueError("azure_blob_endpoint is the endpoint of storage.azure_account: name the account too")
        return self

    @property
    def azure(self) -> JobAccount | None:
        """The Azure account the config names, or None (the environment's)."""
        if self.azure_account is None:
            return None
        return JobAccount(self.azure_account, self.azure_blob_endpoint)


class JobSpec(StrictModel):
    name: str = Field("retrain", pattern=r"^[a-z0-9][a-z0-9-]{0,39}$", description="Job name: lowercase, digits, '-'.")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    dataset: DatasetSpec
    checkpoints: CheckpointSpec
    training: TrainingSpec
    inputs: dict[str, InputSpec | str] = Field(
        default_factory=dict, description="Prefixes besides the dataset, by name ([a-z][a-z0-9_]*): base model "
        "weights, a tokenizer, an eval set. Each is {url, include, exclude, expectations} (or just its URL), or a "
        "model alias 'model@alias' of the checkpoint store's registry; frozen at plan like the dataset, held to the "
        "manifests it carries, staged whole to every node and named there by TRAINPIPE_INPUT_<NAME> and "
        "{input_<name>}.")
    recovery: RecoverySpec = Field(default_factory=RecoverySpec)
    storage: StorageSpec = Field(default_factory=StorageSpec, description="The storage accounts the job's "
                                 "stores reach, where the environment's are not the ones (Azure: az://).")
    chaos: ChaosSpec | None = Field(None, description="Preemptions to inject (local and ssh providers): for tests.")
    evaluate: EvaluateSpec | None = Field(None, description="Evaluate the committed checkpoint on the cluster before "
                                          "teardown; its metrics go to the summary, the report and the checkpoint's "
                                          "eval record.")
    promote: PromoteSpec | None = Field(None, description="After evaluate: make the new checkpoint MODEL@ALIAS only "
                                        "if its metric beats the champion's. Needs evaluate.")
    tracking: TrackingSpec | None = Field(None, description="Record every run (params, tags, metrics streamed, "
                                          "artifacts) and every promotion in an experiment tracker: {mlflow: {uri, "
                                          "experiment, secrets}}. None: nothing tracked, no client loaded.")

    @model_validator(mode="after")
    def _tracking_variables_are_trainpipe_s(self) -> JobSpec:
        if self.tracking is None or self.tracking.mlflow is None:
            return self
        set_by_run = set(node_environment(self.tracking.mlflow, self.name, "")) | set(self.tracking.mlflow.secrets)
        if clash := sorted(set_by_run & (self.training.env.keys() | self.training.secrets.keys())):
            raise ValueError(f"training {clash[0]}: tracking.mlflow gives it to every node: remove it from "
                             "training.env/secrets (credentials go in tracking.mlflow.secrets)")
        return self

    @model_validator(mode="after")
    def _promote_needs_evaluate(self) -> JobSpec:
        if self.promote is not None and self.evaluate is None:
            raise ValueError("promote needs metrics to compare: add an evaluate: {command: [...]} section that "
                             f"writes {self.promote.metric} to TRAINPIPE_EVAL_FILE, or remove promote")
        return self

    @field_validator("inputs", mode="before")
    @classmethod
    def _input_entries(cls, value: object) -> object:
        if not isinstance(value, dict):
            return value
        for name in value:
            if not isinstance(name, str) or not INPUT_NAME.match(name):
                raise ValueError(f"input name {name!r}: use lowercase letters, digits and '_', starting with a letter "
                                 "(it becomes TRAINPIPE_INPUT_<NAME> and {input_<name>})")
        return {name: _input_entry(entry) for name, entry in value.items()}

    @model_validator(mode="after")
    def _input_placeholders_declared(self) -> JobSpec:
        try:
            check_command(self.training.command, inputs=self.inputs)
        except ValueError as exc:
            raise ValueError(f"training.{exc}") from None
        if self.evaluate is not None:  # an eval set is an input too: {input_<name>}
            try:
                check_command(self.evaluate.command, inputs=self.inputs, extra=EVAL_PLACEHOLDERS)
            except ValueError as exc:
                raise ValueError(f"evaluate.{exc}") from None
        return self

    @model_validator(mode="after")
    def _peer_replica_needs_peers(self) -> JobSpec:
        if self.checkpoints.peer_replica and self.cluster.nodes < 2:
            raise ValueError(f"checkpoints.peer_replica true with cluster.nodes {self.cluster.nodes}: a replica "
                             "needs another node: remove it or use 2+ nodes")
        return self

    @property
    def peer_replica(self) -> bool:
        """checkpoints.peer_replica as it applies: on by default with 2+ nodes."""
        wanted = self.checkpoints.peer_replica
        return self.cluster.nodes >= 2 and (wanted is None or wanted)

    @model_validator(mode="after")
    def _outage_within_training(self) -> JobSpec:
        if self.checkpoints.store_outage_s >= self.training.timeout_s:
            raise ValueError(f"checkpoints.store_outage_s {self.checkpoints.store_outage_s:g}: must be below "
                             f"training.timeout_s {self.training.timeout_s:g}: lower it or raise the timeout")
        return self

    @model_validator(mode="after")
    def _chaos_fits(self) -> JobSpec:
        if self.chaos is None:
            return self
        if self.cluster.provider not in CHAOS_PROVIDERS:
            raise ValueError(f"chaos: the {self.cluster.provider} provider takes nodes away by itself: "
                             f"remove chaos or use one of {', '.join(CHAOS_PROVIDERS)}")
        for event in self.chaos.preempt:
            if event.node >= self.cluster.nodes:
                raise ValueError(f"chaos.preempt node {event.node}: the cluster has nodes 0-{self.cluster.nodes - 1}")
        return self


def _describe(error: dict[str, Any]) -> str:
    where = ".".join(str(p) for p in error["loc"]) or "config"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "missing":
        return f"{where}: missing: add '{error['loc'][-1]}:' to the config"
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown field: remove it or check its spelling"
    got = error.get("input")
    shown = "" if isinstance(got, dict | list) else f" (got {got!r})"
    return f"{where}: {message}{shown}"


def parse_job(data: dict[str, Any], source: str = "config") -> JobSpec:
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        more = len(exc.errors()) - 1
        suffix = f" (and {more} more problem{'s' * (more > 1)})" if more else ""
        raise ConfigError(f"{source}: {_describe(first)}{suffix}") from None


def load_job(path: str | os.PathLike[str]) -> JobSpec:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file: pass the path of a job YAML (see examples/local.yaml)")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc.__class__.__name__}): fix the syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with cluster, dataset, checkpoints, training")
    return parse_job(data, source=str(path))
