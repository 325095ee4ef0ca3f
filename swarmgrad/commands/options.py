"""Options of ``swarmgrad peer`` and ``swarmgrad bootstrap``: one pydantic model per command, merged
from flags, then ``SWARMGRAD_*`` environment variables, then a TOML file, then defaults.

A file holds the same options as the flags, flat, keyed by the flag name without ``--``
(``inner-steps = 20``; ``inner_steps`` works too)::

    task = "digits"
    run-id = "my-run"
    initial-peers = ["/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW..."]
    inner-steps = 20

Each option has one environment variable, ``SWARMGRAD_`` and its name in capitals
(``SWARMGRAD_INNER_STEPS``); lists there are comma or space separated.

Run-level options (what every peer of a run shares) have no defaults here: left unset, they come
from the run's manifest when joining, or from :class:`~swarmgrad.peer.config.RunConfig`'s defaults.
:func:`~swarmgrad.commands.run_options.run_config_from` turns them into a RunConfig.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, ClassVar, Generic, Mapping, Optional, TypeVar

import pydantic

from swarmgrad.commands.run_options import RUN_OPTIONS, flag_name, key_name, problem_message
from swarmgrad.dht.config import NodeConfig, check_run_id
from swarmgrad.errors import ConfigError
from swarmgrad.net.accountability import DEFAULT_ACCOUNTABILITY
from swarmgrad.net.ratelimit import DEFAULT_LIMIT_MBPS, MAX_LIMIT_MBPS

ENV_PREFIX = "SWARMGRAD_"

# how each node option becomes a NodeConfig field
NODE_OPTIONS = {"host": "host", "port": "port", "identity": "identity_path", "announce": "announce_maddrs",
                "initial_peers": "initial_peers", "client_mode": "client_mode", "data_port": "data_port",
                "wait": "bootstrap_timeout"}


def env_name(name: str) -> str:
    return f"{ENV_PREFIX}{name.upper()}"


def _split_list(value: Any) -> Any:
    """Addresses given as one string, repeated flags or a list, each comma or space separated."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return [part for item in value for part in re.split(r"[,\s]+", item) if part]
    return value  # pydantic says what is wrong with it


def _run_id(value: Optional[str]) -> Optional[str]:
    return None if value is None else check_run_id(value)


def _node_default(name: str) -> Any:
    return NodeConfig.model_fields[name].default


Addresses = Annotated[list[str], pydantic.BeforeValidator(_split_list)]
RunId = Annotated[str, pydantic.AfterValidator(_run_id)]
Positive = Annotated[int, pydantic.Field(ge=1)]
Seconds = Annotated[float, pydantic.Field(ge=0)]
Mbps = Annotated[float, pydantic.Field(gt=0, le=MAX_LIMIT_MBPS)]


class CommandOptions(pydantic.BaseModel):
    """A command's options: every field is a flag (``--field-name``), a file key and a variable."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    command: ClassVar[str]


class BootstrapOptions(CommandOptions):
    command: ClassVar[str] = "bootstrap"

    host: str = _node_default("host")
    port: int = _node_default("port")
    identity: Optional[Path] = None
    run_id: Optional[RunId] = None
    announce: Addresses = []
    initial_peers: Addresses = []


class PeerOptions(CommandOptions):
    command: ClassVar[str] = "peer"

    task: Optional[str] = None
    run_id: RunId
    initial_peers: Addresses = []
    create: bool = False
    # run-level: None is "not chosen here"; run_config_from checks them against RunConfig's fields
    strategy: Optional[str] = None
    averaging: Optional[str] = None
    compression: Optional[str] = None
    aggregator: Optional[str] = None
    inner_steps: Optional[int] = None
    outer_lr: Optional[float] = None
    outer_momentum: Optional[float] = None
    overlap: Optional[str] = None
    target_batch_size: Optional[int] = None
    gossip_every: Optional[int] = None
    group_size: Optional[int] = None
    privacy_clip: Optional[float] = None
    privacy_noise: Optional[float] = None
    privacy_level: Optional[str] = None
    max_epsilon: Optional[float] = None
    lr: Optional[float] = None
    batch_size: Optional[int] = None
    seed: Optional[int] = None
    # this peer's own
    shard: Optional[Annotated[int, pydantic.Field(ge=0)]] = None
    num_shards: Positive = 1
    data_dir: Optional[str] = None
    max_seconds: Optional[Seconds] = None
    max_steps: Optional[Positive] = None
    target_accuracy: Optional[Annotated[float, pydantic.Field(ge=0, le=1)]] = None
    eval_every: Seconds = 10.0  # 0: only at the end
    eval_batches: Optional[Positive] = None  # None: the whole held-out set
    no_final_eval: bool = False
    checkpoint_dir: Optional[Path] = None
    threads: Optional[Positive] = None
    slowdown: Annotated[float, pydantic.Field(ge=1, le=100)] = 1.0
    host: str = _node_default("host")
    port: int = _node_default("port")
    data_port: int = _node_default("data_port")
    announce: Addresses = []
    identity: Optional[Path] = None
    ticket: Optional[Path] = None  # membership ticket of a private run (`swarmgrad run grant`)
    client_mode: bool = False
    trusted_network: bool = False
    upload_limit_mbps: Optional[Mbps] = DEFAULT_LIMIT_MBPS  # caps on the data plane; None: none
    download_limit_mbps: Optional[Mbps] = DEFAULT_LIMIT_MBPS
    # when a misbehaving peer is banned here (averaging/accountability.py checks them)
    ban_threshold: float = DEFAULT_ACCOUNTABILITY.ban_threshold
    ban_seconds: float = DEFAULT_ACCOUNTABILITY.ban_seconds
    wait: Annotated[float, pydantic.Field(ge=1)] = 30.0  # seconds for the run's manifest and peers
    wait_peers: Positive = 1
    metrics_port: Optional[Annotated[int, pydantic.Field(ge=0, le=65535)]] = None  # Prometheus /metrics; 0: any port
    metrics_host: str = "127.0.0.1"  # metrics say what this peer does: local unless asked

    @pydantic.model_validator(mode="after")
    def _check(self) -> PeerOptions:
        if self.target_accuracy is not None and self.eval_every == 0:
            raise ConfigError("--target-accuracy needs evaluations: set --eval-every > 0")
        return self

    def run_values(self) -> dict[str, Any]:
        """The run-level options, by name (None: not chosen)."""
        return {name: getattr(self, name) for name in RUN_OPTIONS}


Options = TypeVar("Options", bound=CommandOptions)


@dataclass(frozen=True)
class Loaded(Generic[Options]):
    """Merged options and where each value that is not a default came from."""

    options: Options
    origins: dict[str, str] = field(default_factory=dict)  # option -> "--flag", "FILE: key 'k'", ...

    def where(self, name: str) -> str:
        return self.origins.get(name, flag_name(name))


def load_options(model: type[Options], *, flags: Mapping[str, Any], config_file: Path | None = None,
                 environ: Mapping[str, str] | None = None) -> Loaded[Options]:
    """Merge ``flags`` (only those given on the command line), then the ``SWARMGRAD_*`` variables of
    ``environ``, then ``config_file``, then the model's defaults; any problem is one ConfigError that
    names the flag, the variable, or the file and key it came from."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    if config_file is not None:
        for name, (key, value) in read_config_file(model, config_file).items():
            values[name], origins[name] = value, f"{config_file}: key {key!r}"
    for name in model.model_fields:
        raw = environ.get(env_name(name))
        if raw is not None and raw.strip():  # an empty variable is an unset one
            values[name], origins[name] = raw, f"environment variable {env_name(name)}"
    for name, value in flags.items():
        if name not in model.model_fields:
            raise ValueError(f"{name} is not an option of {model.__name__}")  # a bug, not a user error
        values[name], origins[name] = value, flag_name(name)
    try:
        options = model.model_validate(values)
    except pydantic.ValidationError as error:
        raise ConfigError(_describe(error, lambda name: origins.get(name, flag_name(name)))) from None
    return Loaded(options, origins)


def read_config_file(model: type[CommandOptions], path: Path) -> dict[str, tuple[str, Any]]:
    """The file's options as ``{field: (key as written, value)}``; unknown or repeated keys are errors."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror or error}") from None
    toml = _toml()
    try:
        data = toml.loads(text)
    except toml.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from None
    found: dict[str, tuple[str, Any]] = {}
    known = [key_name(name) for name in model.model_fields]
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in model.model_fields:
            close = difflib.get_close_matches(key.replace("_", "-"), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; the keys are: {', '.join(known)}"
            raise ConfigError(f"{path}: key {key!r}: not an option of swarmgrad {model.command}{hint}")
        if name in found:
            raise ConfigError(f"{path}: key {key!r}: given twice (also as {found[name][0]!r})")
        found[name] = (key, value)
    return found


def _toml() -> Any:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ConfigError("reading --config files needs Python 3.11+ (tomllib) or `pip install tomli`") from None
    return tomllib


# -- the node's settings ------------------------------------------------------------------------


def node_config(loaded: Loaded[Any]) -> NodeConfig:
    """The NodeConfig the options choose; an error names the option it came from."""
    fields = type(loaded.options).model_fields
    data = {target: getattr(loaded.options, name) for name, target in NODE_OPTIONS.items() if name in fields}
    reverse = {target: name for name, target in NODE_OPTIONS.items()}

    def option_at(location: tuple[Any, ...]) -> str | None:
        return reverse.get(str(location[0])) if location else None

    try:
        return NodeConfig.model_validate(data)
    except pydantic.ValidationError as error:
        raise ConfigError(_describe(error, loaded.where, option_at)) from None


# -- errors -------------------------------------------------------------------------------------


def _describe(error: pydantic.ValidationError, where: Callable[[str], str],
              option_at: Callable[[tuple[Any, ...]], str | None] | None = None) -> str:
    """One line for the first problem (a wrong value before a missing one): where it came from and what is wrong."""
    problems = sorted(error.errors(), key=lambda problem: problem["type"] == "missing")
    problem = problems[0]
    location = tuple(problem["loc"])
    name = option_at(location) if option_at is not None else (str(location[0]) if location else None)
    if problem["type"] == "missing" and name is not None:
        flag = flag_name(name)
        return (f"{flag} is required: pass {flag}, set {env_name(name)}, or put {key_name(name)} = ... "
                "in the --config file")
    message = problem_message(problem)
    if name is None:
        return message
    return f"{where(name)}: {message}"


# -- --print-config -----------------------------------------------------------------------------


def render_toml(loaded: Loaded[Any], defaults: Mapping[str, Any] | None = None) -> str:
    """The merged options as a TOML file that ``--config`` reads back: what was set (by a flag, a
    variable or the file) as keys, the rest as comments with their default (``defaults`` overrides
    the model's: the run-level ones from RunConfig)."""
    model = type(loaded.options)
    lines = [f"# swarmgrad {model.command}: options merged from flags, SWARMGRAD_* environment variables, the",
             "# --config file and defaults, in that order. `--config` reads this file back. Commented-out",
             "# lines are defaults (set nowhere)."]
    if model is PeerOptions:
        lines.append("# A run setting left unset takes the run's, when the run has a manifest.")
    for name, info in model.model_fields.items():
        key = key_name(name)
        if name in loaded.origins:
            lines.append(f"{key} = {_toml_value(getattr(loaded.options, name))}")
            continue
        default = (defaults or {}).get(name, None if info.is_required() else info.default)
        if default is None or default == []:
            lines.append(f"# {key}: not set")
        else:
            lines.append(f"# {key} = {_toml_value(default)}")
    return "\n".join(lines) + "\n"


def render_json(loaded: Loaded[Any]) -> str:
    """The merged options (defaults included, null for unset) as one JSON object keyed like the file."""
    data = loaded.options.model_dump(mode="json")
    return json.dumps({key_name(name): value for name, value in data.items()}, allow_nan=False)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    # a TOML basic string: JSON's escapes are TOML's, except that TOML also forbids a raw DEL
    return json.dumps(str(value)).replace("\x7f", "\\u007f")


__all__ = ["BootstrapOptions", "Loaded", "PeerOptions", "env_name", "load_options", "node_config", "read_config_file",
           "render_json", "render_toml"]
