"""The run-level options of ``swarmgrad peer`` (the flags every peer of a run shares) and how they
become a :class:`~swarmgrad.peer.config.RunConfig`: :data:`RUN_OPTIONS` says where each sits in
it, :func:`run_config_from` builds one from chosen values, :func:`run_flags` writes them back as
flags (what the demo and the lab pass to their peers).

The options have no defaults of their own: one left unset comes from the run's manifest when
joining, else from RunConfig's default.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import pydantic

from swarmgrad.averaging.privacy import Privacy
from swarmgrad.averaging.settings import Gossip, Moshpit, check_aggregator, check_codec
from swarmgrad.errors import ConfigError
from swarmgrad.peer.config import RunConfig, run_config
from swarmgrad.peer.strategies.registry import STRATEGIES

POSITIONAL = {"task": "TASK"}  # options given as arguments, not flags

# every run-level option and where it sits in RunConfig (model dump paths)
RUN_OPTIONS: dict[str, str] = {
    "strategy": "strategy.name",
    "averaging": "averaging.kind",
    "compression": "compression",
    "aggregator": "aggregator",
    "inner_steps": "strategy.inner_steps",
    "outer_lr": "strategy.outer_lr",
    "outer_momentum": "strategy.outer_momentum",
    "overlap": "strategy.overlap",
    "target_batch_size": "strategy.target_batch_size",
    "gossip_every": "strategy.every",
    "group_size": "averaging.group_size",
    "privacy_clip": "privacy.clip_norm",
    "privacy_noise": "privacy.noise_multiplier",
    "privacy_level": "privacy.level",
    "max_epsilon": "privacy.max_epsilon",
    "lr": "hparams.lr",
    "batch_size": "hparams.batch_size",
    "seed": "seed",
}
AVERAGINGS: dict[str, type[pydantic.BaseModel]] = {
    model.model_fields["kind"].default: model for model in (Moshpit, Gossip)}
PRIVACY_OPTIONS = ("privacy_clip", "privacy_noise", "privacy_level", "max_epsilon")


def key_name(name: str) -> str:
    """The option's key in a file: its flag without ``--``."""
    return name.replace("_", "-")


def flag_name(name: str) -> str:
    return POSITIONAL.get(name, f"--{key_name(name)}")


def run_config_from(values: Mapping[str, Any], *, task: str | None = None,
                    where: Callable[[str], str] = flag_name) -> RunConfig:
    """The RunConfig that run-level option ``values`` choose (None: not chosen). Only the chosen
    settings are set, so ``RunConfig.explicit()`` is what the user asked for. Each value is checked
    against the field it fills first, so that an error names the option: ``where(option)``."""
    chosen = {name: values[name] for name in RUN_OPTIONS if values.get(name) is not None}
    data: dict[str, Any] = {} if task is None else {"task": task}
    for name, value in chosen.items():
        _put(data, RUN_OPTIONS[name], value)
    _check_owners(data, chosen, where)
    for name, value in chosen.items():
        _check_value(data, name, value, where)
    if "privacy" in data:
        try:
            Privacy(**data["privacy"])
        except (ConfigError, pydantic.ValidationError) as error:
            raise ConfigError(f"{where(_privacy_option_in(str(error), chosen))}: {_one_line(error)}") from None
    return run_config(**data)  # what is left: settings that do not fit together, said by RunConfig


def run_values(config: RunConfig) -> dict[str, Any]:
    """Each run-level option's value in ``config`` (None where it does not apply)."""
    dumped = config.model_dump(mode="json")
    values = {}
    for name, path in RUN_OPTIONS.items():
        value: Any = dumped
        for part in path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        values[name] = value
    return values


def run_flags(values: Mapping[str, Any]) -> list[str]:
    """The chosen run-level options as ``swarmgrad peer`` flags (what the demo and the lab pass)."""
    flags: list[str] = []
    for name in RUN_OPTIONS:
        value = values.get(name)
        if value is not None:
            flags += [flag_name(name), str(value)]
    return flags


def _put(data: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        data = data.setdefault(part, {})
    data[leaf] = value


def _check_owners(data: dict[str, Any], chosen: dict[str, Any], where: Callable[[str], str]) -> None:
    """A strategy's or an averaging's parameter needs that strategy or averaging; privacy needs a
    clip norm and a noise multiplier."""
    if "strategy" in data:
        default = RunConfig.model_fields["strategy"].default.name
        name = data["strategy"].setdefault("name", default)
        how = "" if "strategy" in chosen else " (the default)"
        _check_parameters(data["strategy"], STRATEGIES, name, f"{name}{how}", "strategy", chosen, where)
    if "averaging" in data:
        natural = _natural_averaging(data)
        kind = data["averaging"].get("kind", natural)
        if kind is not None:
            data["averaging"]["kind"] = kind
            strategy = data.get("strategy", {}).get("name") or RunConfig.model_fields["strategy"].default.name
            how = "" if "averaging" in chosen else f" (the default for strategy {strategy})"
            _check_parameters(data["averaging"], AVERAGINGS, kind, f"{kind}{how}", "averaging", chosen, where)
            allowed = STRATEGIES[strategy].averagings if strategy in STRATEGIES else (kind,)
            if "averaging" in chosen and kind in AVERAGINGS and kind not in allowed:
                raise ConfigError(f"{where('averaging')}: strategy {strategy} does not work with {kind} averaging; "
                                  f"use {' or '.join(allowed)}")
    given = [name for name in PRIVACY_OPTIONS if name in chosen]
    if given and not {"privacy_clip", "privacy_noise"} <= set(given):
        raise ConfigError(f"{where(given[0])}: differential privacy needs both --privacy-clip and --privacy-noise")


def _check_parameters(section: dict[str, Any], models: dict[str, type[pydantic.BaseModel]], name: str,
                      described: str, part: str, chosen: dict[str, Any], where: Callable[[str], str]) -> None:
    model = models.get(name)
    if model is None:
        return  # an unknown name: _check_value says so
    for option, path in RUN_OPTIONS.items():
        leaf = path.removeprefix(f"{part}.")
        if option in chosen and path.startswith(f"{part}.") and leaf in section and leaf not in model.model_fields:
            owner = next((n for n, m in models.items() if leaf in m.model_fields), "another")
            raise ConfigError(f"{where(option)}: a setting of {part} {owner}, but the {part} is {described}")


def _check_value(data: dict[str, Any], name: str, value: Any, where: Callable[[str], str]) -> None:
    """``value`` against the type and bounds of the RunConfig field it fills."""
    section, _, leaf = RUN_OPTIONS[name].partition(".")
    if leaf in ("name", "kind"):
        models = STRATEGIES if section == "strategy" else AVERAGINGS
        if value not in models:
            raise ConfigError(f"{where(name)}: must be one of {', '.join(map(repr, models))} (got {value!r})")
        return
    if section == "compression":
        try:
            check_codec(value)
        except ConfigError as error:
            raise ConfigError(f"{where(name)}: {error}") from None
        return
    if section == "aggregator":  # which ones there are depends on the averaging (gossip has no trimmed mean)
        try:
            check_aggregator(value, data.get("averaging", {}).get("kind") or _natural_averaging(data) or "moshpit")
        except ConfigError as error:
            raise ConfigError(f"{where(name)}: {error}") from None
        return
    model = {"strategy": STRATEGIES.get(data.get("strategy", {}).get("name")),
             "averaging": AVERAGINGS.get(data.get("averaging", {}).get("kind")),
             "privacy": Privacy}.get(section, RunConfig)
    info = model.model_fields.get(leaf or section) if model is not None else None
    if info is None:  # hparams: any plain value
        return
    try:
        pydantic.TypeAdapter(info.rebuild_annotation()).validate_python(value)
    except pydantic.ValidationError as error:
        raise ConfigError(f"{where(name)}: {problem_message(error.errors()[0])}") from None


def _privacy_option_in(message: str, chosen: Mapping[str, Any]) -> str:
    """The privacy option a Privacy error is about (its messages name the field), else the first given."""
    for name in PRIVACY_OPTIONS:
        if name in chosen and RUN_OPTIONS[name].partition(".")[2] in message:
            return name
    return next(name for name in PRIVACY_OPTIONS if name in chosen)


def _one_line(error: Exception) -> str:
    if isinstance(error, pydantic.ValidationError):
        return problem_message(error.errors()[0])
    return str(error)


def _natural_averaging(data: dict[str, Any]) -> str | None:
    """The averaging RunConfig picks for the chosen strategy (None if the strategy is invalid)."""
    name = data.get("strategy", {}).get("name")
    if name is not None and name not in STRATEGIES:
        return None  # said as an error of --strategy
    return RunConfig(**({"strategy": {"name": name}} if name else {})).averaging.kind


def problem_message(problem: dict[str, Any]) -> str:
    """One pydantic error as words: the cause's message, or pydantic's with the value it got."""
    cause = problem.get("ctx", {}).get("error")
    if isinstance(cause, Exception):
        return str(cause)
    if problem["type"] == "union_tag_invalid":
        ctx = problem.get("ctx", {})
        return f"must be one of {ctx.get('expected_tags')} (got {ctx.get('tag')!r})"
    message = problem["msg"].removeprefix("Value error, ")
    got = problem.get("input")
    if problem["type"] not in ("value_error", "model_type") and not isinstance(got, (dict, list)):
        message += f" (got {got!r})"
    return message


__all__ = ["AVERAGINGS", "RUN_OPTIONS", "STRATEGIES", "flag_name", "key_name", "problem_message", "run_config_from",
           "run_flags", "run_values"]
