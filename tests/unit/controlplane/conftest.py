"""Fixtures of the control plane's contract suites: one backend per implementation."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_twisted

from logbroker.controlplane import ControlPlane
from tests.etcd import etcd_cluster, secured_etcd_cluster  # noqa: F401 (fixtures)
from tests.unit.controlplane.backends import (
    Backend,
    LocalBackend,
    MemoryEtcdBackend,
    RealEtcdBackend,
)


@pytest_twisted.async_yield_fixture(
    params=[
        "local",
        "memory-etcd",
        pytest.param("etcd", marks=pytest.mark.integration),
        # TLS with a client certificate, as an etcd user whose role reaches /logbroker/ only.
        pytest.param("secured-etcd", marks=pytest.mark.integration),
    ]
)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    made: Backend
    if request.param == "local":
        made = LocalBackend()
    elif request.param == "memory-etcd":
        made = MemoryEtcdBackend()
    elif request.param == "etcd":
        made = RealEtcdBackend(request.getfixturevalue("etcd_cluster"))
    else:
        made = RealEtcdBackend(request.getfixturevalue("secured_etcd_cluster"))
    yield made
    await made.close()


@pytest_twisted.async_fixture
async def control(backend: Backend) -> ControlPlane:
    return await backend.open()
