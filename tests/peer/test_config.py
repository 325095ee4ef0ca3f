"""Options of `swarmgrad peer` and `swarmgrad bootstrap` (flags, SWARMGRAD_* variables, --config files,
defaults), how they become the run's RunConfig, and the manifest round trip. No network, no Peer."""

from __future__ import annotations

import json

import pytest
import tomllib
import torch
import typer
from typer.testing import CliRunner

from swarmgrad.averaging.privacy import Privacy
from swarmgrad.averaging.rules import RULE_NAMES
from swarmgrad.cli import app
from swarmgrad.demo import DemoSettings, peer_command
from swarmgrad.errors import ConfigError, StartupError
from swarmgrad.peer.config import RunConfig, RunConfigMismatch
from swarmgrad.peer.config_file import load_config
from swarmgrad.peer.manifest import RunManifest, settle_run
from swarmgrad.peer.options import PEER_OPTIONS, Given
from swarmgrad.peer.strategies.diloco import DiLoCo
from swarmgrad.peer.strategies.sync import SyncSGD

MADDR = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWBrZfzJTLVMLC2mAwJPYFneSwyEVB9XZCPHPrnet727Ah"
OTHER = "/ip4/127.0.0.1/tcp/4002/p2p/12D3KooWBrZfzJTLVMLC2mAwJPYFneSwyEVB9XZCPHPrnet727Ah"


@pytest.fixture(autouse=True)
def no_swarmgrad_environment(monkeypatch):
    """The tests set the SWARMGRAD_* variables they mean; none leak in from the caller's shell."""
    import os

    for name in [name for name in os.environ if name.startswith("SWARMGRAD_")]:
        monkeypatch.delenv(name)


def cli(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, list(args), env=env)


def printed(*args: str, env: dict[str, str] | None = None) -> dict:
    """`swarmgrad ... --print-config --json` as a dict keyed like the file."""
    result = cli(*args, "--print-config", "--json", env=env)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def run_config_from(values: dict, task: str | None = None) -> RunConfig:
    """A RunConfig from run options given by name, as `swarmgrad peer` reads them."""
    given = {PEER_OPTIONS.by_key(name.replace("_", "-")): Given(value, name) for name, value in values.items()}
    if task is not None:
        given[PEER_OPTIONS.by_key("task")] = Given(task, "TASK")
    return PEER_OPTIONS.build_model("run", given)


def one_error(result) -> str:
    """The single `error: ...` line of a command that failed with exit code 2."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


# -- precedence ---------------------------------------------------------------------------------


@pytest.mark.parametrize("key, values", [
    ("inner-steps", ("7", "8", "9")),  # run-level: no default of its own (None: RunConfig's or the run's)
    ("eval-every", ("2.5", "3.5", "4.5")),  # local, with a default in PeerConfig
    ("initial-peers", (MADDR, OTHER, f"{MADDR},{OTHER}")),  # a list, comma separated in a variable
])
def test_flag_over_environment_over_file_over_default(tmp_path, key, values):
    name = key.replace("-", "_")
    option = PEER_OPTIONS.by_key(key)
    in_file, in_env, on_flag = values
    as_toml = f"[{json.dumps(in_file)}]" if name == "initial_peers" else in_file
    config = tmp_path / "peer.toml"
    config.write_text(f'run-id = "from-file"\n{key} = {as_toml}\n')
    base = ("peer", "digits")

    def value(*args, env=None):
        return printed(*base, *args, env=env)[key]

    assert value("--run-id", "r") == (None if option.root == "run" else option.default)
    from_file = value("--config", str(config))
    assert from_file == ([in_file] if name == "initial_peers" else json.loads(in_file))
    env = {option.env: in_env}
    from_env = value("--config", str(config), env=env)
    assert from_env == ([in_env] if name == "initial_peers" else json.loads(in_env))
    from_flag = value("--config", str(config), f"--{key}", on_flag, env=env)
    assert from_flag == (on_flag.split(",") if name == "initial_peers" else json.loads(on_flag))


def test_run_id_and_booleans_follow_the_same_order(tmp_path):
    config = tmp_path / "peer.toml"
    config.write_text('run-id = "from-file"\ncreate = true\nclient_mode = true\n')
    merged = printed("peer", "--config", str(config))
    assert (merged["run-id"], merged["create"], merged["client-mode"]) == ("from-file", True, True)
    # a boolean flag left out is a default, not a "false" that would override the file
    assert printed("peer", "--config", str(config), env={"SWARMGRAD_RUN_ID": "from-env"})["run-id"] == "from-env"
    assert printed("peer", "--config", str(config), "--run-id", "from-flag",
                   env={"SWARMGRAD_RUN_ID": "from-env", "SWARMGRAD_CREATE": "false"})["create"] is False


def test_environment_lists_are_comma_or_space_separated():
    merged = printed("peer", "-r", "r", env={"SWARMGRAD_INITIAL_PEERS": f"{MADDR}, {OTHER}"})
    assert merged["initial-peers"] == [MADDR, OTHER]
    assert printed("peer", "-r", "r", env={"SWARMGRAD_ANNOUNCE": ""})["announce"] == []  # empty: unset


def test_file_keys_take_dashes_or_underscores(tmp_path):
    config = tmp_path / "peer.toml"
    config.write_text('run_id = "r"\ninner_steps = 5\ntarget-accuracy = 0.5\n')
    merged = printed("peer", "--config", str(config))
    assert (merged["run-id"], merged["inner-steps"], merged["target-accuracy"]) == ("r", 5, 0.5)
    config.write_text('run-id = "r"\ninner-steps = 5\ninner_steps = 6\n')
    assert one_error(cli("peer", "--config", str(config))) == \
        f"error: {config}: key 'inner_steps': given twice (also as 'inner-steps')"


# -- errors name the key and where it came from -------------------------------------------------


def test_unknown_key_names_the_key_and_the_file(tmp_path):
    config = tmp_path / "peer.toml"
    config.write_text('run-id = "r"\ninner-stepz = 5\n')
    assert one_error(cli("peer", "--config", str(config))) == \
        f"error: {config}: key 'inner-stepz': not an option of swarmgrad peer (did you mean 'inner-steps'?)"
    config.write_text("json = true\n")  # output flags are not options
    assert one_error(cli("peer", "--config", str(config))).startswith(f"error: {config}: key 'json': not an option")
    config.write_text("[strategy]\nname = 'sync'\n")  # flat: no tables
    assert one_error(cli("peer", "--config", str(config), "-r", "r")).startswith(f"error: {config}: key 'strategy': ")


@pytest.mark.parametrize("line, problem", [
    ('inner-steps = "many"', "Input should be a valid integer, unable to parse string as an integer (got 'many')"),
    ("max-seconds = [1]", "Input should be a valid number"),
    ("inner-steps = 0", "Input should be greater than or equal to 1 (got 0)"),  # RunConfig's bound
    ('compression = "zip"', "unknown codec 'zip'"),
    ('aggregator = "krum"', f"aggregator must be one of {', '.join(RULE_NAMES)} for moshpit averaging, got 'krum'"),
    ('run-id = "no spaces"', "run id 'no spaces' is invalid"),
    ("port = 70000", "Input should be less than or equal to 65535 (got 70000)"),  # NodeConfig's bound
])
def test_wrong_type_or_value_names_the_key_and_the_file(tmp_path, line, problem):
    config = tmp_path / "peer.toml"
    config.write_text(f'run-id = "r"\n{line}\n' if "run-id" not in line else f"{line}\n")
    key = line.split(" =")[0]
    error = one_error(cli("peer", "digits", "--config", str(config)))
    assert error.startswith(f"error: {config}: key '{key}': ") and problem in error, error


def test_a_bad_environment_variable_names_the_variable():
    error = one_error(cli("peer", "digits", "-r", "r", "--print-config", env={"SWARMGRAD_INNER_STEPS": "many"}))
    assert error.startswith("error: environment variable SWARMGRAD_INNER_STEPS: Input should be a valid integer")
    error = one_error(cli("peer", "digits", "-r", "r", "--print-config", env={"SWARMGRAD_STRATEGY": "adam"}))
    assert error == "error: environment variable SWARMGRAD_STRATEGY: must be one of 'diloco', 'gossip', 'sync' " \
                    "(got 'adam')"


def test_flags_and_settings_that_do_not_fit_together_are_one_line():
    assert one_error(cli("peer", "digits", "--print-config")) == \
        "error: --run-id is required: pass --run-id, set SWARMGRAD_RUN_ID, or put run-id = ... in the --config file"
    assert one_error(cli("peer", "digits", "-r", "r", "--target-batch-size", "64")) == \
        "error: --target-batch-size: a setting of strategy sync, but the strategy is diloco (the default)"
    assert one_error(cli("peer", "digits", "-r", "r", "--strategy", "gossip", "--group-size", "4")) == \
        "error: --group-size: a setting of averaging moshpit, but the averaging is gossip (the default for strategy gossip)"
    assert one_error(cli("peer", "digits", "-r", "r", "--strategy", "sync", "--averaging", "gossip")) == \
        "error: --averaging: strategy sync does not work with gossip averaging; use moshpit"
    assert one_error(cli("peer", "digits", "-r", "r", "--privacy-clip", "1")) == \
        "error: --privacy-clip: set --privacy-noise or --target-epsilon (with --expected-releases)"
    assert one_error(cli("peer", "digits", "-r", "r", "--privacy-noise", "1")) == \
        "error: --privacy-noise: needs --privacy-clip too"
    assert one_error(cli("peer", "digits", "-r", "r", "--strategy", "gossip", "--aggregator", "trimmed-mean")) == \
        "error: --aggregator: aggregator must be one of centered-clip, mean for gossip averaging, got 'trimmed-mean' " \
        "(it needs a group: gossip has none)"
    assert one_error(cli("peer", "digits", "-r", "r", "--target-accuracy", "0.9", "--eval-every", "0")) == \
        "error: --target-accuracy needs evaluations: set --eval-every > 0"


def test_no_initial_peers_and_no_create_is_one_line():
    error = one_error(cli("peer", "digits", "--run-id", "lonely"))
    assert "--initial-peers" in error and "--create" in error, error


# -- --print-config -----------------------------------------------------------------------------


def test_print_config_reads_back_the_same(tmp_path):
    args = ("peer", "digits", "--run-id", "r", "-p", f"{MADDR},{OTHER}", "--create", "--strategy", "sync",
            "--target-batch-size", "512", "--privacy-clip", "1", "--privacy-noise", "0.5", "--lr", "0.01",
            "--max-seconds", "12.5", "--identity", str(tmp_path / "my key"), "--announce", MADDR)
    env = {"SWARMGRAD_SEED": "3", "SWARMGRAD_WAIT_PEERS": "2"}
    first = cli(*args, "--print-config", env=env)
    assert first.exit_code == 0, first.output
    parsed = tomllib.loads(first.stdout)
    assert parsed["initial-peers"] == [MADDR, OTHER] and parsed["seed"] == 3 and parsed["create"] is True
    assert "inner-steps" not in parsed  # unset stays unset: a joiner still takes the run's value
    saved = tmp_path / "saved.toml"
    saved.write_text(first.stdout)
    again = cli("peer", "--config", str(saved), "--print-config")
    assert again.exit_code == 0, again.output
    assert again.stdout == first.stdout
    assert printed("peer", "--config", str(saved)) == printed(*args, env=env)


def test_bootstrap_reads_the_same_kind_of_file(tmp_path):
    config = tmp_path / "boot.toml"
    config.write_text(f'port = 31337\nrun-id = "r"\ninitial-peers = "{MADDR}"\n')
    merged = printed("bootstrap", "--config", str(config), env={"SWARMGRAD_HOST": "0.0.0.0"})
    assert (merged["port"], merged["run-id"], merged["initial-peers"], merged["host"]) == \
        (31337, "r", [MADDR], "0.0.0.0")
    assert printed("bootstrap", "--config", str(config), "--port", "4000")["port"] == 4000
    toml = cli("bootstrap", "--config", str(config), "--print-config")
    assert toml.exit_code == 0 and tomllib.loads(toml.stdout) == {"port": 31337, "run-id": "r", "initial-peers": [MADDR]}
    config.write_text("inner-steps = 5\n")
    assert one_error(cli("bootstrap", "--config", str(config))).startswith(
        f"error: {config}: key 'inner-steps': not an option of swarmgrad bootstrap")


# -- defaults come from RunConfig ---------------------------------------------------------------


def test_run_defaults_are_run_configs():
    defaults = RunConfig()
    assert run_config_from({}) == defaults and run_config_from({}).explicit() == {}
    private = run_config_from({"privacy_clip": 1.0, "privacy_noise": 0.5})
    assert private.privacy.level == Privacy.model_fields["level"].default
    # what --print-config shows for unset run settings is RunConfig's
    shown = cli("peer", "digits", "-r", "r", "--print-config").stdout
    for key, value in (("inner-steps", defaults.strategy.inner_steps), ("compression", defaults.compression),
                       ("seed", defaults.seed), ("group-size", defaults.averaging.group_size)):
        assert f"# {key} = {json.dumps(value)}" in shown, key
    # and so do the help texts
    command = typer.main.get_command(app).commands["peer"]
    helps = {param.name: param.help for param in command.params}
    assert f"default {defaults.strategy.inner_steps}" in helps["inner_steps"]
    assert f"default {defaults.compression}" in helps["compression"]
    assert f"default {defaults.aggregator}" in helps["aggregator"]
    assert f"default {defaults.averaging.group_size}" in helps["group_size"]
    assert f"default {SyncSGD().target_batch_size}" in helps["target_batch_size"]
    assert f"default {Privacy.model_fields['level'].default}" in helps["privacy_level"]


def test_chosen_options_are_the_explicit_settings():
    chosen = run_config_from({"inner_steps": 20, "group_size": 4, "lr": 0.01})
    assert chosen.explicit() == {"strategy.name": "diloco", "strategy.inner_steps": 20, "averaging.kind": "moshpit",
                                 "averaging.group_size": 4, "hparams.lr": 0.01}
    assert chosen.strategy == DiLoCo(inner_steps=20)
    config = run_config_from({"strategy": "sync", "target_batch_size": 512, "compression": "fp16", "seed": 3})
    assert config.explicit() == {"strategy.name": "sync", "strategy.target_batch_size": 512, "compression": "fp16",
                                 "seed": 3}


def _demo_file(tmp_path, settings: DemoSettings, index: int) -> dict:
    command = peer_command(settings, index, [MADDR], tmp_path)
    assert command[command.index("peer") + 1:] == ["--config", command[command.index("--config") + 1], "--json"]
    return tomllib.loads((tmp_path / f"peer-{index}.toml").read_text())


def test_demo_passes_only_what_it_chooses(tmp_path):
    written = _demo_file(tmp_path, DemoSettings(), 0)
    assert not {"averaging", "compression"} & set(written)  # a strategy's setting names its strategy
    if RunConfig().strategy.name == "diloco":  # the demo's own inner steps (see DemoSettings)
        assert written["inner-steps"] == DemoSettings.inner_steps
    assert (written["shard"], written["num-shards"], written["target-accuracy"]) == (0, 4, DemoSettings.target_accuracy)
    config = DemoSettings().run_config()
    assert (config.compression, config.averaging) == (RunConfig().compression, RunConfig().averaging)
    assert "inner-steps" not in _demo_file(tmp_path, DemoSettings(strategy="sync"), 1)
    assert _demo_file(tmp_path, DemoSettings(compression="fp16"), 0)["compression"] == "fp16"
    other = _demo_file(tmp_path, DemoSettings(), 1)
    assert (other["eval-every"], other["final-eval"]) == (0, False) and "target-accuracy" not in other
    # what the child reads back is what the demo meant
    loaded = load_config(PEER_OPTIONS, flags={}, config_file=tmp_path / "peer-1.toml", environ={})
    assert loaded["run"] == DemoSettings().run_config() and loaded["peer"].data.shard == 1


# -- the manifest -------------------------------------------------------------------------------


def test_manifest_round_trip():
    config = run_config_from({"inner_steps": 20, "compression": "fp16", "aggregator": "trimmed-mean",
                              "privacy_clip": 1.0, "privacy_noise": 0.5}, task="digits")
    manifest = RunManifest.create(config, "fingerprint")
    assert manifest.run_config().aggregator == "trimmed-mean"
    assert (manifest.task, manifest.settings, manifest.data_fingerprint) == \
        ("digits", config.settings_json(), "fingerprint")
    assert manifest.run_config() == config
    assert manifest.run_config().digest == config.digest
    with pytest.raises(ConfigError, match="task"):
        RunManifest.create(RunConfig(), None)


@pytest.mark.parametrize("settings", ['{"strategy": {"name": "adam"}}', '{"compression": "zip"}',
                                      '{"aggregator": "krum"}', '{"surprise": 1}', "not json", "[1]"])
def test_bad_manifest_settings_are_config_errors(settings):
    manifest = RunManifest.create(RunConfig(task="digits"), None).model_copy(update={"settings": settings})
    with pytest.raises(ConfigError):
        manifest.run_config()


def test_a_conflicting_flag_names_each_field_and_both_values():
    run = RunManifest.create(RunConfig(task="digits"), None)
    mine = run_config_from({"strategy": "sync"}, task="digits")
    with pytest.raises(RunConfigMismatch) as raised:
        settle_run("r", mine, run, create=False, fingerprint=lambda task: None)
    assert "strategy.name: 'sync' here, 'diloco' in the run" in str(raised.value)
    mine = run_config_from({"inner_steps": 20, "compression": "fp16"})
    with pytest.raises(RunConfigMismatch) as raised:
        settle_run("r", mine, run, create=False, fingerprint=lambda task: None)
    message = str(raised.value)
    assert f"strategy.inner_steps: 20 here, {RunConfig().strategy.inner_steps} in the run" in message
    assert f"compression: 'fp16' here, {RunConfig().compression!r} in the run" in message
    # settings that agree, or are left out, join: the run's settings and task
    agreed, manifest = settle_run("r", run_config_from({"strategy": "diloco"}), run, create=False,
                                  fingerprint=lambda task: None)
    assert agreed == run.run_config() and agreed.task == "digits" and manifest is run


def test_creating_a_run():
    mine = run_config_from({"inner_steps": 20}, task="digits")
    config, manifest = settle_run("r", mine, None, create=True, fingerprint=lambda task: "fp")
    assert config == mine and manifest.run_config() == mine and manifest.data_fingerprint == "fp"
    same, kept = settle_run("r", mine, manifest, create=True, fingerprint=lambda task: "fp")
    assert kept is manifest  # the run exists with these settings: keep publishing the first manifest
    with pytest.raises(StartupError, match="already exists"):
        settle_run("r", run_config_from({"inner_steps": 30}, task="digits"), manifest, create=True,
                   fingerprint=lambda task: "fp")
    with pytest.raises(ConfigError, match="TASK"):
        settle_run("r", run_config_from({}), None, create=True, fingerprint=lambda task: None)


@pytest.mark.parametrize("privacy", [{"privacy_noise": 1.0}, {"target_epsilon": 3.0,
                                                              "expected_releases": 1000}])
def test_sample_level_privacy_survives_the_manifest(privacy):
    """A joiner (and a peer resumed without --create) trains with the run's settings as the manifest
    carried them: the sample rate is each peer's own (batch/shard), never a value the run fixes."""
    from swarmgrad.averaging.privacy import make_per_sample_private

    creator = run_config_from({"privacy_clip": 1.0, "privacy_level": "sample", **privacy}, task="fashion-mnist")
    manifest = RunManifest.create(creator, None)
    assert json.loads(manifest.settings)["privacy"]["sample_rate"] is None
    joined, _ = settle_run("r", run_config_from({}), manifest, create=False, fingerprint=lambda task: None)
    assert joined.privacy == creator.privacy and joined.digest == creator.digest
    for config, shard in ((creator, 15000), (joined, 7500)):  # peers' shards differ: so do their sample rates
        private = make_per_sample_private(torch.nn.Linear(3, 2), config.privacy, batch_size=64, dataset_size=shard)
        assert private.privacy.sample_rate == 64 / shard
        assert private.noise_multiplier > 0


def test_join_hint_is_one_command_line():
    from swarmgrad.commands.peer import join_hint

    assert join_hint("r", [MADDR, OTHER]) == f"others join with: swarmgrad peer --run-id r --initial-peers {MADDR},{OTHER}"


def test_load_config_without_the_cli(tmp_path):
    config = tmp_path / "peer.toml"
    config.write_text('run-id = "r"\ninner-steps = 5\n')
    flags = {PEER_OPTIONS.by_key("lr"): Given("0.1", "--lr")}
    loaded = load_config(PEER_OPTIONS, flags=flags, config_file=config, environ={"SWARMGRAD_SEED": "4"})
    run = loaded["run"]
    assert (run.strategy.inner_steps, run.hparams["lr"], run.seed, loaded["peer"].run_id) == (5, 0.1, 4, "r")
    config.write_text('run-id = "r"\ninner-steps = 0\n')
    with pytest.raises(ConfigError, match=f"^{config}: key 'inner-steps': "):
        load_config(PEER_OPTIONS, flags={}, config_file=config, environ={})


def test_eval_batches_is_a_positive_count():
    assert printed("peer", "digits", "-r", "r", "--eval-batches", "3")["eval-batches"] == 3
    assert printed("peer", "digits", "-r", "r")["eval-batches"] is None  # the whole held-out set
    assert "--eval-batches" in one_error(cli("peer", "digits", "-r", "r", "--eval-batches", "0"))
