"""An asyncio app that trains with a swarm on the side: ``async with sg.Peer(...)`` and ``await peer.astep()``.

The peer runs on the app's own event loop, next to the app's other tasks (here a heartbeat that
prints the peer's status). It is a *client-mode* peer: it dials out and listens for no new libp2p
connections, so it works behind NAT and firewalls with nothing to open. It takes part in averaging
over the connections it opened itself (libp2p streams run both ways on them); a peer it has no
connection to cannot invite it into a group, and when a round leaves it out it does not block
anyone: it trains locally and takes the swarm's state (downloaded from a peer that finished the
epoch) when the swarm has moved on. ``state downloads`` in the heartbeat counts those catch-ups.

It joins a running swarm of the ``digits`` task. Start one in two other terminals:
    swarmgrad bootstrap --port 31337 --identity boot.key        # prints MADDR
    swarmgrad peer digits --run-id digits-demo --create --initial-peers MADDR   # diloco, 50 inner steps, int8
then:
    python examples/embedded_peer.py --run-id digits-demo --initial-peers MADDR --seconds 60
It passes no run settings: it takes the run's (strategy, compression, ...) from the run's manifest.
"""

import argparse
import asyncio
import time

import torch

import swarmgrad as sg
from swarmgrad.tasks import endless_batches, get_task
from swarmgrad.tasks.train import make_optimizer


async def heartbeat(peer: sg.Peer, every: float = 2.0) -> None:
    """Stands for the app's own work: it keeps running while the peer trains."""
    while True:
        await asyncio.sleep(every)
        s = peer.status()
        loss = f"{s.loss:.3f}" if s.loss is not None else "-"
        print(f"[heartbeat] step {s.step}  epoch {s.epoch}  loss {loss}  peers {s.peers}  "
              f"state downloads {s.state_downloads}  rounds ok/failed {s.rounds_ok}/{s.rounds_failed}")


async def train(peer: sg.Peer, task, model: torch.nn.Module, seconds: float) -> None:
    batches = endless_batches(task.train_data(0, 1, 0), task.default_hparams["batch_size"], seed=int(time.time()))
    deadline = time.monotonic() + seconds
    model.train()
    for inputs, targets in batches:
        loss = task.loss_fn(model(inputs), targets)
        loss.backward()
        await peer.astep(batch_size=len(inputs), loss=loss)  # steps the optimizer; no optimizer.step() here
        # Forward and backward block the loop: a tiny model takes well under a millisecond, so
        # yielding between batches keeps the app responsive. Move heavy models to a thread.
        await asyncio.sleep(0)
        if time.monotonic() >= deadline:
            return


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-id", default="digits-demo", help="the run to join (created with --create elsewhere)")
    parser.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR",
                        help="multiaddr(s) of any node of the running swarm, e.g. the bootstrap node")
    parser.add_argument("--seconds", type=float, default=60.0, help="train this long, then leave")
    args = parser.parse_args()

    task = get_task("digits")
    torch.manual_seed(0)  # same start as every other peer (and replaced by the swarm's state on joining)
    model = task.make_model()
    optimizer = make_optimizer(model.parameters(), task.default_hparams)
    peer = sg.Peer(
        model, optimizer,
        run_id=args.run_id,  # the run's settings come from its manifest; any given here must agree with it
        # outbound connections only; a client-mode NodeConfig must name its initial peers itself
        network=sg.NodeConfig(client_mode=True, initial_peers=args.initial_peers),
    )
    async with peer:  # joins on this loop: downloads the swarm's state if the run is under way
        print(f"joined run {args.run_id} as {peer.peer_id} (client mode), training {peer.config.strategy}")
        beat = asyncio.create_task(heartbeat(peer))
        try:
            await train(peer, task, model, args.seconds)
        finally:
            beat.cancel()
    metrics = task.evaluate(model)
    print(f"left the swarm; test accuracy {metrics['accuracy']:.4f}")


if __name__ == "__main__":
    asyncio.run(main())
