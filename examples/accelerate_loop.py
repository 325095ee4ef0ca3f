"""An Accelerate loop training the ``lm`` task with a swarm: ``accelerator.prepare`` takes the
``sg.Optimizer`` like any optimizer; backward, clipping and stepping are Accelerate's as usual.

    python examples/accelerate_loop.py                          # the first peer: prints how to join
    python examples/accelerate_loop.py --initial-peers MADDR    # a second peer, on the other shard
"""

from __future__ import annotations

import argparse
import json

import torch
from accelerate import Accelerator

import swarmgrad as sg
from swarmgrad.tasks import get_task

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--initial-peers", nargs="*", default=[])
parser.add_argument("--run-id", default="accelerate-lm")
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()
shard = 1 if args.initial_peers else 0

task = get_task("lm", {"size": "tiny", "context": 64})
torch.manual_seed(0)  # every peer starts from the same weights
model = task.make_model()
swarm = sg.Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), model=model, batch_size=8,
                     run_id=args.run_id, initial_peers=args.initial_peers, strategy=sg.DiLoCo(inner_steps=5))
print(f"others join with: python examples/accelerate_loop.py --initial-peers {swarm.peer.maddrs[0]}", flush=True)
swarm.peer.wait_for_peers(2, 90)
scheduler = torch.optim.lr_scheduler.LambdaLR(swarm, lambda step: min(1.0, (step + 1) / 5))

accelerator = Accelerator(cpu=True)
loader = torch.utils.data.DataLoader(task.train_data(shard, 2, 0), batch_size=8)
model, optimizer, loader, scheduler = accelerator.prepare(model, swarm, loader, scheduler)
with swarm:
    for step, (inputs, targets) in zip(range(args.steps), loader):
        loss = task.loss_fn(model(inputs), targets)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    status = swarm.status()
    print("status", json.dumps({"rounds_ok": status.rounds_ok, "step": status.step, "epoch": status.epoch,
                                "held_out_loss": task.evaluate(model, max_batches=4)["loss"]}), flush=True)
