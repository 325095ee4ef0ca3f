"""``OpenRun``: a run opened before its model exists (phase one of ``PeerAssembly``), for a caller
that builds its model from the run's settled settings (``swarmgrad peer``)."""

from __future__ import annotations

from typing import Any

import torch

from swarmgrad.eventloop import BackgroundLoop
from swarmgrad.peer.assembly import Fingerprint, PeerAssembly
from swarmgrad.peer.config import RunConfig
from swarmgrad.peer.keywords import peer_settings
from swarmgrad.peer.manifest import RunManifest
from swarmgrad.peer.peer import Peer
from swarmgrad.peer.peer_config import PeerConfig


class OpenRun:
    """The run opened before its model exists, for a caller that needs the run's settings to build it
    (``swarmgrad peer``: the task, its hyperparameters and seed): phase one of ``PeerAssembly``, on the
    event loop and with the node the Peer then runs on.

        with OpenRun(config=requested, peer=local) as run:
            model, optimizer = build(run.config)
            with run.peer(model, optimizer, batch_size=64) as peer:
                ...

    Takes what ``Peer`` takes besides the model, plus ``fingerprint`` and ``wait_for_manifest``
    (``PeerAssembly``)."""

    def __init__(self, *, config: RunConfig | None = None, peer: PeerConfig | None = None,
                 manifest: RunManifest | None = None, fingerprint: Fingerprint = lambda task: None,
                 wait_for_manifest: float | None = None, **options: Any):
        requested, local = peer_settings(config, peer, options)
        self.assembly = PeerAssembly(requested, local, manifest, fingerprint=fingerprint,
                                     wait_for_manifest=wait_for_manifest)
        self.background: BackgroundLoop | None = None

    @property
    def config(self) -> RunConfig:
        """The run's settings, settled once entered."""
        return self.assembly.config

    @property
    def manifest(self) -> RunManifest | None:
        return self.assembly.manifest

    def __enter__(self) -> OpenRun:
        self.background = BackgroundLoop(name=f"swarmgrad-peer-{self.assembly.run_id}")
        try:
            self.background.run(self.assembly.open())
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def peer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, batch_size: int | None = None,
             dataset_size: int | None = None, grad_scaler: torch.amp.GradScaler | None = None) -> Peer:
        """The Peer that trains ``model`` in this run; ``with`` it to assemble the rest and join."""
        if self.background is None:
            raise RuntimeError("use `with OpenRun(...) as run:` first")
        return Peer._on(self.assembly, self.background, model, optimizer, batch_size, dataset_size, grad_scaler)

    def __exit__(self, *exc_info) -> None:
        """Closes what the Peer did not (it closes all it entered, the loop included)."""
        if self.background is None:
            return
        try:
            if self.background.loop.is_running():
                self.background.run(self.assembly.close(), timeout=6 * self.assembly.timing.close_part)
        finally:
            self.background.close()
            self.background = None
