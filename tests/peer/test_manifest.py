"""Unit tests of run manifests: creation, digest, compatibility, and which manifest a reader takes."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
from conftest import run_async

from swarmgrad.averaging.settings import Moshpit
from swarmgrad.errors import ConfigError, StartupError
from swarmgrad.peer.config import RunConfig
from swarmgrad.peer.manifest import RunManifest, check_compatible, manifest_key, read_manifest
from swarmgrad.peer.strategies.diloco import DiLoCo
from swarmgrad.version import __version__

# ---- run manifests --------------------------------------------------------------------------------


def manifest(task="digits", settings=None, fingerprint="fp", created_at=100.0, version=__version__) -> RunManifest:
    return RunManifest(task=task, settings=json.dumps(settings or {"strategy": {"name": "diloco"}}, sort_keys=True),
                       version=version, data_fingerprint=fingerprint, created_at=created_at)


def test_manifest_create_options_and_digest():
    config = RunConfig(task="digits", strategy=DiLoCo(inner_steps=5), averaging=Moshpit(group_size=4),
                       hparams={"lr": 0.1})
    created = RunManifest.create(config, "abc")
    assert created.version == __version__ and created.task == "digits" and created.data_fingerprint == "abc"
    assert created.options == json.loads(config.settings_json())
    assert created.run_config() == config
    assert abs(created.created_at - time.time()) < 60
    # the digest covers what is trained and how, not when
    assert RunManifest.create(config, "abc").digest == created.digest
    assert RunManifest.create(config.model_copy(update={"task": "charlm"}), "abc").digest != created.digest
    assert RunManifest.create(config.model_copy(update={"hparams": {"lr": 0.2}}), "abc").digest != created.digest
    assert RunManifest.create(config, "other").digest != created.digest
    assert RunManifest.create(config, None).digest != created.digest


@pytest.mark.parametrize("settings", ["not json", "[1, 2]", "3"])
def test_manifest_options_must_be_a_json_object(settings):
    bad = RunManifest(task="t", settings=settings, version=__version__, created_at=1.0)
    with pytest.raises(ConfigError):
        bad.options


def test_check_compatible():
    major, minor, *_ = __version__.split(".")
    check_compatible(manifest(), "digits", "fp")
    check_compatible(manifest(), None, None)
    check_compatible(manifest(fingerprint=None), "digits", "anything")
    check_compatible(manifest(version=f"{major}.{minor}.99"), "digits", "fp")
    with pytest.raises(StartupError, match="swarmgrad"):
        check_compatible(manifest(version=f"{major}.{int(minor) + 1}.0"), "digits", "fp")
    with pytest.raises(StartupError):
        check_compatible(manifest(version=f"{int(major) + 1}.{minor}.0"), "digits", "fp")
    with pytest.raises(StartupError, match="charlm"):
        check_compatible(manifest(), "charlm", "fp")
    with pytest.raises(StartupError, match="data"):
        check_compatible(manifest(), "digits", "other-fp")


class FakeManifestNode:
    def __init__(self, bodies):
        self.bodies, self.keys = bodies, []

    async def get_records(self, key, body_type):
        self.keys.append((key, body_type))
        return {f"peer{i}": SimpleNamespace(body=body) for i, body in enumerate(self.bodies)}


def choose(bodies) -> RunManifest | None:
    node = FakeManifestNode(bodies)
    chosen = run_async(read_manifest(node, "my-run"))
    assert node.keys == [(manifest_key("my-run"), RunManifest)]
    return chosen


def test_read_manifest_takes_the_most_votes_then_the_earliest():
    assert choose([]) is None
    old_minority = manifest(task="old", created_at=1.0)
    majority = [manifest(created_at=50.0), manifest(created_at=20.0), manifest(created_at=30.0)]
    chosen = choose([old_minority, *majority])
    assert chosen.task == "digits" and chosen.created_at == 20.0
    tie = choose([manifest(task="b", created_at=9.0), manifest(task="a", created_at=5.0),
                  manifest(task="b", created_at=12.0), manifest(task="a", created_at=7.0)])
    assert tie.task == "a" and tie.created_at == 5.0
