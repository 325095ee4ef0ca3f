"""A peer's training state as named tensors plus metadata: what joiners download and checkpoints keep.

Names: ``model/<state_dict key>``, ``optimizer/<param index>/<state key>`` and
``strategy/<name>``. Optimizer hyperparameters (param_groups) are not part of it: every peer of
a run configures its own optimizer the same way, and a schedule may change them locally.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from swarmgrad.errors import ConfigError
from swarmgrad.state.served import ServedState
from swarmgrad.state.snapshot import StateSnapshot


class StatefulStrategy(Protocol):
    params: list[torch.nn.Parameter]

    def outer_params(self) -> list[torch.Tensor] | None: ...

    def state_tensors(self) -> dict[str, torch.Tensor]: ...

    def expected_state(self) -> dict[str, torch.Tensor]: ...

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None: ...

    def outer_step_begins(self) -> None: ...

    def reset_outer_state(self) -> None: ...


OPTIMIZER_PREFIX = "optimizer/"


def not_optimizer(name: str) -> bool:
    """Every state tensor but the optimizer's: what a peer that keeps its own optimizer state downloads."""
    return not name.startswith(OPTIMIZER_PREFIX)


def is_optimizer(name: str) -> bool:
    return name.startswith(OPTIMIZER_PREFIX)


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True).contiguous()


class StateMismatch(ConfigError):
    """A downloaded or saved state does not fit this peer's model or optimizer."""


class TrainingState:
    """Captures and restores model, optimizer and strategy state together."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, strategy: StatefulStrategy):
        self.model, self.optimizer, self.strategy = model, optimizer, strategy

    def tensors(self) -> dict[str, torch.Tensor]:
        named = {f"model/{key}": value for key, value in self.model.state_dict().items()}
        named.update({f"strategy/{key}": value for key, value in self.strategy.state_tensors().items()})
        # the optimizer's last: a peer that keeps its own fetches the parts before it, one range
        for index, state in self.optimizer.state_dict()["state"].items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    named[f"{OPTIMIZER_PREFIX}{index}/{key}"] = value
        return named

    def optimizer_scalars(self) -> dict[str, dict[str, Any]]:
        """Non-tensor optimizer state (e.g. step counts kept as numbers by some optimizers)."""
        scalars: dict[str, dict[str, Any]] = {}
        for index, state in self.optimizer.state_dict()["state"].items():
            plain = {key: value for key, value in state.items()
                     if not isinstance(value, torch.Tensor) and isinstance(value, (int, float, bool))}
            if plain:
                scalars[str(index)] = plain
        return scalars

    def capture(self, version: int, meta: dict[str, Any]) -> ServedState:
        """The state as of now, to serve: where the strategy keeps the swarm's parameters apart from the
        model (``outer_params``) it is read from there, and the strategy's and the optimizer's own
        tensors are read live (no copy: DESIGN's memory budget; a GPU's moments stay on it); the rest
        (the model's own parameters where no strategy keeps them, its buffers) is copied."""
        meta = {**meta, "optimizer_scalars": self.optimizer_scalars()}
        outer = self._outer_views()
        tensors: dict[str, torch.Tensor] = {}
        live: set[str] = set()
        for key, value in self.model.state_dict(keep_vars=True).items():
            name = f"model/{key}"
            if name in outer:
                tensors[name] = outer[name]
                live.add(name)
            else:
                tensors[name] = _copy(value)
        for name, value in self.tensors().items():
            if name.startswith("model/"):
                continue
            # a peer's own optimizer moments are served as they are (on a GPU too: read a part at a
            # time when a joiner asks, never copied after every round); a shared one (sync's) is the
            # swarm's, and a copy keeps it whole for the epoch
            own = is_optimizer(name) and self.strategy.local_optimizer
            if value.is_contiguous() and (own or (value.device.type == "cpu" and not is_optimizer(name))):
                tensors[name] = value.detach()
                live.add(name)
            else:
                tensors[name] = _copy(value)
        return ServedState(version, tensors, meta, live=frozenset(live), keep_live=is_optimizer)

    def _outer_views(self) -> dict[str, torch.Tensor]:
        """``model/<key>`` -> the strategy's view of that parameter as the swarm's last step left it
        (``outer_params``; none where the strategy keeps no such copy)."""
        outer = self.strategy.outer_params()
        if outer is None:
            return {}
        kept = {id(param): view for param, view in zip(self.strategy.params, outer)}
        return {f"model/{key}": kept[id(value)] for key, value in self.model.state_dict(keep_vars=True).items()
                if id(value) in kept and kept[id(value)].dtype == value.dtype}

    def download_targets(self) -> dict[str, torch.Tensor]:
        """The tensors a download may write in place (state/landing.py): the swarm's parameters where
        the strategy keeps them apart from the model, and its own tensors (DiLoCo's start and
        momentum), never the model the training loop reads. A reader of this peer's state keeps what
        it reads (the strategy goes on with copies first). A failed download leaves them half
        written: ``reset_outer_state`` then."""
        self.strategy.outer_step_begins()
        targets = self._outer_views()
        if targets:
            targets.update({f"strategy/{name}": value for name, value in self.strategy.state_tensors().items()})
        return targets

    def restore(self, snapshot: StateSnapshot | ServedState, keep_optimizer: bool = False,
                adopt: bool = False) -> None:
        """Load a snapshot; raises StateMismatch (changing nothing) when it does not fit.
        ``keep_optimizer``: leave the optimizer's state as it is (the snapshot may then hold none).
        ``adopt``: the snapshot's optimizer tensors are this peer's to keep (a download made them for
        it): the optimizer takes them as they are instead of copies."""
        tensors = snapshot.tensors()
        model_state = self.model.state_dict()
        model_part = {key.removeprefix("model/"): value for key, value in tensors.items() if key.startswith("model/")}
        if set(model_part) != set(model_state):
            missing, extra = sorted(set(model_state) - set(model_part)), sorted(set(model_part) - set(model_state))
            raise StateMismatch(f"state does not fit the model: missing {missing[:5]}, unexpected {extra[:5]}")
        for key, value in model_part.items():
            if tuple(value.shape) != tuple(model_state[key].shape) or value.dtype != model_state[key].dtype:
                raise StateMismatch(f"state tensor model/{key} is {value.dtype}{tuple(value.shape)}, "
                                    f"the model has {model_state[key].dtype}{tuple(model_state[key].shape)}")
        optimizer_state = None if keep_optimizer else \
            self._optimizer_state(tensors, snapshot.meta.get("optimizer_scalars", {}), adopt)
        strategy_part = {key.removeprefix("strategy/"): value for key, value in tensors.items()
                         if key.startswith("strategy/")}
        expected = self.strategy.expected_state()
        if set(strategy_part) != set(expected):
            raise StateMismatch(f"state was kept by another strategy: it holds {sorted(strategy_part)[:3]}, "
                                f"this peer's strategy needs {sorted(expected)[:3]}")
        for key, value in strategy_part.items():
            if value.shape != expected[key].shape:
                raise StateMismatch(f"strategy state {key} is {tuple(value.shape)}, expected {tuple(expected[key].shape)}")
        with torch.no_grad():  # both copy into the live tensors: no clone of the state first
            self.model.load_state_dict(model_part)
        if optimizer_state is not None:
            current = self.optimizer.state_dict()
            self.optimizer.load_state_dict({"state": optimizer_state, "param_groups": current["param_groups"]})
        self.strategy.load_state_tensors(strategy_part)

    def _optimizer_state(self, tensors: dict[str, torch.Tensor], scalars: Any,
                         adopt: bool = False) -> dict[int, dict[str, Any]]:
        params = [param for group in self.optimizer.param_groups for param in group["params"]]
        state: dict[int, dict[str, Any]] = {}
        for key, value in tensors.items():
            if not_optimizer(key):
                continue
            _, index_text, name = key.split("/", 2)
            index = int(index_text)
            if not 0 <= index < len(params):
                raise StateMismatch(f"state has optimizer state for parameter {index}; the optimizer has {len(params)}")
            if value.dim() > 0 and tuple(value.shape) != tuple(params[index].shape):
                raise StateMismatch(f"optimizer state {key} has shape {tuple(value.shape)}, "
                                    f"parameter {index} has {tuple(params[index].shape)}")
            state.setdefault(index, {})[name] = value if adopt else value.clone()
        if isinstance(scalars, dict):
            for index_text, plain in scalars.items():
                index = int(index_text)
                if 0 <= index < len(params) and isinstance(plain, dict):
                    state.setdefault(index, {}).update(plain)
        return state
