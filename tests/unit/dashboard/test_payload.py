"""Rates from successive counter samples, and the shape of ``/rate_limits``, without HTTP."""

from __future__ import annotations

import pytest
from twisted.internet.task import Clock

from logbroker.config import RateLimit
from logbroker.dashboard.payload import RateMeter, rate_limits_payload
from logbroker.security.ratelimit import Action, RateLimiter


def test_the_first_sample_has_no_rate_the_next_one_does() -> None:
    meter: RateMeter[str] = RateMeter()
    assert meter.rates(100.0, {"a": 5}) is None
    assert meter.rates(101.5, {"a": 20, "b": 3}) == {"a": 10.0, "b": 2.0}


def test_rates_follow_a_change_within_the_window() -> None:
    meter: RateMeter[str] = RateMeter(window=5.0, min_interval=0.5)
    seen = {}
    for t in range(11):
        # 10 per second for five seconds, then nothing.
        seen[t] = meter.rates(float(t), {"a": 10 * min(t, 5)})
    assert seen[1] == {"a": 10.0}
    assert seen[5] == {"a": 10.0}
    assert seen[6] == {"a": 8.0}  # over 1..6
    assert seen[10] == {"a": 0.0}  # over 5..10


def test_after_an_idle_spell_the_first_look_has_no_rate_rather_than_an_average() -> None:
    meter: RateMeter[str] = RateMeter(window=5.0)
    meter.rates(0.0, {"a": 0})
    assert meter.rates(60.0, {"a": 6000}) is None
    assert meter.rates(62.0, {"a": 6100}) == {"a": 50.0}


def test_samples_closer_than_the_minimum_interval_are_not_kept() -> None:
    meter: RateMeter[str] = RateMeter(window=1.0, min_interval=0.5)
    meter.rates(0.0, {"a": 0})
    assert meter.rates(0.3, {"a": 90}) == {"a": 300.0}
    # Had the sample at 0.3 been kept, it would be the base now (10 per second).
    assert meter.rates(1.3, {"a": 100}) == {"a": pytest.approx(100 / 1.3)}


def test_rate_limits_payload_has_the_five_top_blocked_keys_and_three_configs() -> None:
    limiter = RateLimiter(
        {
            Action.AUTH: RateLimit(1, 1000),
            Action.DASHBOARD_AUTH: RateLimit(1, 1000),
            Action.PUBLISH: RateLimit(5, 2000),
            Action.SUBSCRIBE: RateLimit(6, 3000),
        },
        enabled=True,
        clock=Clock(),
    )
    for _ in range(3):
        limiter.check("10.0.0.1", Action.AUTH)
        limiter.check("10.0.0.2", Action.DASHBOARD_AUTH)

    payload = rate_limits_payload(limiter)

    assert payload == {
        "enabled": True,
        "top_blocked": {
            "auth": [["10.0.0.1", 2]],
            "publish": [],
            "subscribe": [],
            "channel_publish": [],
            "channel_subscribe": [],
        },
        "config": {
            "auth": {"limit": 1, "window_ms": 1000},
            "publish": {"limit": 5, "window_ms": 2000},
            "subscribe": {"limit": 6, "window_ms": 3000},
        },
    }
