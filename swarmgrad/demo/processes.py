"""Child peer processes for the demo: started together, stopped gracefully, killed if they hang."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path

from swarmgrad.errors import StartupError
from swarmgrad.eventloop import timeout

logger = logging.getLogger(__name__)
STOP_GRACE_SECONDS = 10.0  # SIGTERM -> a peer leaves (each part of leaving has its own deadline), else SIGKILL


@dataclass
class ChildPeer:
    index: int
    process: asyncio.subprocess.Process
    log_path: Path
    peer_id: str | None = None
    maddrs: list[str] = field(default_factory=list)

    def log_tail(self, lines: int = 5) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class PeerProcesses:
    """``async with PeerProcesses(argv_list, log_dir) as peers:`` starts one process per argv.

    Each child prints a JSON line with its peer id when ready; stderr goes to a log file per child.
    On exit every child gets SIGTERM (a graceful leave), then SIGKILL after a grace period.
    """

    def __init__(self, commands: list[list[str]], log_dir: Path):
        self.commands, self.log_dir = commands, log_dir
        self.children: list[ChildPeer] = []

    async def __aenter__(self) -> PeerProcesses:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for index, argv in enumerate(self.commands):
                log_path = self.log_dir / f"peer-{index}.log"
                with open(log_path, "wb") as log:
                    process = await asyncio.create_subprocess_exec(
                        *argv, stdout=asyncio.subprocess.PIPE, stderr=log, stdin=asyncio.subprocess.DEVNULL
                    )
                self.children.append(ChildPeer(index, process, log_path))
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.stop()

    async def wait_ready(self, seconds: float) -> None:
        """Wait until every child has printed its peer id; a child that dies first is an error."""
        try:
            async with timeout(seconds):
                await asyncio.gather(*(self._read_ready(child) for child in self.children))
        except asyncio.TimeoutError:
            slow = [child for child in self.children if child.peer_id is None]
            raise StartupError(
                f"{len(slow)} peer process(es) did not join within {seconds:.0f} s; last log lines of peer "
                f"{slow[0].index} ({slow[0].log_path}):\n{slow[0].log_tail()}"
            ) from None

    async def _read_ready(self, child: ChildPeer) -> None:
        assert child.process.stdout is not None
        line = await child.process.stdout.readline()
        if not line:
            await child.process.wait()
            raise StartupError(
                f"peer process {child.index} exited with code {child.process.returncode} before joining; "
                f"last log lines ({child.log_path}):\n{child.log_tail()}"
            )
        ready = json.loads(line)
        child.peer_id, child.maddrs = ready["peer_id"], ready["maddrs"]

    async def stop(self) -> None:
        running = [child.process for child in self.children if child.process.returncode is None]
        for process in running:
            process.send_signal(signal.SIGTERM)
        if running:
            await asyncio.wait([asyncio.create_task(p.wait()) for p in running], timeout=STOP_GRACE_SECONDS)
            for process in running:
                if process.returncode is None:
                    logger.warning("peer process %d did not stop in time; killing it", process.pid)
                    process.kill()
                    await process.wait()

