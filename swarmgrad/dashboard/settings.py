"""What a dashboard is told: where it serves, and how often it reads the run's records from the DHT.

Light to import: the CLI reads these defaults for ``--help``.
"""

from __future__ import annotations

from typing import Annotated

import pydantic

from swarmgrad.settings import SettingsModel

Interval = Annotated[float, pydantic.Field(ge=0.5, le=600)]


class DashboardSettings(SettingsModel):
    """A dashboard's own settings (not the run's).

    The dashboard reads the DHT on a fixed schedule (presence every ``members_every`` s, evaluation
    records every ``evaluations_every`` s) and serves every page and API call from what it last
    read, so the swarm's cost does not grow with the people watching.
    """

    host: str = "127.0.0.1"  # 0.0.0.0 to let other machines open the page
    port: Annotated[int, pydantic.Field(ge=0, le=65535)] = 8080  # 0 picks a free port
    members_every: Interval = 2.0  # peers refresh presence every second; reading half as often is live enough
    evaluations_every: Interval = 5.0  # evaluations come every few seconds at most
    forget_after: Annotated[float, pydantic.Field(ge=0, le=86400)] = 60.0  # a peer that left stays (greyed) this long
    history_points: Annotated[int, pydantic.Field(ge=10, le=100_000)] = 1800  # one hour of run-wide curves at 2 s
    max_members: Annotated[int, pydantic.Field(ge=1, le=100_000)] = 1000  # rows kept; beyond, the stalest go
    max_evaluators: Annotated[int, pydantic.Field(ge=1, le=10_000)] = 64  # peers whose evaluations are kept
    results_per_evaluator: Annotated[int, pydantic.Field(ge=1, le=100_000)] = 500

    @property
    def reads_per_second(self) -> float:
        """The DHT reads this dashboard makes, whatever the number of pages open."""
        return 1 / self.members_every + 1 / self.evaluations_every


DEFAULT_DASHBOARD = DashboardSettings()
