"""The composition root (peer/assembly.py): options reach their fields by name, an unknown one is an
error, phase two wires the backend the run's averaging asks for, and the two phases share one node
(`swarmgrad peer` starts exactly one p2pd)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pydantic
import pytest
import torch
from conftest import p2pd_pids, run_async
from peer_processes import Swarm

import swarmgrad as sg
from swarmgrad.averaging import Averager, GossipAverager
from swarmgrad.errors import ConfigError
from swarmgrad.net.accountability import Accountability
from swarmgrad.peer.assembly import PeerAssembly
from swarmgrad.peer.backends import GossipBackend, MoshpitBackend
from swarmgrad.peer.config import RunConfig
from swarmgrad.peer.keywords import option_paths, peer_settings
from swarmgrad.peer.open_run import OpenRun
from swarmgrad.peer.peer_config import PeerConfig, Stop


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def leaves(model: type, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    found = set()
    for name, info in model.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, pydantic.BaseModel):
            found |= leaves(info.annotation, (*prefix, name))
        else:
            found.add((*prefix, name))
    return found


def test_every_peer_option_has_one_name_and_no_name_is_also_a_run_setting():
    paths = option_paths()
    assert set(paths.values()) >= leaves(PeerConfig)  # every leaf reachable by its name
    assert paths["checkpoint_dir"] == ("checkpoints", "dir") and paths["eval_every"] == ("evaluation", "every")
    assert paths["initial_peers"] == ("network", "initial_peers") and paths["bans"] == ("bans",)
    assert not set(paths) & set(RunConfig.model_fields)


def test_options_by_flag_name_and_by_section_reach_their_fields():
    requested, local = peer_settings(None, None, {
        "run_id": "r", "initial_peers": [], "checkpoint_dir": "/tmp/ckpt", "checkpoint_every": 5.0,
        "upload_limit_mbps": 2.0, "direct": False, "eval_every": 0.0, "timing": sg.Timing(presence_refresh=0.5),
        "bans": Accountability(ban_threshold=3), "compression": "fp16", "strategy": sg.DiLoCo(inner_steps=7)})
    assert local.checkpoints.dir == Path("/tmp/ckpt") and local.checkpoints.every == 5.0
    assert local.connection.upload_limit_mbps == 2.0 and local.connection.direct is False
    assert local.evaluation.every == 0.0 and local.timing.presence_refresh == 0.5 and local.bans.ban_threshold == 3
    assert requested.explicit() == {"compression": "fp16", "strategy.name": "diloco", "strategy.inner_steps": 7}
    # a section, then one of its fields by name: both count, on top of `peer=`
    base = PeerConfig(run_id="base", stop=Stop(max_steps=9))
    _, local = peer_settings(None, base, {"network": sg.NodeConfig(port=4001), "initial_peers": [],
                                          "host": "127.0.0.2"})
    assert (local.run_id, local.stop.max_steps) == ("base", 9)
    assert (local.network.port, local.network.host) == (4001, "127.0.0.2")
    peer = sg.Peer(*model_and_optimizer(), run_id="r", checkpoint_dir="/tmp/ckpt", compression="none")
    assert peer.assembly.local.checkpoints.dir == Path("/tmp/ckpt") and peer.requested.compression == "none"


def test_an_unknown_option_is_an_error_that_names_it():
    with pytest.raises(TypeError, match="'accountability'") as raised:
        sg.Peer(*model_and_optimizer(), run_id="r", accountability=Accountability())
    with pytest.raises(TypeError, match="did you mean 'checkpoint_dir'"):
        sg.Peer(*model_and_optimizer(), run_id="r", checkpoint_dirs="/tmp")
    assert "\n" not in str(raised.value)
    with pytest.raises(ConfigError, match="upload_limit_mbps"):  # a known one is validated by its field
        sg.Peer(*model_and_optimizer(), run_id="r", upload_limit_mbps=-1)


@pytest.mark.parametrize("strategy", [sg.DiLoCo(inner_steps=4), sg.GossipSGD(every=2)])
def test_the_assembly_wires_the_backend_the_runs_averaging_asks_for(strategy):
    async def scenario():
        assembly = PeerAssembly(RunConfig(strategy=strategy), PeerConfig(run_id="wiring"))
        try:
            config = await assembly.open()
            assert assembly.runtime.transport is None  # phase one serves and announces nothing
            training = await assembly.build(*model_and_optimizer(), batch_size=8)
            return config, training, assembly.tracker.settings
        finally:
            await assembly.close()

    config, training, settings = run_async(scenario())
    averager, backend = training.averager, training.driver.backend
    if config.averaging.kind == "gossip":
        assert isinstance(averager, GossipAverager) and isinstance(backend, GossipBackend)
        assert backend.gossip is averager and training.catch_up.decoder is None
    else:
        assert isinstance(averager, Averager) and isinstance(backend, MoshpitBackend)
        assert backend.averager is averager and training.catch_up.decoder is averager.result_decoder
        assert averager.aggregation.weight_cap == training.policy.weight_cap(8)
    assert settings == f"{config.digest}.{averager.schema.digest[:8]}"


def test_open_run_settles_on_the_node_the_peer_then_trains_with():
    with OpenRun(run_id="two-phase", create=True, config=RunConfig(task="digits")) as run:
        node, pids = run.assembly.node, p2pd_pids()
        assert run.manifest is not None and run.config.task == "digits" and len(pids) == 1
        with run.peer(*model_and_optimizer(), batch_size=8) as peer:
            assert peer.node is node and p2pd_pids() == pids and peer.manifest is run.manifest
            assert peer.config.task == "digits" and peer.status().peer_id == node.peer_id
    assert p2pd_pids() == set()


def test_a_cli_peer_starts_exactly_one_p2pd():
    """Settling the run used to start a second, short-lived p2pd just to read the manifest."""
    run = Swarm(f"one-daemon-{time.monotonic_ns() % 10**6}")
    try:
        peer = run.peer("--create", "--max-steps", "3", "--eval-every", "0", "--no-final-eval")
        seen: set[int] = set()
        watching = threading.Event()

        def watch() -> None:
            while not watching.is_set():
                seen.update(p2pd_pids(peer.process.pid))
                time.sleep(0.01)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            peer.done(120)
        finally:
            watching.set()
            watcher.join(5)
        assert peer.wait_exit(30) == 0, peer.describe()
        assert len(seen) == 1, (seen, peer.describe())
    finally:
        run.close()
