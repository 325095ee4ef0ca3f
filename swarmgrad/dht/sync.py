"""SyncNode: a swarm node for ordinary (non-async) scripts; its loop runs in a background thread."""

from __future__ import annotations

from swarmgrad.dht.membership import DEFAULT_TTL, Member, Membership, Role, list_members
from swarmgrad.dht.node import NodeConfig, SwarmNode
from swarmgrad.eventloop import BackgroundLoop


class SyncNode:
    """``with SyncNode(config, run_id="r") as node: node.members()``.

    With a ``run_id`` the node announces itself as a member of that run while it is open.
    """

    def __init__(
        self, config: NodeConfig | None = None, *, run_id: str | None = None, role: Role = "peer", ttl: float = DEFAULT_TTL
    ):
        self.node = SwarmNode(config)
        self.run_id = run_id
        self._membership = Membership(self.node, run_id, role=role, ttl=ttl) if run_id is not None else None
        self._background: BackgroundLoop | None = None

    @property
    def peer_id(self) -> str:
        return self.node.peer_id

    @property
    def maddrs(self) -> list[str]:
        return self.node.maddrs

    def __enter__(self) -> SyncNode:
        self._background = BackgroundLoop()
        try:
            self._background.run(self._start())
        except BaseException:
            self._background.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def members(self, run_id: str | None = None) -> list[Member]:
        """Live members of ``run_id`` (default: the run this node joined)."""
        run_id = run_id or self.run_id
        if run_id is None:
            raise ValueError("no run id: pass one, or open the node with run_id=...")
        return self._loop().run(list_members(self.node, run_id))

    def update(self, *, step: int | None = None, samples_per_second: float | None = None) -> None:
        """Progress that the next membership heartbeat announces."""
        if self._membership is not None:
            self._loop().loop.call_soon_threadsafe(lambda: self._membership.update(step=step, samples_per_second=samples_per_second))

    def close(self) -> None:
        if self._background is None:
            return
        try:
            self._background.run(self._stop(), timeout=30)  # a leave record, then the node (10 s bound each)
        finally:
            self._background.close()
            self._background = None

    async def _start(self) -> None:
        await self.node.start()
        if self._membership is not None:
            try:
                await self._membership.__aenter__()
            except BaseException:
                await self.node.shutdown()
                raise

    async def _stop(self) -> None:
        try:
            if self._membership is not None:
                await self._membership.__aexit__(None, None, None)
        finally:
            await self.node.shutdown()

    def _loop(self) -> BackgroundLoop:
        if self._background is None:
            raise RuntimeError("the node is not open; use `with SyncNode(...) as node:`")
        return self._background
