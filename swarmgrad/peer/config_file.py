"""Config files of ``swarmgrad peer`` and ``swarmgrad bootstrap``: flat TOML (or JSON) keyed by the
options of swarmgrad/peer/options.py, read into given values and written from built models.

    task = "digits"
    run-id = "my-run"
    initial-peers = ["/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW..."]
    inner-steps = 20
    task-options = {context = 256}

A key may use underscores for dashes (``inner_steps``). What a file holds is what was chosen:
written from models, it has the settings they set (``model_fields_set``) as keys and the rest as
comments with their default, so reading it back gives the same models, a run-level setting left
unset included. The demo and the lab hand their peers such files.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

import pydantic

from swarmgrad.errors import ConfigError
from swarmgrad.peer.config import RunConfig
from swarmgrad.peer.options import PEER_OPTIONS, Given, Option, OptionSet, format_value
from swarmgrad.peer.peer_config import PeerConfig


def read_config_file(options: OptionSet, path: Path) -> dict[Option, Given]:
    """The file's values by option (``.json``: JSON, where null is unset; else TOML); an unknown or
    repeated key is one ConfigError naming the file and the key."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror or error}") from None
    data = _parse(path, text)
    found: dict[Option, Given] = {}
    written: dict[Option, str] = {}
    keys = [option.key for option in options.options]
    for key, value in data.items():
        option = options.by_key(key.replace("_", "-"))
        if option is None:
            close = difflib.get_close_matches(key.replace("_", "-"), keys, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; the keys are: {', '.join(keys)}"
            raise ConfigError(f"{path}: key {key!r}: not an option of swarmgrad {options.command}{hint}")
        if option in written:
            raise ConfigError(f"{path}: key {key!r}: given twice (also as {written[option]!r})")
        written[option] = key
        if value is not None:
            found[option] = Given(value, f"{path}: key {key!r}")
    return found


def _parse(path: Path, text: str) -> dict[str, Any]:
    if Path(path).suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}: not valid JSON: {error}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object of options, got {type(data).__name__}")
        return data
    toml = _toml()
    try:
        return toml.loads(text)
    except toml.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from None


def _toml() -> Any:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ConfigError("reading --config files needs Python 3.11+ (tomllib) or `pip install tomli`") from None
    return tomllib


# -- writing ------------------------------------------------------------------------------------


def render_toml(options: OptionSet, models: Mapping[str, pydantic.BaseModel]) -> str:
    """The models as a file ``--config`` reads back: what they set as keys, the rest as comments."""
    chosen = options.chosen(models)
    lines = [f"# swarmgrad {options.command}: options merged from flags, SWARMGRAD_* environment variables, the",
             "# --config file and defaults, in that order. `--config` reads this file back. Commented-out",
             "# lines are defaults (set nowhere)."]
    if "run" in options.roots:
        lines.append("# A run setting left unset takes the run's, when the run has a manifest.")
    section = None
    for option in options.options:
        if (option.root, option.section) != section:
            section = (option.root, option.section)
            lines.append(f"# -- {option.section or option.root} --")
        if option in chosen:
            lines.append(f"{option.key} = {toml_value(chosen[option])}")
        elif option.required or option.default is None or option.default in ([], {}):
            lines.append(f"# {option.key}: not set")
        else:
            lines.append(f"# {option.key} = {toml_value(_plain_default(option.default))}")
    return "\n".join(lines) + "\n"


def render_json(options: OptionSet, models: Mapping[str, pydantic.BaseModel]) -> str:
    """Every option keyed like the file: what the models set, a local option's default, and null
    for a run-level one left unset (the run's, when joining) or one with no value."""
    chosen = options.chosen(models)
    data = {}
    for option in options.options:
        if option in chosen:
            data[option.key] = chosen[option]
        elif option.root == "run" or option.required:
            data[option.key] = None
        else:
            data[option.key] = _plain_default(option.default)
    return json.dumps(data, allow_nan=False)


def load_config(options: OptionSet, *, flags: Mapping[Option, Given], config_file: Path | None = None,
                environ: Mapping[str, str] | None = None) -> dict[str, pydantic.BaseModel]:
    """The command's models from ``flags`` (those given on the command line), then the
    ``SWARMGRAD_*`` variables of ``environ``, then ``config_file``, then the defaults."""
    given: dict[Option, Given] = {}
    if config_file is not None:
        given.update(read_config_file(options, config_file))
    given.update(options.from_environment(os.environ if environ is None else environ))
    given.update(flags)
    return options.build(given)


def write_peer_config(path: Path, run: RunConfig, peer: PeerConfig) -> Path:
    """A ``swarmgrad peer --config`` file for these settings (what the demo and the lab pass)."""
    path.write_text(render_toml(PEER_OPTIONS, {"run": run, "peer": peer}))
    return path


def _plain_default(value: Any) -> Any:
    return pydantic.TypeAdapter(Any).dump_python(value, mode="json")


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return format_value(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(key))} = {toml_value(item)}" for key, item in value.items()) + "}"
    # a TOML basic string: JSON's escapes are TOML's, except that TOML also forbids a raw DEL
    return json.dumps(str(value)).replace("\x7f", "\\u007f")
