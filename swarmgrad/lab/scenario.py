"""Lab scenarios: a swarm, its access links and a churn schedule, read from a small TOML file.

A scenario names the task and the run options every peer shares (named as ``swarmgrad peer``'s
options, with underscores, and written to each peer's config file; one left out is RunConfig's
default), a time budget, the peers
with their links, and churn events::

    name = "home-broadband"
    description = "six peers on home connections"
    task = "fashion-mnist"
    duration = 240            # seconds of training per peer
    target_accuracy = 0.88    # peer 0 stops the run once a held-out evaluation reaches it
    strategy = "diloco"
    averaging = "moshpit"
    compression = "int8"
    inner_steps = 50

    [[peers]]                 # peer 0 (evaluates, ends the run; churn may not kill it)
    up_mbit = 10
    down_mbit = 50
    delay_ms = 20             # one way, to the lab's core
    loss = 0.005
    count = 2                 # peers 0 and 1

    [[peers]]
    up_mbit = 5
    down_mbit = 20
    slowdown = 3              # every local step takes 3x as long (slower hardware)
    nat = "home"              # behind a home router: none | home | symmetric | cgnat (lab/nat.py)
    start = false             # joins later, see churn

    [[churn]]
    at = "30%"                # of duration, or seconds; counted from the start of training
    action = "join"           # kill | restart | join
    peer = 2                  # index after `count` expansion

Peer indices count the expanded ``[[peers]]`` list. ``kill`` SIGKILLs a running peer (not peer 0),
``restart`` starts a killed peer again with its identity and checkpoint directory, ``join`` starts a
peer declared with ``start = false``. Rates left out mean no limit (TOML ``inf`` works too).

Every problem is a :class:`ConfigError` with one line that names the file and the field.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import pydantic

from swarmgrad.errors import ConfigError
from swarmgrad.lab.nat import NatType
from swarmgrad.lab.network import LinkSpec
from swarmgrad.peer.config import Hyperparameter, RunConfig, TaskOption
from swarmgrad.peer.options import PEER_OPTIONS, Given

MAX_LAB_PEERS = 64
QUICK_PEERS = 3
QUICK_DURATION = 30.0
QUICK_TASK = "digits"
# digits steps take ~2 ms: with diloco's usual 50 inner steps, epochs would be 0.1 s apart, far
# shorter than a round's matchmaking, and most epochs would end in a solo step. Epochs must also be
# longer than a catch-up (a peer that missed a round downloads the swarm's state: a few seconds),
# or a peer that misses one round never gets back in step (with 500, peer 0 sometimes never did).
QUICK_INNER_STEPS = 1500
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


class PeerSpec(_Strict):
    """One ``[[peers]]`` entry: an access link, emulated hardware speed, and when it starts."""

    up_mbit: float = pydantic.Field(math.inf, gt=0)
    down_mbit: float = pydantic.Field(math.inf, gt=0)
    delay_ms: float = pydantic.Field(0.0, ge=0, le=60_000)
    loss: float = pydantic.Field(0.0, ge=0, lt=1)
    slowdown: float = pydantic.Field(1.0, ge=1, le=100)
    count: int = pydantic.Field(1, ge=1, le=MAX_LAB_PEERS)
    start: bool = True
    label: str | None = pydantic.Field(None, max_length=20)
    nat: NatType = "none"  # routers in front of it (lab/nat.py)

    def link(self) -> LinkSpec:
        return LinkSpec(self.up_mbit, self.down_mbit, self.delay_ms, self.loss, self.nat)

    def describe(self) -> str:
        """``10/50 Mbit/s 20 ms 0.5%``: up/down, one-way delay, loss (and ``home NAT``, if any)."""
        link = f"{_rate(self.up_mbit)}/{_rate(self.down_mbit)} Mbit/s {self.delay_ms:g} ms {self.loss * 100:g}%"
        return link if self.nat == "none" else f"{link} {self.nat} NAT"


class ChurnSpec(_Strict):
    """One ``[[churn]]`` entry; ``at`` is seconds after training starts, or ``"N%"`` of the duration."""

    at: float | str
    action: Literal["kill", "restart", "join"]
    peer: int = pydantic.Field(ge=0)

    @pydantic.field_validator("at")
    @classmethod
    def _check_at(cls, value: float | str) -> float | str:
        if isinstance(value, str):
            match = _PERCENT.match(value)
            if not match or float(match.group(1)) > 100:
                raise ValueError(f"must be seconds or a percentage of duration like \"30%\", got {value!r}")
        elif not (math.isfinite(value) and value >= 0):
            raise ValueError(f"must be a non-negative number of seconds, got {value!r}")
        return value

    def seconds(self, duration: float) -> float:
        if isinstance(self.at, str):
            return float(_PERCENT.match(self.at).group(1)) / 100 * duration  # type: ignore[union-attr]
        return float(self.at)


@dataclass(frozen=True)
class ChurnEvent:
    """A churn entry resolved against the duration: ``at`` in seconds after training starts."""

    at: float
    action: str
    peer: int


class Scenario(_Strict):
    name: str
    description: str = ""
    task: str = "fashion-mnist"
    duration: float = pydantic.Field(180.0, gt=0, le=24 * 3600)
    target_accuracy: float | None = pydantic.Field(None, gt=0, le=1)
    eval_every: float = pydantic.Field(3.0, gt=0)
    eval_batches: int | None = pydantic.Field(None, ge=1)  # None: peer 0 evaluates on the whole test set
    # run options, passed through to `swarmgrad peer` flags and checked against RunConfig (None: its default)
    strategy: str | None = None
    averaging: str | None = None
    compression: str | None = None
    inner_steps: int | None = None
    outer_lr: float | None = None
    outer_momentum: float | None = None
    overlap: str | None = None
    target_batch_size: int | None = None
    gossip_every: int | None = None
    group_size: int | None = None
    lr: float | None = pydantic.Field(None, gt=0)
    batch_size: int | None = pydantic.Field(None, ge=1)
    task_options: dict[str, TaskOption] | None = None  # e.g. {size = "tiny", context = 64} for lm
    hparams: dict[str, Hyperparameter] | None = None
    # the lab itself
    mtu: int | None = pydantic.Field(None, ge=1500, le=65000)
    peers: list[PeerSpec] = pydantic.Field(min_length=1)
    churn: list[ChurnSpec] = []

    @pydantic.field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(f"must be letters, digits, '_', '.', '-' (at most 64), got {value!r}")
        return value

    @pydantic.model_validator(mode="after")
    def _check(self) -> Scenario:
        expanded = self.expanded_peers()
        if len(expanded) > MAX_LAB_PEERS:
            raise ValueError(f"at most {MAX_LAB_PEERS} peers, got {len(expanded)}")
        if not expanded[0].start:
            raise ValueError("peer 0 evaluates and ends the run: it must start with the run (start = true)")
        self.schedule()  # raises on an impossible churn schedule
        self.run_config  # raises on run options RunConfig refuses
        return self

    # -- derived --------------------------------------------------------------------------------

    def expanded_peers(self) -> list[PeerSpec]:
        """One entry per peer (``count`` expanded), in index order."""
        return [peer.model_copy(update={"count": 1}) for peer in self.peers for _ in range(peer.count)]

    @property
    def run_config(self) -> RunConfig:
        """What the scenario's peers train with: the run options it sets (read as `swarmgrad peer`
        reads them; an error names the scenario's key), the rest left to the run's defaults."""
        given = {}
        for name in type(self).model_fields:
            option = PEER_OPTIONS.by_key(name.replace("_", "-"))
            if option is not None and option.root == "run" and getattr(self, name) is not None:
                given[option] = Given(getattr(self, name), name)
        try:
            return PEER_OPTIONS.build_model("run", given)
        except ConfigError as error:
            raise ValueError(str(error)) from None

    @property
    def averaging_kind(self) -> str:
        return self.run_config.averaging.kind

    def schedule(self, duration: float | None = None) -> list[ChurnEvent]:
        """Churn events in time order, checked: each kill hits a running peer, each restart a killed one,
        each join a peer declared with ``start = false``, and every such peer joins at some point."""
        duration = self.duration if duration is None else duration
        peers = self.expanded_peers()
        events = sorted((ChurnEvent(spec.seconds(duration), spec.action, spec.peer) for spec in self.churn),
                        key=lambda event: event.at)  # stable: same-time events keep their file order
        state = ["running" if peer.start else "declared" for peer in peers]
        for event in events:
            where = f"churn {event.action} of peer {event.peer} at {event.at:g} s"
            if event.peer >= len(peers):
                raise ValueError(f"{where}: there is no peer {event.peer} (peers are 0..{len(peers) - 1})")
            if event.at > duration:
                raise ValueError(f"{where}: past the duration ({duration:g} s)")
            current = state[event.peer]
            if event.action == "kill":
                if event.peer == 0:
                    raise ValueError(f"{where}: peer 0 evaluates and ends the run, so churn may not kill it")
                if current != "running":
                    raise ValueError(f"{where}: the peer is not running then ({current})")
                state[event.peer] = "killed"
            elif event.action == "restart":
                if current != "killed":
                    raise ValueError(f"{where}: only a killed peer can restart (it is {current}); "
                                     "use join for a peer declared with start = false")
                state[event.peer] = "running"
            else:
                if current != "declared":
                    raise ValueError(f"{where}: join starts a peer declared with start = false (it is {current})")
                state[event.peer] = "running"
        never = [i for i, peer in enumerate(peers) if not peer.start and state[i] == "declared"]
        if never:
            raise ValueError(f"peer {never[0]} has start = false but no churn event joins it")
        return events

    def adjusted(self, *, duration: float | None = None, quick: bool = False) -> Scenario:
        """This scenario with another duration (churn in seconds stays put, percentages scale), or
        shrunk for CI with ``quick``: the digits task, at most :data:`QUICK_PEERS` peers (peer 0, one
        peer churn leaves alone, and the peers churn touches first, with their links), a short
        duration (``duration`` or :data:`QUICK_DURATION`) and no target accuracy, churn times scaled
        to it, and diloco rounds a few seconds apart."""
        data = self.model_dump()
        if quick:
            old = self.duration
            new = min(duration or QUICK_DURATION, old)
            peers = self.expanded_peers()
            churned = list(dict.fromkeys(event.peer for event in self.schedule()))
            # peer 0 and one peer churn never touches: two peers average from the first epoch, however
            # early the churn comes (at 30 s, a kill at 3 s and a joiner ready 20 s later on loaded
            # cores left peer 0 alone until the run's last round)
            steady = [i for i, peer in enumerate(peers) if i and peer.start and i not in churned][:1]
            keep = list(dict.fromkeys([0, *steady, *churned, *range(len(peers))]))
            keep = sorted(keep[:QUICK_PEERS])
            index = {old_index: new_index for new_index, old_index in enumerate(keep)}
            data["peers"] = [peers[i].model_dump() for i in keep]
            data["churn"] = [{"at": f"{min(100.0, spec.seconds(old) / old * 100):.4g}%", "action": spec.action,
                              "peer": index[spec.peer]} for spec in self.churn if spec.peer in index]
            # no target: digits passes any fashion-mnist target within seconds, before every peer
            # has averaged or any churn has happened; a quick run lasts its short duration
            data.update(task=QUICK_TASK, duration=new, name=self.name, target_accuracy=None, task_options=None)
            if self.run_config.strategy.name == "diloco":
                data["inner_steps"] = max(self.inner_steps or 0, QUICK_INNER_STEPS)
        elif duration is not None:
            data["duration"] = duration
        return validate_scenario(data, source=f"scenario {self.name}")


def _rate(mbit: float) -> str:
    return "∞" if not math.isfinite(mbit) else f"{mbit:g}"


# -- loading ------------------------------------------------------------------------------------


def validate_scenario(data: dict[str, Any], source: str) -> Scenario:
    """A Scenario from parsed TOML; any problem is one ConfigError line starting with ``source``."""
    try:
        return Scenario.model_validate(data)
    except pydantic.ValidationError as error:
        raise ConfigError(f"{source}: {_first_problem(error)}") from None


def _first_problem(error: pydantic.ValidationError) -> str:
    problem = error.errors()[0]
    location = ".".join(f"[{part}]" if isinstance(part, int) else str(part) for part in problem["loc"])
    location = location.replace(".[", "[")
    kind, message = problem["type"], problem["msg"]
    if kind == "extra_forbidden":
        *parent, key = problem["loc"]
        model = _model_at(parent)
        allowed = ", ".join(model.model_fields) if model is not None else ""
        where = ".".join(map(str, parent))
        return f"unknown key {key!r}{f' in {where}' if where else ''}" + (f" (known: {allowed})" if allowed else "")
    if kind == "missing":
        return f"{location}: missing (required)"
    if kind == "value_error":
        message = message.removeprefix("Value error, ")
    got = problem.get("input")
    if kind not in ("value_error", "model_type", "list_type", "dict_type") and not isinstance(got, (dict, list)):
        message += f" (got {got!r})"
    return f"{location}: {message}" if location else message


def _model_at(path: list[Any]) -> type[pydantic.BaseModel] | None:
    if not path:
        return Scenario
    if path[0] == "peers":
        return PeerSpec
    if path[0] == "churn":
        return ChurnSpec
    return None


def parse_scenario(text: str, *, source: str = "scenario", default_name: str | None = None) -> Scenario:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ConfigError("reading lab scenarios needs Python 3.11+ (tomllib) or `pip install tomli`") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{source}: not valid TOML: {error}") from None
    if default_name is not None:
        data.setdefault("name", default_name)
    return validate_scenario(data, source)


def scenarios_dir() -> Any:
    return resources.files("swarmgrad.lab").joinpath("scenarios")


def builtin_scenarios() -> dict[str, str]:
    """Built-in scenario names and their one-line descriptions."""
    found = {}
    for entry in sorted(scenarios_dir().iterdir(), key=lambda item: item.name):
        if entry.name.endswith(".toml"):
            name = entry.name.removesuffix(".toml")
            scenario = parse_scenario(entry.read_text(), source=f"built-in scenario {name}", default_name=name)
            found[name] = scenario.description.strip().splitlines()[0] if scenario.description.strip() else ""
    return found


def load_scenario(name_or_path: str | Path) -> Scenario:
    """A built-in scenario by name (see :func:`builtin_scenarios`), or a TOML file by path."""
    text = str(name_or_path)
    path = Path(text)
    if path.suffix == ".toml" or path.exists() or "/" in text:
        try:
            content = path.read_text()
        except OSError as error:
            raise ConfigError(f"cannot read scenario {text}: {error.strerror or error}") from None
        return parse_scenario(content, source=str(path), default_name=path.stem)
    entry = scenarios_dir().joinpath(f"{text}.toml")
    if not entry.is_file():
        known = ", ".join(sorted(name.name.removesuffix(".toml") for name in scenarios_dir().iterdir()
                                 if name.name.endswith(".toml")))
        raise ConfigError(f"unknown scenario {text!r}: give a .toml file or one of: {known}")
    return parse_scenario(entry.read_text(), source=f"built-in scenario {text}", default_name=text)


__all__ = ["ChurnEvent", "ChurnSpec", "PeerSpec", "Scenario", "builtin_scenarios", "load_scenario",
           "parse_scenario", "validate_scenario"]
