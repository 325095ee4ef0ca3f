"""``sg.Peer``'s keywords: ``Peer(model, optimizer, config=..., peer=..., **options)`` takes
RunConfig's fields and PeerConfig's options by the names of their flags (``checkpoint_dir``,
``initial_peers``, ``upload_limit_mbps``) or whole sections (``timing=Timing(...)``), read from the
same index the command line's flags come from (peer/options.py)."""

from __future__ import annotations

import difflib
from typing import Any, Iterable

import pydantic

from swarmgrad.errors import ConfigError
from swarmgrad.peer.config import RunConfig
from swarmgrad.peer.options import PEER_OPTIONS
from swarmgrad.peer.peer_config import PeerConfig

Path_ = tuple[str, ...]


def option_paths() -> dict[str, Path_]:
    """Each keyword's name -> its field's path in PeerConfig: an option by its flag (``-`` read as
    ``_``: ``checkpoint_dir`` -> ``("checkpoints", "dir")``; the command line's own index, PEER_OPTIONS),
    a section by its own name (``timing``)."""
    index: dict[str, Path_] = {name: (name,) for name, info in PeerConfig.model_fields.items()
                               if isinstance(info.annotation, type) and issubclass(info.annotation, pydantic.BaseModel)}
    for option in PEER_OPTIONS.options:
        if option.root == "peer":
            index[option.flag_name.replace("-", "_")] = option.path
    return index


def with_options(peer: PeerConfig | None, options: dict[str, Any]) -> PeerConfig:
    """``peer`` (or the defaults) with ``options`` by name (``option_paths``): whole sections first,
    then single fields, so ``network=NodeConfig(...), initial_peers=[...]`` keeps both. An unknown
    name is a TypeError naming it."""
    index = option_paths()
    unknown = sorted(set(options) - set(index))
    if unknown:
        raise TypeError(unknown_options(unknown, index))
    data = peer.model_dump() if peer is not None else {}
    for name in sorted(options, key=lambda name: len(index[name])):
        *sections, leaf = index[name]
        target = data
        for section in sections:
            target = target.setdefault(section, {})
        value = options[name]
        target[leaf] = value.model_dump() if isinstance(value, pydantic.BaseModel) else value
    return PeerConfig(**data)


def unknown_options(names: list[str], known: Iterable[str]) -> str:
    hints = [f"{name!r}" + (f" (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(name, known, 1))
                            else "") for name in names]
    return (f"unknown option(s) {', '.join(hints)}: a peer takes RunConfig's fields, PeerConfig's sections and "
            "its options by their flag names (checkpoint_dir, initial_peers, upload_limit_mbps, ...)")


def peer_settings(config: RunConfig | None, peer: PeerConfig | None,
                  options: dict[str, Any]) -> tuple[RunConfig, PeerConfig]:
    """What ``sg.Peer(config=..., peer=..., **options)`` asks for: RunConfig's fields among ``options``
    join ``config`` (each given once: not also set there; None means not given), the rest go to
    ``peer`` by name (``with_options``)."""
    options = dict(options)
    run_fields = {name: options.pop(name) for name in list(options) if name in RunConfig.model_fields}
    given = {name: value for name, value in run_fields.items() if value is not None}
    if config is None:
        requested = RunConfig(**given)
    elif both := sorted(set(given) & config.model_fields_set):
        raise ConfigError(f"{', '.join(both)} given both in config= and as keyword(s): pass each once")
    else:
        requested = RunConfig(**{name: getattr(config, name) for name in config.model_fields_set}, **given) \
            if given else config
    return requested, with_options(peer, options)
