"""A listed member that never averages: epochs the honest peers gain with and without it (issue 38).

    python benchmarks/silent_member.py [--seconds 40] [--peers 3] [--json]

Honest ``digits`` peers (DiLoCo, in one process, on loopback) train for ``--seconds``; then a
presence record joins them that carries the run's settings digest and an honest peer's rates,
claims one epoch more than the highest honest peer at every beat, and never joins a round (its
node serves no averaging protocol: a record, not a peer). The honest peers train for the same
time again, then once more after the record left. The table gives the epochs each window gained and
the ratio of the middle one to the mean of the other two (issue 38's target: at least 0.8; at
670d8d2 it was 10/169), and what the rounds did. Timing-sensitive: run it on an idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import log  # noqa: E402

import swarmgrad as sg  # noqa: E402
from swarmgrad.dht import NodeConfig, SwarmNode  # noqa: E402
from swarmgrad.dht.membership import Membership, Progress  # noqa: E402
from swarmgrad.tasks.digits import load_digits_split, make_digits_mlp  # noqa: E402

RUN = "silent-member"
TIMING = sg.Timing(presence_refresh=0.5)
BATCH = 32


def honest_peer(seed: int, initial_peers: list[str]) -> tuple[sg.Peer, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = make_digits_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    peer = sg.Peer(model, optimizer, run_id=RUN, strategy=sg.DiLoCo(inner_steps=4), timing=TIMING,
                   initial_peers=initial_peers)
    return peer, model, optimizer


async def train(peer: sg.Peer, model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int,
                until: float) -> None:
    """Digits batches until ``until`` (monotonic), yielding to the loop between steps."""
    inputs, targets = load_digits_split()["train"]
    generator = torch.Generator().manual_seed(seed)
    while time.monotonic() < until:
        index = torch.randint(0, len(inputs), (BATCH,), generator=generator)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs[index]), targets[index])
        loss.backward()
        await peer.astep(batch_size=BATCH, loss=loss)
        await asyncio.sleep(0.002)


COUNTERS = ("rounds_ok", "rounds_failed", "solo_steps", "state_downloads", "rounds_replayed")


def counters(peers: list) -> dict[str, int]:
    statuses = [peer.status() for peer, _, _ in peers]
    return {name: sum(getattr(status, name) for status in statuses) for name in COUNTERS}


async def window(peers: list, seconds: float, into: dict | None = None) -> list[int]:
    """Epochs each honest peer gained while all of them trained for ``seconds`` (``into``: what
    their rounds did meanwhile, summed over the peers)."""
    before, counted = [peer.epoch for peer, _, _ in peers], counters(peers)
    until = time.monotonic() + seconds
    await asyncio.gather(*(train(peer, model, opt, seed, until) for seed, (peer, model, opt) in enumerate(peers)))
    if into is not None:
        into.update({name: value - counted[name] for name, value in counters(peers).items()})
    return [peer.epoch - e for (peer, _, _), e in zip(peers, before)]


async def silent_record(stack: AsyncExitStack, peers: list, initial_peers: list[str]) -> SwarmNode:
    """A node that only publishes a presence record: honest settings and rates, one epoch past the
    highest honest peer at every beat, never in a round."""
    node = await stack.enter_async_context(SwarmNode(NodeConfig(host="127.0.0.1", initial_peers=initial_peers)))
    first = peers[0][0]

    def fill(membership: Membership) -> None:
        honest = first.tracker.local
        lie = Progress(epoch=max(peer.epoch for peer, _, _ in peers) + 1, samples=honest.samples, steps=honest.steps,
                       steps_per_second=float(honest.steps_per_second), averaging=False,
                       settings=first.tracker.settings)
        membership.update(step=honest.total_steps, samples_per_second=float(honest.samples_per_second), progress=lie)

    await stack.enter_async_context(Membership(node, RUN, ttl=TIMING.presence_ttl, refresh=TIMING.presence_refresh,
                                               before_publish=fill))
    return node


async def measure(count: int, seconds: float) -> dict:
    async with AsyncExitStack() as stack:
        peers = []
        for seed in range(count):
            peer, model, optimizer = honest_peer(seed, peers[0][0].maddrs if peers else [])
            peers.append((await stack.enter_async_context(peer), model, optimizer))
        await asyncio.gather(*(peer.await_peers(count, 30) for peer, _, _ in peers))
        await window(peers, min(10.0, seconds / 2))  # warm-up: the first rounds measure deadlines
        log(f"clean window of {seconds:.0f} s")
        rounds: dict[str, dict] = {"clean": {}, "silent": {}, "after": {}}
        clean = await window(peers, seconds, rounds["clean"])
        async with AsyncExitStack() as record:
            node = await silent_record(record, peers, peers[0][0].maddrs)
            deadline = time.monotonic() + 20
            while not all(any(m.peer_id == node.peer_id for m in peer.runtime.members()) for peer, _, _ in peers):
                if time.monotonic() > deadline:
                    raise RuntimeError("the honest peers never listed the silent record")
                await window(peers, 0.2)
            log(f"window of {seconds:.0f} s beside the silent record")
            silent = await window(peers, seconds, rounds["silent"])
            statuses = [peer.status() for peer, _, _ in peers]
        log(f"window of {seconds:.0f} s after the record left")
        after = await window(peers, seconds, rounds["after"])
    return {"peers": count, "seconds": seconds, "clean": clean, "silent": silent, "after": after,
            # against the mean of the windows before and after it: on a shared machine the pace drifts
            "ratio": sum(silent) / max(1.0, (sum(clean) + sum(after)) / 2), "rounds": rounds,
            "silent_no_shows": [getattr(status, "no_shows", {}).get(node.peer_id, 0) for status in statuses],
            "other_no_shows": [sum(n for p, n in getattr(status, "no_shows", {}).items() if p != node.peer_id)
                               for status in statuses]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=40.0, help="length of each window")
    parser.add_argument("--peers", type=int, default=3, help="honest peers")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = asyncio.run(measure(args.peers, args.seconds))
    if args.json:
        print(json.dumps(result))
        return
    print(f"{'window':<28}{'epochs (per peer)':<22}{'total':>6}  " + "  ".join(COUNTERS))
    for name, label in (("clean", "clean"), ("silent", "beside the silent record"), ("after", "after it left")):
        print(f"{label:<28}{str(result[name]):<22}{sum(result[name]):>6}  "
              + "  ".join(f"{result['rounds'][name][c]:>{len(c)}}" for c in COUNTERS))
    print(f"ratio beside / mean of clean and after: {result['ratio']:.2f} (target >= 0.80)")
    print(f"no-shows of the silent record seen by each peer: {result['silent_no_shows']}; "
          f"of honest peers: {result['other_no_shows']}")


if __name__ == "__main__":
    main()
