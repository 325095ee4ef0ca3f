"""What a demo swarm is: how many peers, which task, which run settings it chooses, how long.
Light to import (the CLI reads its defaults for --help)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmgrad.commands.run_options import run_config_from, run_flags
from swarmgrad.peer.config import RunConfig


@dataclass(frozen=True)
class DemoSettings:
    peers: int = 4
    run_id: str = "demo"
    task: str = "fashion-mnist"
    # run settings: None leaves one to RunConfig's default (and the demo passes no flag for it)
    strategy: str | None = None
    averaging: str | None = None
    compression: str | None = None
    # diloco only, and on purpose not the run default: the shipped demo (4 peers sharing one small
    # machine, Fashion-MNIST to 88% within 3 minutes: tests/test_cli.py) was tuned with 100 local
    # steps per round; fewer, longer rounds spend less of the shared cores on matchmaking
    inner_steps: int = 100
    target_accuracy: float = 0.88
    max_seconds: float = 150.0
    eval_every: float = 2.0
    plot: Path = Path("swarmgrad-demo.png")

    def run_options(self) -> dict[str, Any]:
        """The run settings the demo chooses, by option name: the only run flags its peers get."""
        chosen: dict[str, Any] = {"strategy": self.strategy, "averaging": self.averaging,
                                  "compression": self.compression}
        if run_config_from(chosen).strategy.name == "diloco":
            chosen["inner_steps"] = self.inner_steps
        return {name: value for name, value in chosen.items() if value is not None}

    def run_config(self) -> RunConfig:
        """What the demo's swarm trains with."""
        return run_config_from(self.run_options(), task=self.task)


def peer_command(settings: DemoSettings, index: int, initial_peers: list[str]) -> list[str]:
    command = [
        sys.executable, "-m", "swarmgrad.cli", "peer", settings.task, "--run-id", settings.run_id,
        "--initial-peers", ",".join(initial_peers), "--shard", str(index), "--num-shards", str(settings.peers),
        "--threads", "1", "--json", *run_flags(settings.run_options()), "--max-seconds", str(settings.max_seconds),
        "--wait-peers", str(settings.peers), "--wait", "60",
    ]
    if index == 0:  # one peer evaluates: after a swarm step every peer holds the same model
        command += ["--eval-every", str(settings.eval_every), "--target-accuracy", str(settings.target_accuracy)]
    else:
        command += ["--eval-every", "0", "--no-final-eval"]
    return command
