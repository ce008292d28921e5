"""The dashboard HTTP port: health, readiness, metrics, rate-limit statistics, the operator page
and user management (a Klein app with injected dependencies)."""

from logbroker.dashboard._http import CappedConnections, DashboardSite
from logbroker.dashboard.app import BrokerNode, DashboardApp
from logbroker.dashboard.payload import NodeStatus

__all__ = ["BrokerNode", "CappedConnections", "DashboardApp", "DashboardSite", "NodeStatus"]
