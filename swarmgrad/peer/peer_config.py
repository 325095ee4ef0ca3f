"""This peer's own settings (``PeerConfig``): everything a peer chooses for itself, as opposed to the
run-level ``RunConfig`` (peer/config.py) that every peer of a run shares and hashes into its round
key. The two models are the only place each option, its default, its check and its help are
written; ``swarmgrad peer`` flags, ``SWARMGRAD_*`` variables and config-file keys come from them.

    PeerConfig(run_id="fmnist", network=NodeConfig(initial_peers=[...]), stop=Stop(max_seconds=600))

Each section is a small model of its own, so a new local option (a device, a precision, a
micro-batch) is one field in the section it belongs to. A field's ``description`` is its help text;
``json_schema_extra={"flag": ...}`` names its flag where the field's own name would not read well.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import pydantic

from swarmgrad.device import DEVICE_PATTERN, PrecisionName
from swarmgrad.dht.config import NodeConfig, check_run_id
from swarmgrad.errors import ConfigError
from swarmgrad.net.accountability import Accountability
from swarmgrad.net.ratelimit import DEFAULT_LIMIT_MBPS, MAX_LIMIT_MBPS
from swarmgrad.settings import SettingsModel, flag
from swarmgrad.timing import Timing

Mbps = Annotated[float, pydantic.Field(gt=0, le=MAX_LIMIT_MBPS)]
Seconds = Annotated[float, pydantic.Field(ge=0)]
Positive = Annotated[int, pydantic.Field(ge=1)]


class Connection(SettingsModel):
    """How this peer's tensors travel and whom it waits for."""

    direct: bool = pydantic.Field(True, description="Send tensors over direct TCP where a peer can be dialled "
                                  "(else over libp2p streams only).")
    trusted_network: bool = pydantic.Field(False, description="Send tensors unencrypted (trusted LAN only).")
    upload_limit_mbps: Optional[Mbps] = pydantic.Field(
        DEFAULT_LIMIT_MBPS, description="Cap on what this peer sends to the swarm (averaging, gossip, state), "
        "in Mbit/s (default: no cap).")
    download_limit_mbps: Optional[Mbps] = pydantic.Field(
        DEFAULT_LIMIT_MBPS, description="Cap on what this peer receives from the swarm, in Mbit/s (default: no cap).")
    ticket: Optional[Path] = pydantic.Field(
        None, description="Membership ticket of a private run (`swarmgrad run grant`), for this peer's --identity; "
        "with --create it makes the run private, with the key that signed it.")
    wait: Annotated[float, pydantic.Field(ge=1)] = pydantic.Field(
        30.0, description="Seconds to wait for the run's manifest and peers.")
    wait_peers: Positive = pydantic.Field(
        1, description="Start training once this many peers (this one included) are in the run.")


class Data(SettingsModel):
    """Which part of the task's data this peer trains on."""

    shard: Optional[Annotated[int, pydantic.Field(ge=0)]] = pydantic.Field(
        None, description="This peer's data shard (default: a random one).")
    num_shards: Positive = pydantic.Field(1, description="How many shards the training set is cut into.")
    data_dir: Optional[str] = pydantic.Field(None, description="Directory the task reads its data from, for "
                                             "tasks that read files (fashion-mnist: the IDX files).")

    @pydantic.model_validator(mode="after")
    def _check(self) -> Data:
        if self.shard is not None and self.shard >= self.num_shards:
            raise ConfigError(f"--shard must be within 0..{self.num_shards - 1} (--num-shards {self.num_shards}), "
                              f"got {self.shard}")
        return self


class Compute(SettingsModel):
    """The hardware this peer trains on (device and precision go here)."""

    device: str = pydantic.Field(
        "auto", pattern=f"^({DEVICE_PATTERN})$", description="Where the model trains: auto (a GPU when torch can "
        "use one, else the CPU), cpu, cuda, cuda:N or mps.")
    precision: PrecisionName = pydantic.Field(
        "auto", description="Forward/backward precision: auto (bf16 on GPUs that support it, fp16 with a loss scaler "
        "on older ones, fp32 on the CPU), fp32, bf16 or fp16.")
    micro_batch: Optional[Positive] = pydantic.Field(
        None, description="Compute each batch in slices of this many samples, gradients accumulated, so a device "
        "that cannot hold the run's batch size still trains it (default: the largest that fits; the whole batch on "
        "the CPU).")
    threads: Optional[Positive] = pydantic.Field(None, description="torch threads (default: torch's).")
    slowdown: Annotated[float, pydantic.Field(ge=1, le=100)] = pydantic.Field(
        1.0, description="Emulate slower hardware: each step takes this many times longer, up to 100 (the swarm "
        "lab's stragglers).")


class Evaluation(SettingsModel):
    """Held-out evaluations: how often, on how much."""

    every: Seconds = pydantic.Field(10.0, description="Seconds between held-out evaluations; 0: only at the end.",
                                    json_schema_extra=flag("eval-every"))
    batches: Optional[Positive] = pydantic.Field(
        None, description="Evaluate on the first N batches of the held-out set only: quicker, less CPU taken from "
        "training (default: all of it).", json_schema_extra=flag("eval-batches"))
    final: bool = pydantic.Field(True, description="Evaluate the held-out set once more at the end.",
                                 json_schema_extra=flag("final-eval"))


class Stop(SettingsModel):
    """When the peer stops training (Ctrl-C and SIGTERM always stop it)."""

    max_seconds: Optional[Seconds] = pydantic.Field(
        None, description="Stop after this many seconds of training (counted from `ready`: joined, --wait-peers met).")
    max_steps: Optional[Positive] = pydantic.Field(None, description="Stop after this many local steps.")
    target_accuracy: Optional[Annotated[float, pydantic.Field(ge=0, le=1)]] = pydantic.Field(
        None, description="Stop once a held-out evaluation reaches it.")


class Checkpoints(SettingsModel):
    """Where and how often this peer keeps its state on disk."""

    dir: Optional[Path] = pydantic.Field(None, description="Resume from and save checkpoints to this directory.",
                                         json_schema_extra=flag("checkpoint-dir"))
    every: Annotated[float, pydantic.Field(gt=0)] = pydantic.Field(
        60.0, description="Seconds between checkpoints (taken after a swarm step).",
        json_schema_extra=flag("checkpoint-every"))


class Monitoring(SettingsModel):
    """What this peer serves about itself."""

    metrics_port: Optional[Annotated[int, pydantic.Field(ge=0, le=65535)]] = pydantic.Field(
        None, description="Serve this peer's Prometheus metrics at http://HOST:PORT/metrics (0: any free port; "
        "default off).")
    metrics_host: str = pydantic.Field("127.0.0.1", description="Listen address of --metrics-port (0.0.0.0 for a "
                                       "Prometheus elsewhere; metrics say what this peer does: local unless asked).")


class PeerConfig(SettingsModel):
    """Everything a peer chooses for itself. Peers of one run may differ in all of it."""

    run_id: str = pydantic.Field(description="Name of the training run.", json_schema_extra=flag("run-id", "-r"))
    create: bool = pydantic.Field(False, description="Publish the run's settings (a signed manifest); without "
                                  "--initial-peers, start the run as its first peer.")
    network: NodeConfig = NodeConfig()
    connection: Connection = Connection()
    data: Data = Data()
    compute: Compute = Compute()
    evaluation: Evaluation = Evaluation()
    stop: Stop = Stop()
    checkpoints: Checkpoints = Checkpoints()
    monitoring: Monitoring = Monitoring()
    bans: Accountability = Accountability()
    timing: Timing = Timing()

    @pydantic.field_validator("run_id")
    @classmethod
    def _check_run_id(cls, value: str) -> str:
        return check_run_id(value)

    @pydantic.model_validator(mode="after")
    def _check(self) -> PeerConfig:
        if self.stop.target_accuracy is not None and self.evaluation.every == 0:
            raise ConfigError("--target-accuracy needs evaluations: set --eval-every > 0")
        return self
