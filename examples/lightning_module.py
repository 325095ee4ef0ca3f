"""Lightning training the ``lm`` task with a swarm: ``configure_optimizers`` returns an
``sg.Optimizer`` and its scheduler; Lightning steps (with its closure), clips and schedules as usual.

    python examples/lightning_module.py                          # the first peer: prints how to join
    python examples/lightning_module.py --initial-peers MADDR    # a second peer, on the other shard
"""

from __future__ import annotations

import argparse
import json

import lightning as L
import torch

import swarmgrad as sg
from swarmgrad.tasks import get_task

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--initial-peers", nargs="*", default=[])
parser.add_argument("--run-id", default="lightning-lm")
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()
shard = 1 if args.initial_peers else 0
task = get_task("lm", {"size": "tiny", "context": 64})
BATCH = 8


class LanguageModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # every peer starts from the same weights
        self.gpt = task.make_model()

    def training_step(self, batch, batch_index):
        inputs, targets = batch
        return task.loss_fn(self.gpt(inputs), targets)

    def configure_optimizers(self):
        self.swarm = sg.Optimizer(torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1), model=self,
                                  batch_size=BATCH, run_id=args.run_id, initial_peers=args.initial_peers,
                                  strategy=sg.DiLoCo(inner_steps=5))
        print(f"others join with: python examples/lightning_module.py --initial-peers {self.swarm.peer.maddrs[0]}",
              flush=True)
        self.swarm.peer.wait_for_peers(2, 90)
        warmup = torch.optim.lr_scheduler.LambdaLR(self.swarm, lambda step: min(1.0, (step + 1) / 5))
        return {"optimizer": self.swarm, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


module = LanguageModel()
loader = torch.utils.data.DataLoader(task.train_data(shard, 2, 0), batch_size=BATCH)
trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, gradient_clip_val=1.0, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
try:
    trainer.fit(module, loader)
    status = module.swarm.status()
    print("status", json.dumps({"rounds_ok": status.rounds_ok, "step": status.step, "epoch": status.epoch,
                                "held_out_loss": task.evaluate(module.gpt, max_batches=4)["loss"]}), flush=True)
finally:
    module.swarm.close()
