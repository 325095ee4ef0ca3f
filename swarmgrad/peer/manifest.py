"""Public runs: a signed manifest in the DHT says what run R trains and how, so a volunteer joins
with nothing but the run id and one address.

The creator stores its ``RunManifest`` under ``swarmgrad/R/manifest``; every peer that trains
with it stores the same manifest in its own slot while it runs, so the run outlives its creator.
A reader takes the manifest most peers agree on, the earliest created on a tie.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import Counter
from typing import Annotated, Any, Callable

import pydantic

from swarmgrad.dht.config import check_run_id
from swarmgrad.dht.node import SwarmNode
from swarmgrad.dht.records import RecordBody, record_kind
from swarmgrad.dht.tickets import Ticket, check_run_key
from swarmgrad.errors import ConfigError, StartupError
from swarmgrad.peer.config import RunConfig, resolve_against_run
from swarmgrad.version import __version__

logger = logging.getLogger(__name__)

MANIFEST_TTL = 300.0
Text = Annotated[str, pydantic.Field(max_length=256)]


@record_kind
class RunManifest(RecordBody):
    kind = "manifest"
    max_ttl = 3600.0

    task: Text
    settings: Annotated[str, pydantic.Field(max_length=8192)]  # RunConfig.settings_json(): all but the task
    version: Annotated[str, pydantic.Field(max_length=32)]  # swarmgrad version of the creator
    data_fingerprint: Text | None = None
    created_at: Annotated[float, pydantic.Field(allow_inf_nan=False)]
    # a private run's key (dht/tickets.py: 64 hex digits): only peers with a ticket it signed are admitted
    run_key: Annotated[str, pydantic.Field(pattern="^[0-9a-f]{64}$")] | None = None

    @classmethod
    def create(cls, config: RunConfig, data_fingerprint: str | None, run_key: str | None = None) -> RunManifest:
        """The manifest of a run that trains ``config`` (its task included); private with ``run_key``."""
        if config.task is None:
            raise ConfigError("a run manifest needs the task the run trains")
        return cls(task=config.task, settings=config.settings_json(), version=__version__,
                   data_fingerprint=data_fingerprint, created_at=time.time(),
                   run_key=None if run_key is None else check_run_key(run_key))

    def run_config(self) -> RunConfig:
        """The run's settings, task included (what :meth:`create` was given); bad ones are a ConfigError."""
        return RunConfig.parse({**self.options, "task": self.task}, "the run manifest's settings are invalid")

    @property
    def options(self) -> dict[str, Any]:
        """The settings as a plain JSON object."""
        try:
            options = json.loads(self.settings)
        except json.JSONDecodeError as error:
            raise ConfigError(f"the run manifest's settings are not JSON: {error}") from None
        if not isinstance(options, dict):
            raise ConfigError("the run manifest's settings must be a JSON object")
        return options

    @property
    def digest(self) -> str:
        text = f"{self.task}\n{self.settings}\n{self.data_fingerprint}"
        if self.run_key is not None:  # a public run's digest is what it always was
            text += f"\n{self.run_key}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def manifest_key(run_id: str) -> str:
    return f"swarmgrad/{check_run_id(run_id)}/manifest"


async def publish_manifest(node: SwarmNode, run_id: str, manifest: RunManifest) -> None:
    if not await node.store(manifest_key(run_id), manifest, time.time() + MANIFEST_TTL):
        raise StartupError(f"could not store the manifest of run {run_id!r} in the DHT")


async def read_manifest(node: SwarmNode, run_id: str, run_key: str | None = None) -> RunManifest | None:
    """The manifest most peers of the run publish (earliest created on a tie), or None. With
    ``run_key`` (a ticket holder's), only those naming that key count while there is one: forged
    manifests, however many peers publish them, cannot make its private run look public."""
    records = await node.get_records(manifest_key(run_id), RunManifest)
    if not records:
        return None
    manifests = [record.body for record in records.values()]
    if run_key is not None and any(manifest.run_key == run_key for manifest in manifests):
        manifests = [manifest for manifest in manifests if manifest.run_key == run_key]
    votes = Counter(manifest.digest for manifest in manifests)
    best = max(votes.values())
    candidates = [manifest for manifest in manifests if votes[manifest.digest] == best]
    return min(candidates, key=lambda manifest: manifest.created_at)


async def wait_for_manifest(node: SwarmNode, run_id: str, seconds: float, run_key: str | None = None) -> RunManifest:
    deadline = time.monotonic() + seconds
    while True:
        manifest = await read_manifest(node, run_id, run_key)
        if manifest is not None:
            return manifest
        if time.monotonic() > deadline:
            raise StartupError(f"run {run_id!r} has no manifest in the DHT after {seconds:.0f} s: is the run id right, "
                               "and was it created with `swarmgrad peer TASK --run-id ... --create`?")
        await asyncio.sleep(0.5)  # a creator publishes within a second of starting


def check_compatible(manifest: RunManifest, task: str | None, data_fingerprint: str | None) -> None:
    """Refuse to join a run this peer cannot train correctly: other software, task or data."""
    if _major_minor(manifest.version) != _major_minor(__version__):
        raise StartupError(f"run was created with swarmgrad {manifest.version}; this is {__version__}. "
                           f"Install swarmgrad {'.'.join(_major_minor(manifest.version))}.x to join it")
    if task is not None and task != manifest.task:
        raise StartupError(f"run trains task {manifest.task!r}, not {task!r}; drop the task argument to use the run's")
    if manifest.data_fingerprint and data_fingerprint and manifest.data_fingerprint != data_fingerprint:
        raise StartupError(f"this peer's data ({data_fingerprint}) differs from the run's ({manifest.data_fingerprint}); "
                           "point --data-dir at the same dataset")


def check_admission(run_id: str, manifest: RunManifest | None, ticket: Ticket | None) -> None:
    """Refuse to join a private run without a ticket of its key, or a public one with a ticket
    (the peer meant to join a private run: the wrong run id, or the wrong initial peers)."""
    if manifest is None:
        return
    if manifest.run_key is not None and ticket is None:
        raise StartupError(f"run {run_id!r} is private (run key {manifest.run_key[:16]}...): its peers ignore "
                           "peers without a ticket; ask its creator for one (`swarmgrad run grant`) and pass --ticket")
    if ticket is not None and manifest.run_key is None:
        raise StartupError(f"run {run_id!r} is public, but this peer has a ticket for a private run: check the run "
                           "id, or drop --ticket")
    if ticket is not None and ticket.run_key != manifest.run_key:
        raise StartupError(f"this peer's ticket is signed by run key {ticket.run_key[:16]}..., not run {run_id!r}'s "
                           f"({manifest.run_key[:16]}...): ask its creator for a ticket")
    if ticket is not None and ticket.run_id is not None and ticket.run_id != run_id:
        raise StartupError(f"this peer's ticket is for run {ticket.run_id!r}, not {run_id!r}")


def settle_run(run_id: str, mine: RunConfig, manifest: RunManifest | None, *, create: bool,
               fingerprint: Callable[[str], str | None], ticket: Ticket | None = None) -> tuple[RunConfig, RunManifest | None]:
    """What this peer trains with, given the run's manifest (None: the run has none, or this is its
    first peer) and the manifest it keeps published. ``fingerprint(task)`` gives this peer's data
    fingerprint of a task (None: it cannot tell), asked for once the task is known to be right.

    Creating: this peer's settings, which must be the run's if it exists already. Joining: the
    run's settings, after checking that every one this peer chose agrees (RunConfigMismatch names
    each field and both values), and that this peer's software, task and data are the run's; without
    a manifest, this peer's own. A creator's ``ticket`` makes the run private, with the key that
    signed it; a joiner's must be for the run's key."""
    if create:
        if mine.task is None:
            raise ConfigError("--create needs the TASK to train")
        created = RunManifest.create(mine, fingerprint(mine.task), run_key=ticket.run_key if ticket is not None else None)
        if manifest is not None and manifest.digest != created.digest:
            raise StartupError(f"run {run_id!r} already exists with other settings (task {manifest.task!r}); "
                               "join it without --create, or pick another --run-id")
        return mine, manifest or created
    if manifest is None:
        if mine.task is not None:  # a task named and nobody told of it: the other peers cannot check theirs
            logger.warning("run %r has no manifest: training with this peer's settings (use --create to publish "
                           "them)", run_id)
        return mine, None
    check_admission(run_id, manifest, ticket)
    check_compatible(manifest, mine.task, None)  # other software or another task: refused before any data is read
    check_compatible(manifest, manifest.task, fingerprint(manifest.task))
    return resolve_against_run(run_id, mine, manifest.run_config()), manifest


async def settle_from_dht(node: SwarmNode, run_id: str, mine: RunConfig, handed: RunManifest | None, *, create: bool,
                          fingerprint: Callable[[str], str | None], ticket: Ticket | None = None,
                          wait: float | None = None) -> tuple[RunConfig, RunManifest | None]:
    """``settle_run`` with the manifest read through this peer's own node: the one ``handed`` over (a
    caller that publishes the run's), else the run's, waiting up to ``wait`` seconds for one (None: one
    read) where there are initial peers to read it from."""
    found = handed
    if found is None and node.config.initial_peers:
        run_key = ticket.run_key if ticket is not None else None
        found = await (read_manifest(node, run_id, run_key) if wait is None
                       else wait_for_manifest(node, run_id, wait, run_key))
    return settle_run(run_id, mine, found, create=create, fingerprint=fingerprint, ticket=ticket)


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(version.split(".")[:2])
