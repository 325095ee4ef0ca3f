"""Train Fashion-MNIST with a swarm: an ordinary PyTorch loop plus three lines of swarmgrad.

First terminal (starts a new swarm and prints its address):
    python examples/train_fashion_mnist.py --run-id fmnist-demo --shard 0 --num-shards 2
Second terminal (joins it, trains on the other half of the data):
    python examples/train_fashion_mnist.py --run-id fmnist-demo --shard 1 --num-shards 2 --initial-peers MADDR

Needs the Fashion-MNIST IDX files in /usr/share/datasets/fashion-mnist (apt-get install dataset-fashion-mnist).
"""

import argparse
import time

import torch

import swarmgrad as sg
from swarmgrad.tasks import endless_batches, get_task
from swarmgrad.tasks.train import make_optimizer

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--run-id", default="fmnist-demo", help="name of the run; every peer of the swarm uses the same")
parser.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR",
                    help="multiaddr(s) of any running peer; none: start a new swarm")
parser.add_argument("--shard", type=int, default=0, help="which part of the training set this peer trains on")
parser.add_argument("--num-shards", type=int, default=1, help="into how many parts the training set is cut")
parser.add_argument("--seconds", type=float, default=60.0, help="train this long, then evaluate and leave")
parser.add_argument("--host", default="127.0.0.1", help="listen address; 0.0.0.0 to let other machines join")
args = parser.parse_args()

# -- the task: model factory, loss, this peer's shard of the data, hyperparameters -------------------
task = get_task("fashion-mnist")
hparams = task.default_hparams  # batch_size 64, Adam lr 1e-3
data = task.train_data(args.shard, args.num_shards, 0)  # the cut is seeded, so shards never overlap
batches = endless_batches(data, hparams["batch_size"], seed=args.shard)  # but each peer shuffles its own way

# Every peer must start from the same weights: DiLoCo averages *changes* to the parameters, which
# only makes sense if everyone started at the same point. Seeding does it here; a peer that joins
# later than the first swarm step downloads the swarm's current weights instead (the Peer does that).
torch.manual_seed(0)
model = task.make_model()
optimizer = make_optimizer(model.parameters(), hparams)  # the *inner* optimizer, stepped by the peer

# -- the swarm --------------------------------------------------------------------------------------
peer = sg.Peer(
    model, optimizer,
    run_id=args.run_id,
    initial_peers=args.initial_peers,
    strategy=sg.DiLoCo(inner_steps=50),  # 50 local Adam steps, then average the change with the swarm
    averaging=sg.Moshpit(group_size=16),  # all-reduce in groups of up to 16, regrouping every round
    compression="int8",  # 4x less traffic per round; errors are fed back into the next round
    network=sg.NodeConfig(host=args.host),
)

with peer:  # joins the swarm (DHT, averaging, state server); leaves it on exit
    if not args.initial_peers:
        print("first peer of a new swarm; join from another terminal with:")
        print(f"  python examples/train_fashion_mnist.py --run-id {args.run_id} --shard 1 --num-shards 2 "
              f"--initial-peers {peer.maddrs[0]}")
    deadline, next_print = time.monotonic() + args.seconds, time.monotonic() + 5
    model.train()
    for inputs, targets in batches:
        loss = task.loss_fn(model(inputs), targets)
        loss.backward()
        # No optimizer.step() / zero_grad() here: the peer steps the optimizer itself, and every
        # inner_steps steps (averaged over the swarm) it takes a swarm step: average and outer update.
        peer.step(batch_size=len(inputs), loss=loss)
        now = time.monotonic()
        if now >= next_print:
            s = peer.status()
            loss_text = f"{s.loss:.3f}" if s.loss is not None else "-"
            print(f"step {s.step:5d}  epoch {s.epoch:3d}  loss {loss_text}  {s.samples_per_second:6.0f} samples/s  "
                  f"peers {s.peers}  rounds ok/failed {s.rounds_ok}/{s.rounds_failed}  sent {s.bytes_sent / 1e6:.1f} MB")
            next_print = now + 5
        if now >= deadline:
            break

# -- evaluate on the held-out set (10k test images) -------------------------------------------------
metrics = task.evaluate(model)
print(f"test accuracy {metrics['accuracy']:.4f}  test loss {metrics['loss']:.4f}")
