"""Hugging Face ``Trainer`` training the ``lm`` task with a swarm: ``sg.Optimizer`` goes in through
``optimizers=(optimizer, scheduler)``; the Trainer steps, clips and schedules as it always does.

    python examples/hf_trainer.py                              # the first peer: prints how to join
    python examples/hf_trainer.py --initial-peers MADDR        # a second peer, on the other shard
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
from transformers import Trainer, TrainingArguments

import swarmgrad as sg
from swarmgrad.tasks import get_task

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--initial-peers", nargs="*", default=[])
parser.add_argument("--run-id", default="hf-lm")
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()
shard = 1 if args.initial_peers else 0


class Texts(torch.utils.data.IterableDataset):
    """The task's stream as the dicts a Trainer feeds a model."""

    def __init__(self, stream: torch.utils.data.IterableDataset):
        self.stream = stream

    def __iter__(self):
        for inputs, targets in self.stream:
            yield {"input_ids": inputs, "labels": targets}


class CausalLM(torch.nn.Module):
    """The task's GPT with the forward a Trainer calls: keywords in, a loss out."""

    def __init__(self, gpt: torch.nn.Module, loss_fn):
        super().__init__()
        self.gpt, self.loss_fn = gpt, loss_fn

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.loss_fn(self.gpt(input_ids), labels)}


task = get_task("lm", {"size": "tiny", "context": 64})
torch.manual_seed(0)  # every peer starts from the same weights
model = CausalLM(task.make_model(), task.loss_fn)
batch_size = 8

optimizer = sg.Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), model=model,
                         batch_size=batch_size, run_id=args.run_id, initial_peers=args.initial_peers,
                         strategy=sg.DiLoCo(inner_steps=5))
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))
print(f"others join with: python examples/hf_trainer.py --initial-peers {optimizer.peer.maddrs[0]}", flush=True)
optimizer.peer.wait_for_peers(2, 90)

with optimizer, tempfile.TemporaryDirectory() as output:
    trainer = Trainer(
        model=model,
        args=TrainingArguments(output_dir=output, max_steps=args.steps, per_device_train_batch_size=batch_size,
                               max_grad_norm=1.0, use_cpu=True, report_to=[], save_strategy="no",
                               logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0),
        train_dataset=Texts(task.train_data(shard, 2, 0)),
        optimizers=(optimizer, scheduler),
    )
    trainer.train()
    status = optimizer.status()
    print("status", json.dumps({"rounds_ok": status.rounds_ok, "step": status.step, "epoch": status.epoch,
                                "held_out_loss": task.evaluate(model.gpt, max_batches=4)["loss"]}), flush=True)
