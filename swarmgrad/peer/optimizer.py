"""``swarmgrad.Optimizer``: a ``torch.optim.Optimizer`` that trains with a swarm, for loops that step
an optimizer themselves (Hugging Face ``Trainer``, Lightning, Accelerate, a plain loop).

    opt = sg.Optimizer(torch.optim.AdamW(model.parameters()), model=model, batch_size=32,
                       run_id="my-run", initial_peers=[...], strategy=sg.DiLoCo(inner_steps=100))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, warmup)   # schedulers attach to it
    for x, y in loader:
        loss_fn(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # clipping as usual
        opt.step()       # the inner step, and the swarm step when due
        opt.zero_grad()
        scheduler.step()
    opt.close()          # leaves the run (or use `with sg.Optimizer(...) as opt:`)

It wraps a ``Peer`` (the façade; its keywords are Peer's) and shares the wrapped optimizer's
``param_groups`` and ``state``, so schedulers, clipping, ``GradScaler.unscale_`` and frameworks that
read or change learning rates see one optimizer. ``GradScaler.step(opt)`` skips ``step()`` on a
step with inf/NaN gradients: that step is then neither counted nor sent. Like hivemind's Optimizer
(whose API this follows, not its code), it joins the run when built.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from swarmgrad.peer.config import RunConfig
from swarmgrad.peer.peer import Peer
from swarmgrad.peer.peer_config import PeerConfig
from swarmgrad.peer.status import PeerStatus

SWARM_KEY = "swarm"  # state_dict(): the wrapped optimizer's own keys, and this one for the swarm's


class _Parameters(torch.nn.Module):
    """The optimizer's parameters as a module, for a caller that passes no model: what the swarm
    averages and joiners download (in param_groups order, so every peer names them alike)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__()
        self.params = torch.nn.ParameterList(param for group in optimizer.param_groups for param in group["params"])


class Optimizer(torch.optim.Optimizer):
    """``optimizer`` stepped with a swarm. ``model``: the module whose parameters ``optimizer`` trains
    (its buffers then travel too, and its state_dict names the state joiners take); default: the
    optimizer's parameters alone. ``batch_size``: samples per ``step()`` (the weight of this peer's
    work; ``step(batch_size=...)`` overrides it for one step). Every other keyword is ``Peer``'s:
    ``run_id``, ``initial_peers``, ``config`` (a RunConfig), ``peer`` (a PeerConfig), ``strategy``, ...
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, batch_size: int, model: torch.nn.Module | None = None,
                 config: RunConfig | None = None, peer: PeerConfig | None = None, **options: Any):
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, Optimizer):
            raise TypeError(f"sg.Optimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self.optimizer, self.batch_size = optimizer, batch_size  # first: param_groups reads it
        # Optimizer.__init__ would build param_groups of its own: these are the wrapped one's
        super().__setstate__({"defaults": optimizer.defaults})
        self.model = model if model is not None else _Parameters(optimizer)
        self.peer = Peer(self.model, optimizer, config=config, peer=peer, batch_size=batch_size, **options)
        self.peer.__enter__()  # joins now; close() leaves

    # the wrapped optimizer's, shared: a scheduler or a framework changing a rate changes the inner step's
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state

    def step(self, closure: Callable[[], Any] | None = None, *, batch_size: int | None = None) -> Any:  # type: ignore[override]
        """``closure()`` first when given (Lightning passes one), then the inner step and the swarm
        step when due (the Peer's ``step``); returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.peer.step(batch_size=batch_size or self.batch_size,
                       loss=loss if isinstance(loss, (torch.Tensor, float, int)) else None)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def status(self) -> PeerStatus:
        return self.peer.status()

    @property
    def epoch(self) -> int:
        return self.peer.epoch

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state_dict, plus ``"swarm"``: the epoch, this peer's step and sample
        counts and the strategy's tensors (DiLoCo: the outer parameters and momentum)."""
        training = self.peer.training
        if training is None:
            raise RuntimeError("this sg.Optimizer was closed")
        local, policy = self.peer.tracker.local, training.policy
        outer = policy.outer_params()
        swarm = {"epoch": local.epoch, "steps": local.steps, "samples": local.samples,
                 "total_steps": local.total_steps, "total_samples": local.total_samples,
                 "strategy": {name: tensor.detach().clone() for name, tensor in policy.state_tensors().items()},
                 "outer": None if outer is None else [tensor.detach().clone() for tensor in outer]}
        return {**self.optimizer.state_dict(), SWARM_KEY: swarm}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what ``state_dict`` returned (a plain optimizer state_dict loads the inner state only).
        A state that does not fit raises ValueError and changes nothing."""
        inner = {key: value for key, value in state_dict.items() if key != SWARM_KEY}
        swarm = state_dict.get(SWARM_KEY)
        training = self.peer.training
        if training is None:
            raise RuntimeError("this sg.Optimizer was closed")
        if swarm is not None:
            _check_swarm_state(swarm, training.policy)
        self.optimizer.load_state_dict(inner)
        if swarm is None:
            return
        local, policy = self.peer.tracker.local, training.policy
        with torch.no_grad():
            policy.load_state_tensors(swarm["strategy"])
            for target, value in zip(policy.outer_params() or [], swarm["outer"] or []):
                target.copy_(value)
        local.epoch, local.steps, local.samples = swarm["epoch"], swarm["steps"], swarm["samples"]
        local.total_steps, local.total_samples = swarm["total_steps"], swarm["total_samples"]
        training.publish_state()  # joiners take the loaded state, at its epoch

    def close(self) -> None:
        """Leave the run (final checkpoint, if any, first). Idempotent."""
        self.peer.__exit__(None, None, None)

    def __enter__(self) -> Optimizer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"sg.Optimizer({self.optimizer!r}, run_id={self.peer.run_id!r})"


def _check_swarm_state(swarm: Any, policy: Any) -> None:
    counters = ("epoch", "steps", "samples", "total_steps", "total_samples")
    if not isinstance(swarm, dict) or not all(isinstance(swarm.get(key), int) and swarm[key] >= 0 for key in counters):
        raise ValueError(f"state_dict[{SWARM_KEY!r}] needs non-negative ints {', '.join(counters)}")
    expected, given = policy.state_tensors(), swarm.get("strategy")
    if not isinstance(given, dict) or set(given) != set(expected) or any(
            not isinstance(given[name], torch.Tensor) or given[name].shape != tensor.shape
            for name, tensor in expected.items()):
        raise ValueError(f"state_dict[{SWARM_KEY!r}] holds another strategy's state: it needs {sorted(expected)[:3]}")
    outer, given_outer = policy.outer_params(), swarm.get("outer")
    if (outer is None) != (given_outer is None) or (outer is not None and (
            not isinstance(given_outer, list) or len(given_outer) != len(outer)
            or any(not isinstance(g, torch.Tensor) or g.shape != t.shape for g, t in zip(given_outer, outer)))):
        raise ValueError(f"state_dict[{SWARM_KEY!r}]['outer'] does not fit this strategy's outer parameters")
