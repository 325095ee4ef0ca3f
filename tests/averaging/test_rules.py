"""The aggregation rules' registry (averaging/rules/__init__.py): every module there is a rule under
its own name, and the names load without torch (the CLI's help and the run configuration read them)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from swarmgrad.averaging.rules import RULE_NAMES, UnknownRule, get_rule
from swarmgrad.averaging.rules.base import Rule


def test_every_rule_module_holds_its_rule():
    assert {"mean", "centered-clip", "trimmed-mean"} <= set(RULE_NAMES)
    for name in RULE_NAMES:
        rule = get_rule(name)
        assert isinstance(rule, Rule) and rule.name == name
    assert [name for name in RULE_NAMES if get_rule(name).streams] == ["mean"]  # the owner keeps no rows for it


@pytest.mark.parametrize("name", ["krum", "base", "", "Mean", "centered_clip", None, ["mean"]])
def test_an_unknown_name_is_refused_with_the_names_there_are(name):
    with pytest.raises(UnknownRule, match=f"use one of {', '.join(RULE_NAMES)}$"):
        get_rule(name)


def test_the_names_and_the_run_configuration_load_without_torch():
    script = textwrap.dedent("""
        import sys
        from swarmgrad.averaging.rules import RULE_NAMES
        from swarmgrad.peer.config import RunConfig
        assert RunConfig(aggregator="trimmed-mean").aggregator == "trimmed-mean" and "mean" in RULE_NAMES
        assert "torch" not in sys.modules, "torch was imported"
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
