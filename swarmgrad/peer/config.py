"""The run configuration: every run-level setting (what every peer of a run must share) and the only
copy of its defaults. ``sg.Peer``, ``swarmgrad peer``, the run manifest, ``swarmgrad demo`` and
the lab's scenarios all read it.

    config = RunConfig(strategy=DiLoCo(inner_steps=100), compression="int8")

The strategies (``DiLoCo``, ``SyncSGD``, ``GossipSGD``) are defined beside their policies in
peer/strategies/ and found by its registry.

Which fields a caller set is kept (pydantic's ``model_fields_set``): a peer joining a run takes
the fields it did not set from the run's manifest, and refuses to start when a field it did set
differs (``resolve_against_run``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Optional, Union

import pydantic

from swarmgrad.averaging.privacy import Privacy
from swarmgrad.averaging.rules import RULE_NAMES
from swarmgrad.averaging.settings import (
    DEFAULT_AGGREGATOR,
    DEFAULT_COMPRESSION,
    Averaging,
    Moshpit,
    check_aggregator,
    check_codec,
)
from swarmgrad.errors import ConfigError
from swarmgrad.peer.strategies.registry import STRATEGIES, Strategy, check_averaging
from swarmgrad.settings import SettingsModel, flag

Hyperparameter = Union[int, float, str, bool]
TaskOption = Union[str, int, float, bool]


class RunConfig(SettingsModel):
    """What every peer of a run shares. ``averaging`` left out means the strategy's natural choice
    (the first of its ``averagings``: moshpit for diloco and sync, gossip for the gossip strategy).
    ``aggregator``: how contributions are combined (a rule of averaging/rules/); centered-clip by
    default, since any peer of a public run may lie (with gossip it clips each push; a rule that
    needs a group, such as trimmed-mean, does not gossip)."""

    task: Optional[Annotated[str, pydantic.Field(max_length=256)]] = pydantic.Field(
        None, description="Task to train: a built-in task's name or module:attribute. Omit to use the run's manifest.",
        json_schema_extra={"argument": "TASK"})
    task_options: dict[str, TaskOption] = pydantic.Field(
        {}, description="An option of the task, KEY=VALUE (e.g. context=256 for charlm), checked against the options "
        "the task declares; repeat the flag for more.", json_schema_extra=flag("task-option"))
    strategy: Strategy = pydantic.Field(STRATEGIES["diloco"](),
                                        description=f"How peers train together: {', '.join(STRATEGIES)}.")
    averaging: Optional[Averaging] = pydantic.Field(
        None, description="How peers average (default: moshpit for diloco and sync, gossip for gossip).")
    # listing the codec names needs torch (codecs/): the help points at them
    compression: str = pydantic.Field(
        DEFAULT_COMPRESSION, description="Codec of what peers send, NAME or NAME:PARAMETER: a codec of "
        "averaging/codecs/ (CODEC_NAMES; the README's Options table lists them).")
    aggregator: str = pydantic.Field(
        DEFAULT_AGGREGATOR, description=f"How contributions are combined: {', '.join(RULE_NAMES)} (averaging/rules/; "
        "centered-clip bounds what one liar can do, and with gossip clips each push).")
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
            natural = pydantic.TypeAdapter(Averaging).validate_python({"kind": self.strategy.averagings[0]})
            object.__setattr__(self, "averaging", natural)
        check_averaging(self.strategy, self.averaging.kind)
        check_aggregator(self.aggregator, self.averaging.kind)
        _check_noise_shares(self.privacy, self.averaging)
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


def _check_noise_shares(privacy: Privacy | None, averaging: Averaging) -> None:
    # distributed DP holds only where an average sums that many releases: a smaller group never averages
    shares = privacy.noise_shares if privacy is not None else 1
    if shares == 1:
        return
    if not isinstance(averaging, Moshpit):
        raise ConfigError(f"privacy noise_shares={shares}: a gossip push is seen alone, so each must carry all the "
                          "noise; use noise_shares=1 with gossip")
    if averaging.min_group_size < shares:
        raise ConfigError(f"privacy noise_shares={shares} needs min_group_size >= {shares} (got "
                          f"{averaging.min_group_size}): a smaller group's average would carry less noise than stated")


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
