"""No constructor in the package takes more than 12 parameters, and ``Peer`` at most 8 besides its
``**overrides``: a longer one is several settings that belong in one object (hivemind's 30-argument
constructors are what this keeps out). Read from the source with ast, so it counts every class,
imported or not. A dataclass's or settings model's fields are not counted: they are records, not
constructors with parameters to wire."""

from __future__ import annotations

import ast
from pathlib import Path

import swarmgrad

PACKAGE = Path(swarmgrad.__file__).resolve().parent
MAX_PARAMETERS = 12
MAX_PEER_PARAMETERS = 8  # besides **overrides


def constructors() -> dict[str, ast.arguments]:
    """``module.Class`` -> the arguments of its ``__init__``, for every class of the package that defines one."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                        found[f"{module}.{node.name}"] = item.args
    return found


def parameters(args: ast.arguments, count_kwargs: bool = True) -> int:
    """Every parameter but ``self``; ``*args`` and ``**kwargs`` count one each (``count_kwargs``: the latter too)."""
    named = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs) - 1
    return named + (args.vararg is not None) + (count_kwargs and args.kwarg is not None)


def test_the_walk_finds_the_constructors():
    found = constructors()
    assert {"swarmgrad.averaging.moshpit.Averager", "swarmgrad.averaging.allreduce.GroupAllReduce",
            "swarmgrad.peer.peer.Peer"} <= set(found)
    assert parameters(found["swarmgrad.averaging.allreduce.GroupAllReduce"]) >= 10  # counted, not skipped


def test_no_constructor_takes_more_than_12_parameters():
    # Peer has its own, stricter check below
    too_long = {name: parameters(args) for name, args in constructors().items()
                if name != "swarmgrad.peer.peer.Peer" and parameters(args) > MAX_PARAMETERS}
    assert too_long == {}, f"group what belongs together into a settings object: {too_long}"


def test_peer_takes_at_most_8_parameters_besides_its_overrides():
    # Peer is reworked into a façade over one composition root (issue 34, item 3) on its own branch:
    # this fails until that lands
    peer = constructors()["swarmgrad.peer.peer.Peer"]
    assert parameters(peer, count_kwargs=False) <= MAX_PEER_PARAMETERS, parameters(peer, count_kwargs=False)
