"""Built-in training tasks, so ``swarmgrad peer TASK`` works out of the box: one module each (or
two tasks sharing their data, as fashion_mnist.py), found by registry.py.

A task knows torch and data and nothing of networking: this package never imports
``swarmgrad.dht`` or ``swarmgrad.averaging``. Datasets load lazily, on first use, and are cached
per process, so listing or resolving tasks is cheap.
"""

from swarmgrad.tasks.base import (
    Task,
    TaskFactory,
    TaskOptions,
    batches,
    endless_batches,
    shard_dataset,
    shard_indices,
)
from swarmgrad.tasks.registry import TASKS, get_task

__all__ = ["TASKS", "Task", "TaskFactory", "TaskOptions", "batches", "endless_batches", "get_task", "shard_dataset",
           "shard_indices"]
