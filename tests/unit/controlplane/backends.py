"""Every ControlPlane implementation on a backing store of its own, for the contract suite.

A backend opens control planes (``open``: a new, started instance on the same backing store,
which is what reopening means for each of them) and closes them all at the end of the test.
``synchronous`` backends answer within the call, so a test may also check that a Deferred has
fired at once.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from typing import Protocol

from twisted.internet.task import Clock

from logbroker.controlplane import (
    ControlPlane,
    EtcdControlPlane,
    EtcdGatewayStore,
    LocalControlPlane,
)
from logbroker.testing import ImmediateExecutor, MemoryFileSystem, MemoryKeyValueStore
from tests.etcd import EtcdCluster
from tests.unit.controlplane.helpers import CONTROL_DIR

#: The parametrization of the contract suites; "etcd" and "secured-etcd" need real clusters.
BACKENDS = ["local", "memory-etcd", "etcd", "secured-etcd"]


class Backend(Protocol):
    synchronous: bool

    def unstarted(self) -> ControlPlane: ...

    async def open(self) -> ControlPlane: ...

    async def reopen(self, control: ControlPlane) -> ControlPlane:
        """Close ``control``; a new instance on the same backing store."""

    async def close(self) -> None: ...


class _Opened(ABC):
    synchronous = True

    def __init__(self) -> None:
        self.opened: list[ControlPlane] = []

    @abstractmethod
    def unstarted(self) -> ControlPlane:
        """A new control plane on this backend's store, not started yet."""

    async def open(self) -> ControlPlane:
        control = self.unstarted()
        await control.start()
        return control

    async def reopen(self, control: ControlPlane) -> ControlPlane:
        await control.close()
        return await self.open()

    async def _close_all(self) -> None:
        for control in self.opened:
            await control.close()


class LocalBackend(_Opened):
    """``LocalControlPlane`` on a file system in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.fs = MemoryFileSystem()

    def unstarted(self) -> LocalControlPlane:
        control = LocalControlPlane(CONTROL_DIR, fs=self.fs, executor=ImmediateExecutor())
        self.opened.append(control)
        return control

    async def close(self) -> None:
        await self._close_all()


class MemoryEtcdBackend(_Opened):
    """``EtcdControlPlane`` on the etcd double, all on one ``Clock``."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.store = MemoryKeyValueStore(self.clock)

    def unstarted(self) -> EtcdControlPlane:
        control = EtcdControlPlane(self.store, prefix="/logbroker/test/", clock=self.clock)
        self.opened.append(control)
        return control

    async def close(self) -> None:
        await self._close_all()
        assert self.store.watch_count == 0
        assert self.clock.getDelayedCalls() == []


class RealEtcdBackend(_Opened):
    """``EtcdControlPlane`` on the real etcd cluster, under a prefix of the test's own."""

    synchronous = False

    def __init__(self, cluster: EtcdCluster) -> None:
        from twisted.internet import reactor

        super().__init__()
        self.reactor = reactor
        # Over TLS and as an etcd user when the cluster is secured.
        self.store: EtcdGatewayStore = cluster.store(reactor)
        self.prefix = f"/logbroker/test-{uuid.uuid4().hex}/"

    def unstarted(self) -> EtcdControlPlane:
        control = EtcdControlPlane(self.store, prefix=self.prefix, clock=self.reactor)  # type: ignore[arg-type]
        self.opened.append(control)
        return control

    async def close(self) -> None:
        await self._close_all()
        await self.store.delete_prefix(self.prefix.encode())
        await self.store.close()
