"""What a demo swarm is: how many peers, which task, which run settings it chooses, how long.
Light to import (the CLI reads its defaults for --help)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmgrad.dht.config import NodeConfig
from swarmgrad.peer.config import RunConfig
from swarmgrad.peer.config_file import write_peer_config
from swarmgrad.peer.options import PEER_OPTIONS, Given
from swarmgrad.peer.peer_config import Compute, Connection, Data, Evaluation, PeerConfig, Stop

# what a task's demo sets beyond fashion-mnist's: lm's own defaults (context 256, 100 local steps
# per round) would leave 4 peers on 2 shared cores minutes from their first round
TASK_OPTIONS: dict[str, dict[str, Any]] = {"lm": {"size": "tiny", "context": 64}}
TASK_INNER_STEPS: dict[str, int] = {"lm": 20}


@dataclass(frozen=True)
class DemoSettings:
    peers: int = 4
    run_id: str = "demo"
    task: str = "fashion-mnist"
    # run settings: None leaves one to RunConfig's default (and unset in the peers' config files)
    strategy: str | None = None
    averaging: str | None = None
    compression: str | None = None
    # diloco only, and on purpose not the run default: the shipped demo (4 peers sharing one small
    # machine, Fashion-MNIST to 88% within 3 minutes: tests/commands/test_cli.py) was tuned with 100 local
    # steps per round; fewer, longer rounds spend less of the shared cores on matchmaking
    inner_steps: int = 100
    target_accuracy: float = 0.88
    max_seconds: float = 150.0
    eval_every: float = 2.0
    plot: Path = Path("swarmgrad-demo.png")
    device: str = "auto"  # every peer's --device (on one GPU, the peers share it)

    def run_config(self) -> RunConfig:
        """What the demo's swarm trains with: only the settings the demo chooses are set, read as
        `swarmgrad peer` reads its flags (a bad one is an error naming the flag)."""
        chosen = {"task": self.task, "strategy": self.strategy, "averaging": self.averaging,
                  "compression": self.compression, "task-options": TASK_OPTIONS.get(self.task)}
        if _run_config(chosen).strategy.name == "diloco":
            chosen["inner-steps"] = self.inner_steps
        return _run_config(chosen)


def _run_config(values: dict[str, Any]) -> RunConfig:
    given = {PEER_OPTIONS.by_key(key): Given(value, f"--{key}") for key, value in values.items() if value is not None}
    return PEER_OPTIONS.build_model("run", given)


def peer_config(settings: DemoSettings, index: int, initial_peers: list[str]) -> PeerConfig:
    """Peer ``index`` of the demo: its shard, and whether it evaluates. One peer evaluates: after a
    swarm step every peer holds the same model."""
    evaluates = index == 0
    return PeerConfig(
        run_id=settings.run_id, network=NodeConfig(initial_peers=initial_peers),
        connection=Connection(wait_peers=settings.peers, wait=60), data=Data(shard=index, num_shards=settings.peers),
        compute=Compute(threads=1, device=settings.device),
        evaluation=Evaluation(every=settings.eval_every) if evaluates else Evaluation(every=0, final=False),
        stop=Stop(max_seconds=settings.max_seconds, target_accuracy=settings.target_accuracy if evaluates else None))


def peer_command(settings: DemoSettings, index: int, initial_peers: list[str], directory: Path) -> list[str]:
    """``swarmgrad peer`` for peer ``index``, its settings in a config file written to ``directory``."""
    path = write_peer_config(directory / f"peer-{index}.toml", settings.run_config(),
                             peer_config(settings, index, initial_peers))
    return [sys.executable, "-m", "swarmgrad.cli", "peer", "--config", str(path), "--json"]
