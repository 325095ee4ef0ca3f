"""The web dashboard of a run: one HTML page, a JSON API under ``/api/``, and ``/metrics``.

    async with Dashboard("my-run", NodeConfig(initial_peers=[...], client_mode=True)) as board:
        print(board.url)

The dashboard is a client-mode node of the run that announces itself as a ``monitor``. Its
collector reads the DHT on a fixed schedule; every request is answered from that cache, so pages,
API calls and scrapes cost the swarm nothing. The page and its chart library are package files:
it works with no internet.
"""

from __future__ import annotations

import contextlib
import errno
import json
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from swarmgrad.dashboard.collector import Collector
from swarmgrad.dashboard.metrics import RunMetrics
from swarmgrad.dashboard.settings import DEFAULT_DASHBOARD, DashboardSettings
from swarmgrad.dashboard.state import RunState
from swarmgrad.dht.config import NodeConfig, check_run_id
from swarmgrad.dht.membership import Membership
from swarmgrad.dht.node import SwarmNode
from swarmgrad.errors import ConfigError
from swarmgrad.version import __version__

STATIC = Path(__file__).parent / "static"
SHUTDOWN_SECONDS = 2.0  # open page requests are answered in milliseconds
# the page loads only its own files: a peer's strings (versions, addresses) can never pull in a script
PAGE_POLICY = "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"


class Dashboard:
    def __init__(self, run_id: str, network: NodeConfig, settings: DashboardSettings = DEFAULT_DASHBOARD):
        self.run_id, self.settings = check_run_id(run_id), settings
        self.state = RunState(self.run_id, settings, started_at=time.time())
        self.node = SwarmNode(network)
        self.collector = Collector(self.node, self.state)
        self.metrics = RunMetrics(self.state, self.collector)
        self.url = ""
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Dashboard:
        try:
            await self._serve()  # first: a port in use is an error before any daemon starts
            await self._stack.enter_async_context(self.node)
            await self._stack.enter_async_context(Membership(self.node, self.run_id, role="monitor"))
            await self._stack.enter_async_context(self.collector)
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self._stack.aclose()

    async def _serve(self) -> None:
        runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=SHUTDOWN_SECONDS)
        await runner.setup()
        self._stack.push_async_callback(runner.cleanup)
        host, port = self.settings.host, self.settings.port
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise ConfigError(f"port {port} on {host} is in use; pick another with --port, "
                                  "or 0 for any free port") from None
            raise ConfigError(f"cannot serve the dashboard on {host}:{port}: {error.strerror or error}") from None
        bound_host, bound_port = runner.addresses[0][:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        self.url = f"http://{shown}:{bound_port}/"

    # ---- the web application --------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_headers])
        app.router.add_get("/", self._page)
        app.router.add_get("/api/run", self._run)
        app.router.add_get("/api/members", self._members)
        app.router.add_get("/api/history", self._history)
        app.router.add_get("/api/evaluations", self._evaluations)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_static("/static/", STATIC, follow_symlinks=False)
        return app

    def run_json(self) -> dict[str, Any]:
        now, collector = time.time(), self.collector
        return {
            "run_id": self.run_id, "version": __version__, "now": now, "started_at": self.state.started_at,
            "message": self.state.message(now), "refresh_seconds": self.settings.members_every,
            "members_read_at": self.state.members_read_at, "evaluations_read_at": self.state.evaluations_read_at,
            "summary": self.state.summary(now), "members": self.state.members_json(now),
            "dht": {"reads": dict(collector.reads), "failed_reads": collector.failed_reads,
                    "reads_per_second": collector.reads_per_second,
                    "scheduled_reads_per_second": self.settings.reads_per_second},
        }

    async def _page(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "index.html", headers={"Content-Security-Policy": PAGE_POLICY,
                                                                "Cache-Control": "no-cache"})

    async def _run(self, request: web.Request) -> web.Response:
        return _json(self.run_json())

    async def _members(self, request: web.Request) -> web.Response:
        return _json({"now": time.time(), "members": self.state.members_json(time.time())})

    async def _history(self, request: web.Request) -> web.Response:
        return _json(self.state.history_json())

    async def _evaluations(self, request: web.Request) -> web.Response:
        return _json({"evaluators": self.state.evaluations_json()})

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _json(data: Any) -> web.Response:
    # the state holds finite numbers only; allow_nan=False makes a slip a loud error, not invalid JSON
    return web.json_response(data, dumps=lambda value: json.dumps(value, allow_nan=False),
                             headers={"Cache-Control": "no-store"})


@web.middleware
async def _headers(request: web.Request, handler: Any) -> web.StreamResponse:
    response = await handler(request)
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    return response
