"""Built-in training tasks, so ``swarmgrad peer TASK`` works out of the box.

A task knows torch and data and nothing of networking: this package never imports
``swarmgrad.dht`` or ``swarmgrad.averaging``. Datasets load lazily, on first use, and are cached
per process, so listing or resolving tasks is cheap.
"""

from swarmgrad.tasks.base import Task, batches, endless_batches, shard_dataset, shard_indices
from swarmgrad.tasks.charlm import charlm_task
from swarmgrad.tasks.digits import digits_task
from swarmgrad.tasks.fashion_mnist import fashion_mnist_large_task, fashion_mnist_task
from swarmgrad.tasks.registry import TASKS, get_task, register_task

register_task("fashion-mnist", fashion_mnist_task)
register_task("fashion-mnist-large", fashion_mnist_large_task)
register_task("digits", digits_task)
register_task("charlm", charlm_task)

__all__ = ["TASKS", "Task", "batches", "endless_batches", "get_task", "register_task", "shard_dataset",
           "shard_indices", "charlm_task", "digits_task", "fashion_mnist_large_task", "fashion_mnist_task"]
