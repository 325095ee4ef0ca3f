"""The run configuration: every run-level setting (what every peer of a run must share) and the only
copy of its defaults. ``sg.Peer``, ``swarmgrad peer``, the run manifest, ``swarmgrad demo`` and
the lab's scenarios all read it.

    config = RunConfig(strategy=DiLoCo(inner_steps=100), compression="int8")

Which fields a caller set is kept (pydantic's ``model_fields_set``): a peer joining a run takes
the fields it did not set from the run's manifest, and refuses to start when a field it did set
differs (``resolve_against_run``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal, Optional, Union

import pydantic

from swarmgrad.averaging.privacy import Privacy
from swarmgrad.averaging.settings import (
    DEFAULT_AGGREGATOR,
    DEFAULT_COMPRESSION,
    Aggregator,
    Averaging,
    Gossip,
    Moshpit,
    check_aggregator,
    check_codec,
)
from swarmgrad.errors import ConfigError
from swarmgrad.settings import SettingsModel, describe_validation_error, flag  # noqa: F401  (re-exported)

Overlap = Literal["auto", "on", "off"]


class DiLoCo(SettingsModel):
    """DiLoCo (arXiv 2311.08105): ``inner_steps`` local steps per peer between swarm steps (on
    average over the peers of an epoch), then the pseudo-gradients are averaged and an outer
    Nesterov step is taken from the common start. ``overlap``: whether a round may travel while
    the next inner phase runs, its outer step landing when it is back (peer/overlap.py): ``auto``
    (where the measured rounds take a large share of the inner phase), ``on`` or ``off``."""

    name: Literal["diloco"] = "diloco"
    inner_steps: Annotated[int, pydantic.Field(ge=1, le=1_000_000)] = pydantic.Field(
        50, description="Local steps between averaging.")
    outer_lr: Annotated[float, pydantic.Field(gt=0, le=10)] = pydantic.Field(0.7, description="Outer learning rate.")
    outer_momentum: Annotated[float, pydantic.Field(ge=0, lt=1)] = pydantic.Field(
        0.9, description="Outer Nesterov momentum, in [0, 1).")
    overlap: Overlap = pydantic.Field(
        "auto", description="A round travels while the next local steps run, its outer step applied when it is "
        "back: on, off, or auto (where rounds and local steps take comparable times: --overlap-share).")


class SyncSGD(SettingsModel):
    """Synchronous data parallelism: one optimizer step per ``target_batch_size`` samples swarm-wide."""

    name: Literal["sync"] = "sync"
    target_batch_size: Annotated[int, pydantic.Field(ge=1, le=10**9)] = pydantic.Field(
        4096, description="Swarm-wide samples per step.")


class GossipSGD(SettingsModel):
    """Local steps; every ``every`` steps the parameters are averaged (gossip or moshpit)."""

    name: Literal["gossip"] = "gossip"
    every: Annotated[int, pydantic.Field(ge=1, le=1_000_000)] = pydantic.Field(
        4, description="Local steps between parameter averaging.", json_schema_extra=flag("gossip-every"))


Strategy = Annotated[Union[DiLoCo, SyncSGD, GossipSGD], pydantic.Field(discriminator="name")]
STRATEGY_AVERAGINGS = {"diloco": ("moshpit",), "sync": ("moshpit",), "gossip": ("gossip", "moshpit")}
Hyperparameter = Union[int, float, str, bool]
TaskOption = Union[str, int, float, bool]


class RunConfig(SettingsModel):
    """What every peer of a run shares. ``averaging`` left out means the strategy's natural choice:
    moshpit for diloco and sync, gossip for the gossip strategy. ``aggregator``: how contributions
    are combined (averaging/robust.py); centered-clip by default, since any peer of a public run may
    lie (with gossip it clips each push; gossip has no trimmed mean)."""

    task: Optional[Annotated[str, pydantic.Field(max_length=256)]] = pydantic.Field(
        None, description="Task to train: a built-in task's name or module:attribute. Omit to use the run's manifest.",
        json_schema_extra={"argument": "TASK"})
    task_options: dict[str, TaskOption] = pydantic.Field(
        {}, description="An option of the task, KEY=VALUE (e.g. context=256); repeat the flag for more.",
        json_schema_extra=flag("task-option"))
    strategy: Strategy = pydantic.Field(DiLoCo(), description="How peers train together.")
    averaging: Optional[Averaging] = pydantic.Field(
        None, description="How peers average (default: moshpit for diloco and sync, gossip for gossip).")
    compression: str = pydantic.Field(
        DEFAULT_COMPRESSION, description="Codec of what peers send: none, fp16, bf16, int8[:block], q4[:block], "
        "q2[:block], topk[:fraction], sparse[:fraction[:bits]], powersgd[:rank].")
    aggregator: Aggregator = pydantic.Field(
        DEFAULT_AGGREGATOR, description="How contributions are combined: mean, centered-clip (bounds what one liar "
        "can do; gossip: clipped pushes) or trimmed-mean.")
    privacy: Optional[Privacy] = None
    hparams: dict[str, Hyperparameter] = pydantic.Field(
        {}, description="A hyperparameter of the task's training, KEY=VALUE (optimizer, weight_decay, ...); repeat "
        "the flag for more.", json_schema_extra=flag("hparam") | {"keys": {
            "lr": {"type": "number", "description": "Inner learning rate (default: the task's)."},
            "batch_size": {"type": "integer", "description": "Local batch size (default: the task's)."}}})
    seed: Annotated[int, pydantic.Field(ge=0, lt=2**63)] = pydantic.Field(
        0, description="Seed of the model's initial weights.")

    @pydantic.field_validator("compression")
    @classmethod
    def _check_compression(cls, value: str) -> str:
        return check_codec(value)

    @pydantic.model_validator(mode="after")
    def _fill_averaging(self) -> RunConfig:
        if self.averaging is None:  # a default, not a choice: model_fields_set does not change
            object.__setattr__(self, "averaging", Gossip() if self.strategy.name == "gossip" else Moshpit())
        allowed = STRATEGY_AVERAGINGS[self.strategy.name]
        if self.averaging.kind not in allowed:
            raise ConfigError(f"strategy {self.strategy.name} does not work with {self.averaging.kind} averaging; "
                              f"use {' or '.join(allowed)}")
        check_aggregator(self.aggregator, self.averaging.kind)
        return self

    @property
    def moshpit(self) -> Moshpit | None:
        return self.averaging if isinstance(self.averaging, Moshpit) else None

    def settings_json(self) -> str:
        """The run-level settings as canonical JSON (what the manifest carries; the task travels beside it)."""
        return json.dumps(self.model_dump(mode="json", exclude={"task"}), sort_keys=True)

    @property
    def digest(self) -> str:
        """Short id of the settings: peers whose digests differ will not average together."""
        return hashlib.sha256(self.settings_json().encode()).hexdigest()[:16]

    def explicit(self) -> dict[str, Any]:
        """The settings the caller chose, as dotted leaves (a chosen strategy always names itself)."""
        return _explicit_leaves(self)


def run_config(**fields: Any) -> RunConfig:
    """A RunConfig from plain data (a manifest, a config file), bad input as one ConfigError."""
    return RunConfig.parse(fields, "run settings")


class RunConfigMismatch(ConfigError):
    """This peer's explicit settings differ from the run's manifest; names each field and both values."""

    def __init__(self, run_id: str, conflicts: list[tuple[str, Any, Any]]):
        self.conflicts = conflicts
        listed = "; ".join(f"{field}: {mine!r} here, {theirs!r} in the run" for field, mine, theirs in conflicts)
        super().__init__(f"run {run_id!r} trains with other settings ({listed}). Leave those settings out to "
                         "take the run's, or pick another run id")


def resolve_against_run(run_id: str, mine: RunConfig, run: RunConfig | None) -> RunConfig:
    """The settings to train with: the run's (when it has a manifest), after checking that every
    setting this peer chose agrees with it; this peer's own otherwise."""
    if run is None:
        return mine
    theirs = _leaves(run.model_dump(mode="json"))
    conflicts = [(field, value, theirs.get(field)) for field, value in sorted(mine.explicit().items())
                 if field != "task" and theirs.get(field) != value]
    if conflicts:
        raise RunConfigMismatch(run_id, conflicts)
    return run


def _explicit_leaves(model: pydantic.BaseModel, prefix: str = "") -> dict[str, Any]:
    leaves: dict[str, Any] = {}
    for name in sorted(model.model_fields_set | _discriminators(model)):
        value = getattr(model, name)
        if isinstance(value, pydantic.BaseModel):
            leaves.update(_explicit_leaves(value, f"{prefix}{name}."))
        else:
            leaves.update(_leaves({name: _plain(value)}, prefix))
    return leaves


def _discriminators(model: pydantic.BaseModel) -> set[str]:
    return {name for name in ("name", "kind") if name in type(model).model_fields}


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str)) if isinstance(value, (dict, list, tuple)) else value


def _leaves(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(_leaves(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
