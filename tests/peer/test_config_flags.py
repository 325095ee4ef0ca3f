"""Every leaf field of RunConfig and PeerConfig is a `swarmgrad peer` flag, a SWARMGRAD_* variable and a
config-file key, with a help text; --print-config reads back as the same configs. The fields are
walked here, not listed, so a field the generator dropped fails."""

from __future__ import annotations

import json
import typing

import pydantic
import pytest
import typer
from typer.testing import CliRunner

from swarmgrad.cli import app
from swarmgrad.errors import ConfigError
from swarmgrad.peer.config import RunConfig
from swarmgrad.peer.config_file import load_config, render_toml, toml_value
from swarmgrad.peer.options import PEER_OPTIONS, Given, Option
from swarmgrad.peer.peer_config import PeerConfig

MADDR = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWBrZfzJTLVMLC2mAwJPYFneSwyEVB9XZCPHPrnet727Ah"
# what an option needs beside it to be valid (privacy is on with a clip norm and a noise)
COMPANIONS = {"privacy": {"privacy-clip": 1.0, "privacy-noise": 0.5}, "data": {"num-shards": 8}}


@pytest.fixture(autouse=True)
def no_swarmgrad_environment(monkeypatch):
    import os

    for name in [name for name in os.environ if name.startswith("SWARMGRAD_")]:
        monkeypatch.delenv(name)


def leaf_paths(model: type[pydantic.BaseModel], prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Every leaf of ``model``: nested models and the members of unions of models walked."""
    paths = set()
    for name, info in model.model_fields.items():
        annotation = info.annotation
        while typing.get_origin(annotation) is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)] or [annotation]
        args = [typing.get_args(arg)[0] if typing.get_origin(arg) is typing.Annotated else arg for arg in args]
        models = [arg for arg in args if isinstance(arg, type) and issubclass(arg, pydantic.BaseModel)]
        if typing.get_origin(args[0]) is typing.Union:
            models = list(typing.get_args(args[0]))
        if models:
            for member in models:
                paths |= leaf_paths(member, (*prefix, name))
        else:
            paths.add((*prefix, name))
    return paths


def test_every_leaf_has_an_option():
    for root, model in (("run", RunConfig), ("peer", PeerConfig)):
        reached = {option.path for option in PEER_OPTIONS.options if option.root == root}
        missing = leaf_paths(model) - reached
        assert not missing, f"{model.__name__} fields without a flag: {sorted(missing)}"


def _candidates(option: Option) -> list:
    default = option.default if not option.required else None
    if option.choices is not None or typing.get_origin(option.annotation) is typing.Literal:
        choices = option.choices or tuple(typing.get_args(option.annotation))
        return [choice for choice in choices if choice != default]
    if option.shape == "bool":
        return [not default]
    if option.shape == "list":
        return [[MADDR]]
    if option.shape == "table":
        return [{"k": 3, "name": "x"}]
    if option.annotation is int:
        return [(default or 0) + 1, 2, 3]
    if option.annotation is float:
        return [value for value in ((default or 0) / 2, (default or 0) * 2, 0.5, 2.0, 5.0) if value]
    return ["fp16", "mean", "127.0.0.2", "other-run", "some/where", "cpu"]


def _given(option: Option, value, origin: str) -> dict[Option, Given]:
    given = {PEER_OPTIONS.by_key("run-id"): Given("r", "--run-id")}
    if option.member is not None:
        tag = next(o for o in PEER_OPTIONS.options if o.path == (*option.member.union, option.member.tag_field))
        given[tag] = Given(option.member.tag, tag.flag)
    for key, companion in COMPANIONS.get(option.path[0], {}).items():
        if key != option.key and not (key == "privacy-noise" and option.key == "target-epsilon"):
            given[PEER_OPTIONS.by_key(key)] = Given(companion, key)
    if option.member is not None and option.member.tag == "gossip" and option.member.union == ("averaging",):
        given[PEER_OPTIONS.by_key("strategy")] = Given("gossip", "--strategy")  # diloco does not gossip
    if option.key == "target-epsilon":
        given[PEER_OPTIONS.by_key("expected-releases")] = Given(100, "expected-releases")
    given[option] = Given(value, origin)
    return given


def _value_at(models: dict, option: Option):
    value = models[option.root]
    for part in option.path:
        value = value[part] if isinstance(value, dict) else getattr(value, part)
    return value


def _sample(option: Option):
    """A value other than the default that the models take for ``option``, and the models it gives."""
    for value in _candidates(option):
        try:
            return value, PEER_OPTIONS.build(_given(option, value, option.flag))
        except ConfigError:
            continue
    raise AssertionError(f"no valid sample value for {option.flag}")


def _as_text(value) -> str:
    if isinstance(value, dict):
        return ",".join(f"{key}={item}" for key, item in value.items())
    if isinstance(value, list):
        return ",".join(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


@pytest.mark.parametrize("option", PEER_OPTIONS.options, ids=lambda option: option.key)
def test_flag_variable_and_file_key_reach_the_field(option, tmp_path):
    value, expected = _sample(option)
    assert _value_at(expected, option) != (None if option.required else option.default)
    others = {o: g for o, g in _given(option, value, "x").items() if o is not option}
    # the environment variable
    environ = {option.env: _as_text(value)}
    from_env = load_config(PEER_OPTIONS, flags=others, environ=environ)
    assert _value_at(from_env, option) == _value_at(expected, option)
    # the file key
    path = tmp_path / "peer.toml"
    path.write_text(f"{option.key} = {toml_value(value)}\n")
    from_file = load_config(PEER_OPTIONS, flags=others, config_file=path, environ={})
    assert _value_at(from_file, option) == _value_at(expected, option)
    # the flag, through the CLI
    args = ["peer", "--print-config", "--json"]
    for other, given in others.items():
        args += [other.flag, _as_text(given.value)] if other.shape != "bool" else [other.flag]
    if option.argument is not None:
        args.insert(1, _as_text(value))
    elif option.shape == "bool":
        args.append(option.flag if value else f"--no-{option.flag_name}")
    else:
        texts = value if option.shape in ("list", "table") and isinstance(value, list) else [_as_text(value)]
        for text in texts:
            args += [option.flag, text]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)[option.key]
    assert printed == pydantic.TypeAdapter(typing.Any).dump_python(_value_at(expected, option), mode="json")


def test_help_explains_every_option():
    command = typer.main.get_command(app).commands["peer"]
    helps = {param.name: getattr(param, "help", None) for param in command.params}
    for option in PEER_OPTIONS.options:
        assert helps.get(option.key.replace("-", "_")), f"{option.flag} has no help"
    result = CliRunner().invoke(app, ["peer", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for option in PEER_OPTIONS.options:
        assert (option.argument or option.flag) in result.stdout, option.flag


def _non_defaults() -> dict[Option, Given]:
    """A value other than the default in every section (run and peer), one union member each."""
    keys = {"task": "digits", "task-options": {"context": 256}, "strategy": "sync", "target-batch-size": 512,
            "averaging": "moshpit", "group-size": 4, "compression": "fp16", "aggregator": "trimmed-mean",
            "privacy-clip": 1.0, "privacy-noise": 0.5, "privacy-level": "sample", "hparams": {"optimizer": "sgd"},
            "lr": 0.01, "seed": 3, "run-id": "r", "create": True, "initial-peers": [MADDR], "port": 4000,
            "trusted-network": True, "wait-peers": 2, "shard": 1, "num-shards": 2, "threads": 2, "slowdown": 2.0,
            "eval-every": 2.5, "final-eval": False, "max-seconds": 60.0, "checkpoint-dir": "ckpt",
            "metrics-port": 0, "ban-threshold": 5.0, "presence-refresh": 2.0}
    return {PEER_OPTIONS.by_key(key): Given(value, key) for key, value in keys.items()}


@pytest.mark.parametrize("form", ["toml", "json"])
def test_print_config_round_trips(tmp_path, form):
    models = PEER_OPTIONS.build(_non_defaults())
    path = tmp_path / "peer.toml"
    path.write_text(render_toml(PEER_OPTIONS, models))
    printed = CliRunner().invoke(app, ["peer", "--config", str(path), "--print-config",
                                       *(["--json"] if form == "json" else [])])
    assert printed.exit_code == 0, printed.output
    path = tmp_path / f"printed.{form}"
    path.write_text(printed.stdout)
    again = load_config(PEER_OPTIONS, flags={}, config_file=path, environ={})
    assert again["run"] == models["run"] and again["peer"] == models["peer"]
    assert again["run"].explicit() == models["run"].explicit()  # unset stays unset: a joiner takes the run's
    assert "inner_steps" not in again["run"].strategy.model_fields_set


@pytest.mark.parametrize("how", ["flag", "env", "file"])
def test_a_wrong_value_is_one_line_naming_its_source(tmp_path, how):
    env, args = {}, ["peer", "digits", "-r", "r", "--print-config"]
    if how == "flag":
        args += ["--wait-peers", "0"]
        where = "--wait-peers: "
    elif how == "env":
        env = {"SWARMGRAD_WAIT_PEERS": "0"}
        where = "environment variable SWARMGRAD_WAIT_PEERS: "
    else:
        path = tmp_path / "peer.toml"
        path.write_text("wait-peers = 0\n")
        args += ["--config", str(path)]
        where = f"{path}: key 'wait-peers': "
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 2 and "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    got = "0" if how == "file" else "'0'"  # a file's number, a flag's or a variable's text
    assert lines == [f"error: {where}Input should be greater than or equal to 1 (got {got})"]


def test_task_options_reach_the_run_config():
    result = CliRunner().invoke(app, ["peer", "digits", "-r", "r", "--task-option", "context=256",
                                      "--task-option", "name=x", "--print-config", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["task-options"] == {"context": 256, "name": "x"}
    config = PEER_OPTIONS.build_model("run", {PEER_OPTIONS.by_key("task-options"): Given({"context": 256}, "f")})
    assert config.task_options == {"context": 256} and config.explicit() == {"task_options.context": 256}
