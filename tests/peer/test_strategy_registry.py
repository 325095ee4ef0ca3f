"""The strategy registry: every strategy module feeds RunConfig's union, its averaging check and
make_policy; a new strategy is one module (shown with a fake one dropped into the package)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest
from peer_fakes import FakeTracker, model_and_optimizer

from swarmgrad.errors import ConfigError
from swarmgrad.peer.config import RunConfig
from swarmgrad.peer.options import PEER_OPTIONS
from swarmgrad.peer.strategies.base import Policy
from swarmgrad.peer.strategies.registry import STRATEGIES, make_policy

AVERAGING_KINDS = ("moshpit", "gossip")


def test_every_strategy_module_is_in_the_run_configs_union():
    union = typing.get_args(RunConfig.model_fields["strategy"].annotation)
    assert set(union) == set(STRATEGIES.values()) and {"diloco", "sync", "gossip"} <= set(STRATEGIES)
    assert all(settings.model_fields["name"].default == name for name, settings in STRATEGIES.items())
    assert RunConfig.model_fields["strategy"].description == f"How peers train together: {', '.join(STRATEGIES)}."


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_each_strategy_validates_picks_its_averaging_and_makes_its_policy(name):
    settings = STRATEGIES[name]
    config = RunConfig(strategy={"name": name})
    assert type(config.strategy) is settings and config.averaging.kind == settings.averagings[0]
    for kind in AVERAGING_KINDS:
        if kind in settings.averagings:
            config = RunConfig(strategy={"name": name}, averaging={"kind": kind})
            policy = make_policy(config, *model_and_optimizer(), FakeTracker())
            assert isinstance(policy, Policy) and policy.settings is config.strategy
            assert policy.synchronous == (kind != "gossip")
        else:
            with pytest.raises(ConfigError, match=f"strategy {name} does not work with {kind} averaging; use "):
                RunConfig(strategy={"name": name}, averaging={"kind": kind})


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_setting_has_its_help_text(name):
    """Each field's description is its flag's help, which names the strategy it belongs to."""
    options = [option for option in PEER_OPTIONS.options if option.member is not None
               and option.member.union == ("strategy",) and option.member.tag == name]
    assert {option.path[-1] for option in options} == set(STRATEGIES[name].model_fields) - {"name"}
    for option in options:
        assert STRATEGIES[name].model_fields[option.path[-1]].description, option.flag
        assert option.help.startswith(f"{name}: "), option.help


def test_the_run_configuration_loads_without_torch():
    code = "import sys, swarmgrad.peer.config; print('torch' in sys.modules, 'hivemind' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"]


FAKE_STRATEGY = '''
"""Parameter averaging after every step: a strategy written as one module."""

from __future__ import annotations

from typing import ClassVar, Literal

import pydantic

from swarmgrad.peer.strategies.base import Policy, StrategySettings


class EveryStep(StrategySettings):
    """Average the parameters after every ``every`` local steps."""

    averagings: ClassVar[tuple[str, ...]] = ("moshpit",)

    name: Literal["every-step"] = "every-step"
    every: int = pydantic.Field(1, ge=1, description="Local steps between rounds.")

    def make_policy(self, model, optimizer, progress, synchronous):
        return EveryStepPolicy(self, model, optimizer, progress, synchronous=synchronous)


class EveryStepPolicy(Policy):
    name = "every-step"
    averages = "params"

    def __init__(self, settings, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.settings = settings

    def after_backward(self, batch_size):
        self.optimizer.step()
        self.progress.add(batch_size)
        return self.epoch_due(steps=self.settings.every)

    def prepare(self):
        self.copy_params_into(self.contribution)

    def apply(self, average):
        self.copy_into_params(average)
'''

CHECK_FAKE = '''
import sys

import swarmgrad.peer.strategies as package

package.__path__.append(sys.argv[1])  # as if every_step.py were in the package

import torch

from peer_fakes import FakeTracker, model_and_optimizer
from swarmgrad.errors import ConfigError
from swarmgrad.peer.config import RunConfig, run_config
from swarmgrad.peer.strategies.registry import make_policy

config = run_config(strategy={"name": "every-step", "every": 2})
assert config.averaging.kind == "moshpit" and "every-step" in RunConfig.model_fields["strategy"].description
try:
    RunConfig(strategy={"name": "every-step"}, averaging={"kind": "gossip"})
    raise SystemExit("gossip averaging was accepted")
except ConfigError as error:
    assert "does not work with gossip averaging; use moshpit" in str(error), error
model, optimizer = model_and_optimizer()
policy = make_policy(config, model, optimizer, FakeTracker())
model(torch.ones(1, 4)).sum().backward()
assert not policy.after_backward(batch_size=1)
model(torch.ones(1, 4)).sum().backward()
assert policy.after_backward(batch_size=1)  # due after `every` steps
policy.prepare()
policy.apply(torch.zeros_like(policy.contribution))
assert all(not param.any() for param in model.parameters())
print(type(policy).__name__, config.digest)
'''


def test_a_new_strategy_is_one_module(tmp_path: Path):
    (tmp_path / "every_step.py").write_text(FAKE_STRATEGY)
    tests = Path(__file__).parents[1]  # peer_fakes.py
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(CHECK_FAKE), str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env=_with_path(tests), check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == "EveryStepPolicy"


def _with_path(directory: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(directory), env.get("PYTHONPATH")]))
    return env
