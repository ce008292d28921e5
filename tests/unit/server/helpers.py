"""The client port's guards for unit tests, built from a real config as the broker builds them."""

from __future__ import annotations

from collections.abc import Mapping

from twisted.internet.interfaces import IReactorTime

from logbroker.config import BrokerConfig
from logbroker.metrics import Metrics
from logbroker.security.guards import Guards
from logbroker.service import build_guards


def make_guards(
    clock: IReactorTime,
    settings: Mapping[str, str] | None = None,
    metrics: Metrics | None = None,
) -> Guards:
    """Test mode's guards (limiters off) unless ``settings`` (``SVC_*``) say otherwise, counting
    what they refuse in ``metrics``."""
    config, _ = BrokerConfig.from_env({"SVC_ENV": "test", **(settings or {})}, cwd="/")
    return build_guards(config, clock, metrics or Metrics(clock))
