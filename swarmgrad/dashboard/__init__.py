"""A window on a run: a web page, a JSON API and Prometheus metrics, served next to a client-mode
node that reads the run's presence and evaluation records on a fixed schedule. Names load on first use
(aiohttp and prometheus_client only when a dashboard starts)."""

from swarmgrad.lazy import lazy_exports

_EXPORTS = {
    "Dashboard": "swarmgrad.dashboard.server",
    "DashboardSettings": "swarmgrad.dashboard.settings",
    "RunState": "swarmgrad.dashboard.state",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
