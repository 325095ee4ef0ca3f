"""A Byzantine peer for the attack benchmark: the real ``swarmgrad peer`` with one behaviour changed.

    python benchmarks/_attacker.py --attack KIND <swarmgrad peer args>

It patches the one method its attack needs, then runs the normal CLI peer. The library has no
attack hooks: the patches live here, in the benchmark's own code, and touch only this process.

    sign-flip        the DiLoCo pseudo-gradient it contributes (after ``prepare()``), x -10
    scaled           the same, x 100
    noise            the same plus Gaussian noise of 100x its norm
    weight           ``policy.weight()`` claims 1e9 samples
    progress-epoch   its presence record's Progress says epoch 10^6
    progress-samples its presence record's Progress says 10^12 samples and 10^9 steps in its epoch
    replay           the first update it contributed, again in every round
    poisoned-state   the state snapshots it serves to joiners hold its parameters x -10
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # the benchmark imports ATTACKS from here; only the attacker process needs torch
    import torch

ATTACKS: dict[str, str] = {
    "sign-flip": "update x -10",
    "scaled": "update x 100",
    "noise": "update + Gaussian noise at 100x its norm",
    "weight": "weight claim 1e9",
    "progress-epoch": "presence progress: epoch 10^6",
    "progress-samples": "presence progress: 10^12 samples, 10^9 steps",
    "replay": "its first update, every round",
    "poisoned-state": "serves joiners its parameters x -10",
}
FAKE_EPOCH = 10**6
FAKE_SAMPLES, FAKE_STEPS = 10**12, 10**9
STATE_FACTOR = -10.0
PRIVATE = False  # set from the peer's arguments: update-level privacy on


def _send_the_contribution() -> None:
    """An honest peer's averager reads the pseudo-gradient where it lives, a chunk at a time
    (``Averager.read_in_place``), and never the contribution ``prepare()`` fills: this one sends the
    contribution, which its attack changed (else the attack would change nothing it sends)."""
    from swarmgrad.averaging.moshpit import Averager

    Averager.read_in_place = lambda self, reader: False  # type: ignore[method-assign]


def _patch_update(change: Callable[[torch.Tensor], None]) -> None:
    """``change`` the contribution in place after every ``prepare()`` (a retried round prepares again).
    In a private run it changes what its releaser released instead: a liar skips its own clip, and
    its row then carries the run's noise like an honest one."""
    if PRIVATE:
        from swarmgrad.averaging.privacy.release import PrivateReleaser

        release = PrivateReleaser.release

        def poisoned_release(self: PrivateReleaser, update):  # type: ignore[no-untyped-def]
            released = release(self, update)
            for tensor in released:
                change(tensor)
            return released

        PrivateReleaser.release = poisoned_release  # type: ignore[method-assign]
        return
    from swarmgrad.peer.strategies.diloco import DiLoCoPolicy

    _send_the_contribution()
    prepare = DiLoCoPolicy.prepare

    def poisoned(self: DiLoCoPolicy) -> None:
        prepare(self)
        change(self.contribution)

    DiLoCoPolicy.prepare = poisoned  # type: ignore[method-assign]


def _add_noise(update: torch.Tensor) -> None:
    import torch

    # noise of norm ~100 ||update||: each of n coordinates gets sigma = 100 ||update|| / sqrt(n)
    sigma = 100.0 * float(update.norm()) / max(1, update.numel()) ** 0.5
    update.add_(torch.randn_like(update), alpha=sigma)


def _patch_replay() -> None:
    from swarmgrad.peer.strategies.diloco import DiLoCoPolicy

    _send_the_contribution()
    prepare = DiLoCoPolicy.prepare
    first: list[torch.Tensor] = []

    def replayed(self: DiLoCoPolicy) -> None:
        prepare(self)
        if not first:
            first.append(self.contribution.clone())
        else:
            self.contribution.copy_(first[0])

    DiLoCoPolicy.prepare = replayed  # type: ignore[method-assign]


def _patch_weight() -> None:
    from swarmgrad.peer.strategies.base import Policy

    Policy.weight = lambda self: 1e9  # type: ignore[method-assign]


def _patch_progress(**fake: int) -> None:
    """What the presence heartbeat publishes (progress.py builds a Progress each beat); its own view is unchanged."""
    from swarmgrad.peer import progress

    real = progress.Progress

    def inflated(**fields):
        return real(**{**fields, **fake})

    progress.Progress = inflated  # type: ignore[assignment,misc]


def _patch_state() -> None:
    """Every snapshot it publishes (what joiners download) gets its float model tensors x -10."""
    from swarmgrad.state.server import StateServer
    from swarmgrad.state.snapshot import StateSnapshot

    publish = StateServer.publish

    def poisoned(self: StateServer, snapshot: StateSnapshot) -> None:
        bad = StateSnapshot(snapshot.version, snapshot.specs, snapshot.meta, snapshot.data.clone())
        for name, tensor in bad.tensors().items():
            if name.startswith("model/") and tensor.is_floating_point():
                tensor.mul_(STATE_FACTOR)
        publish(self, bad)

    StateServer.publish = poisoned  # type: ignore[method-assign]


def patch(attack: str) -> None:
    if attack == "sign-flip":
        _patch_update(lambda update: update.mul_(-10.0))
    elif attack == "scaled":
        _patch_update(lambda update: update.mul_(100.0))
    elif attack == "noise":
        _patch_update(_add_noise)
    elif attack == "weight":
        _patch_weight()
    elif attack == "progress-epoch":
        _patch_progress(epoch=FAKE_EPOCH)
    elif attack == "progress-samples":
        _patch_progress(samples=FAKE_SAMPLES, steps=FAKE_STEPS)
    elif attack == "replay":
        _patch_replay()
    elif attack == "poisoned-state":
        _patch_state()
    else:
        raise SystemExit(f"--attack must be one of {', '.join(ATTACKS)}, got {attack!r}")


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] != "--attack":
        raise SystemExit("usage: python benchmarks/_attacker.py --attack KIND <swarmgrad peer args>")
    global PRIVATE
    level = argv[argv.index("--privacy-level") + 1] if "--privacy-level" in argv[:-1] else "update"
    PRIVATE = "--privacy-clip" in argv and level == "update"  # its releaser is what it patches
    patch(argv[1])
    sys.argv = ["swarmgrad", "peer", *argv[2:]]
    from swarmgrad.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout
    main(sys.argv[1:])
