"""The composition root: builds the service tree ``twistd logbroker`` runs.

This is the only module (with the plugin's ``makeService``) that wires the real reactor.

Start order. Before the reactor runs (``build_service``): every range log is recovered and the
control plane is loaded, so a broker whose data cannot be read never serves; the client port is
bound (a port in use stops the boot with status 2 naming ``SVC_TCP_PORT``) but does not accept
yet; the dashboard port is bound too (``SVC_DASHBOARD_PORT``) and serves as soon as the reactor
runs, so ``/health`` answers while the broker starts and ``/ready`` says when it serves. Once the
reactor runs: the writer threads start, the standard accounts are seeded, every
range the control plane knows is opened, and only then are clients accepted (``svc_ready`` 1).

Stop order is the reverse: the client port stops accepting (``svc_ready`` 0, ``/ready`` 503) and
its connections drain (requests in flight are answered, or failed after a grace period), the
dashboard port stops, the periodic tasks end their runs in progress, the seals behind the
appends end (so that the control plane records each), then the control plane flushes, and the
store closes last, after every queued append has been flushed and fsynced.

A cluster member (``logbroker.node_modes``) adds its part at three places: its membership, peer
links and chores start right after the control plane and stop right before it (the node leaves
the cluster before its metadata is flushed); its shared sessions start before the listeners and
stop after them; its peer port is bound between the dashboard port and the client port, and
closes between them. It accepts clients once it is registered under its lease.

One ``Metrics`` holds every series; the range logs, the broker, the guards and the periodic tasks
feed it, the dashboard port serves it, and ``BrokerService.metrics`` exposes it to an embedder.
"""

from __future__ import annotations

import errno
import gc
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import attrs
from twisted.application.service import MultiService, Service
from twisted.internet import tcp
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import Deferred, DeferredList, ensureDeferred, maybeDeferred, succeed
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IListeningPort, IProtocolFactory, IReadDescriptor
from twisted.internet.posixbase import PosixReactorBase
from twisted.logger import Logger
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure

from logbroker import exitcodes
from logbroker.broker.core import Broker, BrokerSettings
from logbroker.broker.segments import SegmentRecorder
from logbroker.config import ANY_ADDRESS, BrokerConfig, ConfigError, FsyncScope
from logbroker.config import ControlPlane as ControlPlaneKind
from logbroker.controlplane import ControlPlane, ControlPlaneAccessError
from logbroker.dashboard import (
    BrokerNode,
    CappedConnections,
    DashboardApp,
    DashboardSite,
    NodeStatus,
)
from logbroker.errors import LogbrokerError
from logbroker.maintenance.periodic import PeriodicTask
from logbroker.maintenance.retention import RetentionRule, RetentionTask
from logbroker.maintenance.scrub import NoOtherCopy, Scrubber, ScrubTask
from logbroker.maintenance.view import MaintenanceView, RetentionStatus, ScrubStatus
from logbroker.metrics import Metrics, ReactorLagProbe
from logbroker.node_modes import ClusterMember, NodeMode, SingleNode, port_number
from logbroker.security import UserDirectory, seed_accounts
from logbroker.security.connections import ConnectionRegistry
from logbroker.security.guards import Guards
from logbroker.security.ratelimit import Action, RateLimiter
from logbroker.security.sessions import SessionStore
from logbroker.security.tls import ServerTls
from logbroker.security.verified import VerifiedPasswords
from logbroker.server.protocol import ClientFactory, ProtocolSettings
from logbroker.storage import (
    BATCH_ENCODER,
    SYNC_THREAD,
    DataDirectory,
    FileSystem,
    IntegrityEvent,
    LogConfig,
    NativeRounds,
    OpenFiles,
    OpenOnce,
    OsFileSystem,
    RangeLog,
    SegmentInfo,
    SharedFlush,
    ThreadPoolExecutor,
    close_each,
    shared_sync_refusal,
)
from logbroker.storage.file_limit import FileLimit, raise_file_limit
from logbroker.wire import Reason
from logbroker.wire.primitives import RECORD_DECODER

log = Logger()

#: How often range logs out of service after a write or fsync failed are tried again.
STORAGE_RECOVERY_SECONDS = 5.0

#: How long CPython lets one thread run before a thread waiting for the GIL may take it. Writes
#: and fsyncs run on writer threads, which need the GIL for a moment between ``write`` and
#: ``fdatasync`` and again to hand their result back; at CPython's default of 5 ms, a burst of
#: reactor work (encoding, acknowledging) left the disk idle for a quarter of the time at batch
#: 1000. At 0.5 ms the wait is bounded well below one fsync. See bench/RESULTS.md.
GIL_SWITCH_INTERVAL_SECONDS = 0.0005
#: How often the reactor-lag probe runs.
REACTOR_LAG_INTERVAL_SECONDS = 1.0
#: The cyclic garbage collector's thresholds (CPython's default is 700, 10, 10). A node with
#: thousands of ranges keeps a few hundred thousand objects, and every full collection walks
#: them all with the reactor stopped: 100-800 ms each, every few seconds during a failover at
#: 1,000 topics (5 s of pauses per node in one run, and sign-ins stalled behind them). A young
#: collection every 50,000 net allocations (tens of milliseconds) and older ones less often cut
#: that to about 0.9 s (decision 0012).
GC_THRESHOLDS = (50_000, 20, 20)


def configure_interpreter() -> None:
    """Process-wide interpreter settings the broker runs with (called by the composition root
    and by the benchmarks, so that they measure what the broker does)."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_SECONDS)
    gc.set_threshold(*GC_THRESHOLDS)


class StorageService(Service):
    """Owns the writer threads and every open range log of the data directory; the logs report
    integrity events and flushes to ``metrics``. The logs keep no more segment files open
    between them than ``file_limit`` leaves room for (the least recently used idle ones are
    closed past it, and opened again at their next use)."""

    def __init__(
        self,
        reactor: Any,
        data_dir: DataDirectory,
        fs: FileSystem,
        log_config: LogConfig,
        metrics: Metrics,
        file_limit: FileLimit | None = None,
        shared_flush: bool = False,
    ) -> None:
        self._reactor = reactor
        self._data_dir = data_dir
        self._fs = fs
        self._log_config = log_config
        self._metrics = metrics
        self._executor = ThreadPoolExecutor(reactor)
        # Reads get threads of their own: a fetch never waits for a free writer thread.
        self._reader = ThreadPoolExecutor(reactor, threads=2, name="logbroker-reads")
        # The seals behind the appends read back whole segments (64 MiB each by default),
        # several at once when a topic's ranges roll together: one at a time, on a thread of
        # their own, they never hold every writer thread while a new segment waits to start.
        self._sealer = ThreadPoolExecutor(reactor, threads=1, name="logbroker-seals")
        self._pools = [self._executor, self._reader, self._sealer]
        #: With it, one sync makes every range's writes durable together (``fs`` decides how),
        #: on a thread of its own: a flush never waits behind a long job (a healing copy's
        #: install, a verification) for a writer thread.
        self._shared_flush: SharedFlush | None = None
        #: The shared flush's rounds on a native thread, without the GIL, where it is built
        #: (decision 0027); the thread pool runs the rounds it cannot take.
        self._native_rounds: NativeRounds | None = None
        if shared_flush:
            flusher = ThreadPoolExecutor(reactor, threads=1, name="logbroker-flush")
            if SYNC_THREAD == "native" and isinstance(fs, OsFileSystem):
                self._native_rounds = NativeRounds(reactor, fs, flusher)
            self._shared_flush = SharedFlush(fs, flusher, reactor, self._native_rounds)
            self._pools.append(flusher)
        #: Keeps the segment files the logs hold open within the descriptors the limit
        #: leaves, closing idle ones on a writer thread.
        self._open_files: OpenFiles | None = None
        if file_limit is not None:
            self._open_files = OpenFiles(
                file_limit.max_open_files,
                lambda handles: self._executor.run(close_each, handles),
            )
        self.logs: dict[str, RangeLog] = {}
        self._opener = OpenOnce(
            self.logs,
            lambda name: RangeLog.open(
                self._data_dir.range_path(name), **self._log_arguments(name)
            ),
        )
        #: Told of every seal, with the range's name: the control plane records them.
        self.on_sealed: Callable[[str, SegmentInfo], None] = lambda name, info: None
        #: Told of every finding about stored data, with the range's name, once counted: a
        #: cluster node repairs a damaged sealed copy at once.
        self.on_damage: Callable[[str, IntegrityEvent], None] = lambda name, event: None

    def _integrity_event(self, name: str, event: IntegrityEvent) -> None:
        self._metrics.integrity_event(event)
        self.on_damage(name, event)

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The writer threads (started and stopped with this service)."""
        return self._executor

    def recover(self) -> None:
        """Recover every range of the data directory, in this thread. Blocking: call it before
        the reactor runs. Raises what recovery raises (``StorageError``, ``OSError``)."""
        started = time.monotonic()
        names = self._data_dir.range_names()
        for name in names:
            self.logs[name] = RangeLog.recover(
                self._data_dir.range_path(name), **self._log_arguments(name)
            )
        log.info(
            "Storage recovered in {path}: {ranges} ranges in {seconds:.3f} s",
            path=self._data_dir.path,
            ranges=len(self.logs),
            seconds=time.monotonic() - started,
        )

    def open_range(self, name: str) -> Deferred[RangeLog]:
        """Open (creating if new) the log of range ``name`` while the broker runs; once,
        however many ask at once."""
        return self._opener.open_range(name)

    def return_to_service(self) -> Deferred[None]:
        """Try each range log out of service since a write or fsync failed (a full or failing
        disk): each takes appends again once a probe write and fsync succeed."""
        return Deferred.fromCoroutine(self._return_to_service())

    async def _return_to_service(self) -> None:
        for range_log in [log for log in self.logs.values() if log.failed]:
            await range_log.return_to_service()

    def _log_arguments(self, name: str) -> dict[str, Any]:
        return {
            "fs": self._fs,
            "clock": self._reactor,
            "executor": self._executor,
            "reader": self._reader,
            "sealer": self._sealer,
            "config": self._log_config,
            "on_integrity_event": lambda event: self._integrity_event(name, event),
            "on_flushed": self._metrics.flushed,
            "on_sealed": lambda info: self.on_sealed(name, info),
            "shared_flush": self._shared_flush,
            "open_files": self._open_files,
        }

    def startService(self) -> None:
        super().startService()
        for pool in self._pools:
            pool.start()
        if self._native_rounds is not None:
            self._native_rounds.start()
        # Once the reactor runs (signal handlers in place), the store serves.
        self._reactor.callWhenRunning(
            log.info,
            "Storage ready: {ranges} ranges open (their segment files kept open: at most"
            " {room}), {encoder} batch encoder,"
            " {decoder} record decoder, {flush}",
            ranges=len(self.logs),
            flush=self._flush_description(),
            room="any number" if self._open_files is None else self._open_files.budget,
            encoder=BATCH_ENCODER,
            decoder=RECORD_DECODER,
        )
        if BATCH_ENCODER != "native" or RECORD_DECODER != "native":
            log.warn(
                "The native batch encoder or record decoder is not built, so produce throughput"
                " is limited by the {encoder} encoder and the {decoder} decoder: install gcc and"
                " python3-dev and reinstall logbroker",
                encoder=BATCH_ENCODER,
                decoder=RECORD_DECODER,
            )

    def _flush_description(self) -> str:
        if self._shared_flush is None:
            return "an fsync for each range's writes"
        if self._native_rounds is None:
            return "one sync for every range's writes, on a Python thread"
        return "one sync for every range's writes, on the native sync thread"

    def stopService(self) -> Deferred[None]:
        super().stopService()
        closing = DeferredList([range_log.close() for range_log in self.logs.values()])

        def stop_threads(_: object) -> None:
            if self._native_rounds is not None:
                self._native_rounds.stop()
            for pool in self._pools:
                pool.stop()
            log.info("Storage closed: every range flushed and fsynced")

        return closing.addCallback(stop_threads)


class SealsSettleService(Service):
    """On stop, waits for the seals behind the appends of every range log (``RangeLog.
    seals_settled``). It stops after the client port has drained, so no append rolls a segment
    meanwhile, and right before the control plane closes, so that each seal is recorded there
    (``SegmentRecorder``); otherwise a stop during a seal left the segment unsealed and its
    successor unrecorded until the next start."""

    def __init__(self, logs: Callable[[], Iterable[RangeLog]]) -> None:
        self._logs = logs

    def stopService(self) -> Deferred[None]:
        super().stopService()
        settling = [range_log.seals_settled() for range_log in self._logs()]
        return DeferredList(settling, consumeErrors=True).addCallback(lambda _: None)


class ControlPlaneService(Service):
    """Starts the control plane once the reactor runs (it loads its state: from the data
    directory, or from etcd) and closes it on stop, once every change asked for is settled."""

    def __init__(self, control_plane: ControlPlane) -> None:
        self.control_plane = control_plane
        #: Fires once the control plane has started (fails if it could not); the broker's
        #: readiness waits on it. Its one consumer is the client port's preparation.
        self.started: Deferred[None] = Deferred()

    def startService(self) -> None:
        super().startService()
        self.control_plane.start().chainDeferred(self.started)

    def stopService(self) -> Deferred[None]:
        super().stopService()
        return self.control_plane.close()


class ExecutorService(Service):
    """Runs a thread pool for the lifetime of the service (password hashing, say)."""

    def __init__(self, executor: ThreadPoolExecutor) -> None:
        self.executor = executor

    def startService(self) -> None:
        super().startService()
        self.executor.start()

    def stopService(self) -> None:
        super().stopService()
        self.executor.stop()


#: How long a stopping broker lets requests in flight finish before failing them.
DRAIN_GRACE_SECONDS = 5.0


def host_and_port(address: object) -> str:
    """``host:port`` of a listening address, an IPv6 host in brackets (``[::]:4040``)."""
    assert isinstance(address, IPv4Address | IPv6Address)
    host = f"[{address.host}]" if isinstance(address, IPv6Address) else address.host
    return f"{host}:{address.port}"


class DualStackPort(tcp.Port):
    """A listening TCP port that takes IPv4 clients on an IPv6 socket whatever the host's
    default (``net.ipv6.bindv6only``; the BSDs default to IPv6 only), which Twisted leaves
    to the kernel."""

    def createInternetSocket(self) -> socket.socket:
        made: socket.socket = super().createInternetSocket()
        if made.family == socket.AF_INET6:
            try:
                made.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            except OSError as error:
                log.warn(
                    "IPv4 clients cannot reach {host}: this system keeps IPv6 sockets IPv6-only"
                    " ({error}); set SVC_BIND_HOST=0.0.0.0 for IPv4",
                    host=self.interface,
                    error=error,
                )
        return made


def listen_tcp(reactor: Any, port: int, factory: Any, host: str, variable: str) -> IListeningPort:
    """Listen on ``host:port``. ``::`` takes IPv6 and IPv4 clients on one socket (Linux makes
    IPv6 sockets dual-stack unless told otherwise); where the host has no IPv6 at all, the
    broker listens on every IPv4 interface instead and says so. Raises ``ConfigError`` naming
    the variable behind the port when it cannot be listened on."""
    try:
        if host == ANY_ADDRESS and isinstance(reactor, PosixReactorBase):
            listening = DualStackPort(port, factory, interface=host, reactor=reactor)
            listening.startListening()
            return listening
        return reactor.listenTCP(port, factory, interface=host)  # type: ignore[no-any-return]
    except CannotListenError as error:
        if host == ANY_ADDRESS and _no_ipv6(error):
            log.warn("This host has no IPv6: listening on IPv4 interfaces only")
            return listen_tcp(reactor, port, factory, "0.0.0.0", variable)
        raise ConfigError(
            variable,
            str(port),
            f"a port free to listen on at {host} ({error.socketError})",
        ) from None


def _no_ipv6(error: CannotListenError) -> bool:
    number = getattr(error.socketError, "errno", None)
    return number in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL)


class ClientPortService(Service):
    """The client port: bound at build time, accepting once the broker is ready (``svc_ready``
    is 1 from then until it stops)."""

    def __init__(
        self,
        reactor: Any,
        config: BrokerConfig,
        factory: ClientFactory,
        prepare: Callable[[], Deferred[None]],
        metrics: Metrics,
    ) -> None:
        self._reactor = reactor
        self._config = config
        self._factory = factory
        self._prepare = prepare
        self._metrics = metrics
        self._port: IListeningPort | None = None
        #: What the dashboard's ``/ready`` reports.
        self.status = NodeStatus.STARTING

    def bind(self) -> None:
        """Listen now, before the reactor runs, but accept nothing until ``startService`` has
        readied the broker: connections wait in the kernel's backlog meanwhile."""
        server = self._config.server
        port = listen_tcp(
            self._reactor, server.tcp_port, self._factory, server.bind_host, "SVC_TCP_PORT"
        )
        # A listening socket is a read descriptor: out of the reactor's readers, it accepts
        # nothing (test reactors give ports that are not descriptors at all).
        if IReadDescriptor.providedBy(port):
            self._reactor.removeReader(port)
        self._port = port

    @property
    def port_number(self) -> int:
        """The port listened on (a free one when configured as 0); after ``bind``."""
        assert self._port is not None, "port_number before bind()"
        return port_number(self._port)

    def startService(self) -> None:
        super().startService()
        maybeDeferred(self._prepare).addCallbacks(self._accept, self._failed)

    def _accept(self, _: object) -> None:
        assert self._port is not None
        if not self.running:
            # Told to stop while getting ready: draining already, never ready.
            return
        if IReadDescriptor.providedBy(self._port):
            self._reactor.addReader(self._port)
        self._metrics.set_ready(True)
        self.status = NodeStatus.READY
        log.info(
            "Broker ready: listening for clients on {address}",
            address=host_and_port(self._port.getHost()),
        )

    def _failed(self, failure: Failure) -> None:
        if not self.running:
            # Told to stop while getting ready: that stop is under way, and orderly.
            return
        if isinstance(failure.value, LogbrokerError):
            # Said in words (a damaged control state file, say): no traceback needed.
            log.critical("The broker could not get ready: {error}; stopping", error=failure.value)
        else:
            log.failure("The broker could not get ready; stopping", failure)
        # After the orderly stop (storage flushed), leave with a failure status, as a
        # supervisor expects of a service that could not start; etcd turning the node away
        # (TLS, credentials) is the configuration's doing, and says so.
        status = exitcodes.FAILURE
        if isinstance(failure.value, ControlPlaneAccessError):
            status = exitcodes.CONFIG_ERROR
        self._reactor.addSystemEventTrigger("after", "shutdown", os._exit, status)
        self._reactor.stop()

    def stopService(self) -> Deferred[None]:
        super().stopService()
        self._metrics.set_ready(False)
        self.status = NodeStatus.DRAINING
        stopped = maybeDeferred(self._port.stopListening) if self._port else succeed(None)
        return stopped.addCallback(
            lambda _: self._factory.drain(self._reactor, DRAIN_GRACE_SECONDS)
        )


class DashboardService(Service):
    """The dashboard port: bound at build time, serving from the moment the reactor runs."""

    def __init__(self, reactor: Any, config: BrokerConfig, site: IProtocolFactory) -> None:
        self._reactor = reactor
        self._config = config
        self._site = site
        self._port: IListeningPort | None = None

    def bind(self) -> None:
        dashboard = self._config.dashboard
        self._port = listen_tcp(
            self._reactor, dashboard.port, self._site, dashboard.bind_host, "SVC_DASHBOARD_PORT"
        )

    @property
    def port_number(self) -> int:
        """The port listened on (a free one when configured as 0); after ``bind``."""
        assert self._port is not None, "port_number before bind()"
        return port_number(self._port)

    def startService(self) -> None:
        super().startService()
        assert self._port is not None
        log.info(
            "Dashboard listening on {address} ({scheme})",
            address=host_and_port(self._port.getHost()),
            scheme="https" if isinstance(self._site, TLSMemoryBIOFactory) else "http",
        )

    def stopService(self) -> Deferred[None]:
        super().stopService()
        stopped = maybeDeferred(self._port.stopListening) if self._port else succeed(None)
        return stopped.addCallback(lambda _: None)


class OrderedServices(MultiService):
    """Starts its services in the order they were added and stops them one after another in
    the reverse order, each once the one after it has finished stopping (``MultiService``
    stops them all at once: the store could close while connections still drain into it)."""

    def stopService(self) -> Deferred[None]:
        Service.stopService(self)
        return ensureDeferred(self._stop_in_reverse())

    async def _stop_in_reverse(self) -> None:
        for service in reversed(list(self)):
            await maybeDeferred(service.stopService)


class BrokerService(OrderedServices):
    """The whole broker's service tree, and its ``metrics`` (the one registry the dashboard
    serves, for a program that embeds the broker)."""

    def __init__(self, metrics: Metrics) -> None:
        super().__init__()
        self.metrics = metrics


class StopOnSigterm(Service):
    """Makes SIGTERM an orderly stop that ends with exit status 0.

    twistd's own handler also stops the reactor, but then re-raises the signal, so the process
    ends "killed by SIGTERM". A broker that drained and flushed has stopped successfully, and
    says so with status 0, which is what supervisors and the operations guide expect.
    """

    def __init__(self, reactor: Any) -> None:
        self._reactor = reactor

    def startService(self) -> None:
        super().startService()
        # After the reactor has installed its handlers, so that this one replaces twistd's.
        self._reactor.callWhenRunning(signal.signal, signal.SIGTERM, self._terminate)

    def _terminate(self, number: int, frame: object) -> None:
        self._reactor.callFromThread(self._stop)

    def _stop(self) -> None:
        log.info("SIGTERM: stopping")
        if self._reactor.running:
            self._reactor.stop()


#: The ``limit`` label of ``svc_connection_limit_blocks_total`` for each refusal.
_CONNECTION_LIMITS = {
    Reason.CONNECTION_LIMIT_EXCEEDED: "per_ip",
    Reason.GLOBAL_LIMIT_EXCEEDED: "global",
}


def build_guards(config: BrokerConfig, clock: Any, metrics: Metrics) -> Guards:
    """The connection registry, the rate limiter and the session store, from the config,
    counting what they refuse in ``metrics``."""
    limits = config.rate_limits
    connections = ConnectionRegistry(
        config.connection_limits,
        on_refused=lambda reason: metrics.connection_refused(_CONNECTION_LIMITS[reason]),
    )
    metrics.watch_connections(lambda: connections.total)
    return Guards(
        connections=connections,
        limiter=RateLimiter(
            {
                Action.AUTH: limits.auth,
                Action.DASHBOARD_AUTH: config.dashboard.auth_rate_limit,
                Action.PUBLISH: limits.publish,
                Action.SUBSCRIBE: limits.subscribe,
            },
            enabled=limits.enabled,
            clock=clock,
            on_blocked=lambda action, identifier: metrics.rate_limit_blocked(action),
        ),
        sessions=SessionStore(
            clock,
            config.dashboard.session_timeout_sec,
            on_expired=metrics.session_expired,
            on_hijack=metrics.session_hijack_attempt,
        ),
        on_auth=metrics.auth_attempt,
    )


def cleanup_task(
    guards: Guards, interval_ms: int, clock: Any, metrics: Metrics | None = None
) -> PeriodicTask:
    """Every ``SVC_RATE_LIMIT_CLEANUP_INTERVAL`` ms, drop the rate-limit buckets that are full
    again and the sessions that are over: without it, every address that ever tried to log in
    would keep its bucket."""
    return PeriodicTask(
        "rate_limit_cleanup",
        interval_ms / 1000,
        lambda: _forget_expired(guards),
        clock,
        metrics=metrics,
        now=False,
    )


def _forget_expired(guards: Guards) -> None:
    buckets = guards.limiter.remove_expired()
    sessions = guards.sessions.remove_expired()
    if buckets or sessions:
        log.debug(
            "Forgot {buckets} rate-limit buckets and {sessions} expired sessions",
            buckets=buckets,
            sessions=sessions,
        )


def _node_id(config: BrokerConfig, data_dir: DataDirectory) -> str:
    """This node's id: kept in the data directory from its first start (``SVC_NODE_ID``, or
    generated); a different ``SVC_NODE_ID`` later is refused, since the data is that node's."""
    configured = config.cluster.node_id
    stored = data_dir.node_id(lambda: configured or f"node-{secrets.token_hex(6)}")
    if configured is not None and configured != stored:
        raise ConfigError(
            "SVC_NODE_ID",
            configured,
            f"{stored}, the id of the node whose data is in {data_dir.path} (unset it, or"
            " point SVC_DATA_DIR at this node's own data)",
        )
    return stored


def build_service(
    reactor: Any, config: BrokerConfig, data_dir: DataDirectory, tls: ServerTls | None
) -> BrokerService:
    """Build the service tree: recover storage, load the control plane and bind the dashboard
    and client ports. Blocking; raises on recovery failure (``StorageError``, ``OSError``, the
    control plane's errors) and ``ConfigError`` when a port cannot be bound. ``data_dir`` is
    ``config.storage.data_dir`` already opened (and locked) by the caller; ``tls`` is
    ``config.tls`` loaded by the caller (``logbroker.security.tls.server_tls``), None for
    plaintext only: it serves the client port and, as HTTPS, the dashboard port.

    The services start in the order they are added and stop in the reverse order, each once
    the one after it has stopped (``OrderedServices``). Where a single node and a cluster
    member differ, the node's mode (``logbroker.node_modes``) says what goes there."""
    configure_interpreter()
    file_limit = raise_file_limit()
    if file_limit.raised_from is not None:
        log.info(
            "Raised the open-file limit from {soft} to {hard}: room for {files} open segment files",
            soft=file_limit.raised_from,
            hard=file_limit.descriptors,
            files=file_limit.max_open_files,
        )
    metrics = Metrics(reactor)
    root = BrokerService(metrics)
    # First, so that its handler is in place before anything reports being ready.
    _add(root, StopOnSigterm(reactor))
    shared_flush = _shared_flush(config.storage.fsync_scope)
    fs = OsFileSystem(shared_sync=shared_flush)
    storage = StorageService(
        reactor,
        data_dir,
        fs,
        log_config_for(config, shared_flush),
        metrics,
        file_limit=file_limit,
        shared_flush=shared_flush,
    )
    storage.recover()
    _add(root, storage, "storage")
    # A range whose disk failed a write (full, or failing) takes appends again once a probe
    # write and fsync succeed: no restart needed.
    recovery = PeriodicTask(
        "storage_recovery",
        STORAGE_RECOVERY_SECONDS,
        storage.return_to_service,
        reactor,
        metrics=metrics,
        now=False,
    )
    _add(root, recovery, "storage-recovery")
    # What start-up built (modules, settings, the recovered storage) lives as long as the
    # process: moved out of the collector's sight once the reactor runs, no full collection
    # walks it again (a hundred thousand objects at 1,000 topics).
    reactor.callWhenRunning(gc.freeze)

    node_id = _node_id(config, data_dir)
    guards = build_guards(config, reactor, metrics)
    mode = _node_mode(reactor, config, node_id, data_dir, fs, storage, metrics, guards, tls)
    control = mode.control
    control_service = _add(root, ControlPlaneService(control), "control-plane")
    # After the control plane, so that they stop before it.
    for service in mode.beside_control_plane():
        _add(root, service)
    metrics.watch(control, storage)
    # With replication, a segment's primary records its seal in the control plane itself.
    recorder = SegmentRecorder(control, node_id) if not _replicated(config) else None
    if recorder is not None:
        storage.on_sealed = recorder.sealed
        _add(root, SealsSettleService(storage.logs.values), "seals-settle")

    lag = PeriodicTask(
        "reactor_lag",
        REACTOR_LAG_INTERVAL_SECONDS,
        ReactorLagProbe(reactor, metrics.reactor_lag),
        reactor,
        metrics=metrics,
        # The first probe after one interval: a probe run before the reactor runs would
        # measure the rest of the start-up as lag.
        now=False,
    )
    _add(root, lag, "reactor-lag")
    maintenance = _maintenance(root, config, node_id, mode, storage, control, metrics, reactor)

    # Password hashing costs tens of milliseconds of CPU: it gets threads of its own, so logins
    # never wait behind fsyncs nor fsyncs behind logins.
    auth_executor = ThreadPoolExecutor(reactor, threads=2, name="logbroker-auth")
    _add(root, ExecutorService(auth_executor), "auth-threads")
    # Before the listeners, so that they start before them and stop after them.
    for service in mode.before_listeners():
        _add(root, service)
    users = UserDirectory(
        control,
        auth_executor,
        on_credentials_revoked=guards.sessions.revoke_user,
        verified=VerifiedPasswords(reactor),
    )
    broker = Broker(
        control,
        mode.ranges,
        reactor,
        BrokerSettings(
            initial_ranges=config.topics.initial_ranges,
            group_session_timeout_ms=config.topics.group_session_timeout_ms,
        ),
        metrics,
        groups=mode.groups,
    )
    accounts = config.accounts
    passwords = {
        "admin": accounts.admin_pass,
        "producer": accounts.producer_pass,
        "consumer": accounts.consumer_pass,
        "app": accounts.app_pass,
    }

    def prepare() -> Deferred[None]:
        started = control_service.started
        started.addCallback(lambda _: log.info("This node is {node_id}", node_id=node_id))
        started.addCallback(lambda _: seed_accounts(users, config.mode.value, passwords))
        started.addCallback(lambda _: mode.joined())
        started.addCallback(lambda _: broker.open())
        if recorder is not None:
            started.addCallback(lambda _: recorder.reconcile(storage.logs))
        return started

    cleanup = cleanup_task(guards, config.rate_limits.cleanup_interval_ms, reactor, metrics)
    _add(root, cleanup, "rate-limit-cleanup")
    factory = ClientFactory(
        broker,
        users,
        reactor,
        ProtocolSettings(
            auth_timeout_ms=config.server.auth_timeout_ms,
            max_frame_size=config.server.max_frame_size,
            acl_strict=config.accounts.acl_strict,
        ),
        guards,
        None if tls is None else attrs.evolve(tls, on_handshake=metrics.tls_handshake),
    )
    if tls is not None:
        log.info(
            "Client port TLS: {how}",
            how="required" if tls.required else "offered beside plaintext",
        )
    clients = ClientPortService(reactor, config, factory, prepare, metrics)

    def node_status() -> NodeStatus:
        """The client port's status, but degraded while the mode says so (a cluster node
        without its lease), and storage failed while a range log refuses writes after a write
        or fsync failed."""
        status = clients.status
        if status is not NodeStatus.READY:
            return status
        if mode.degraded():
            return NodeStatus.DEGRADED
        if any(range_log.failed for range_log in storage.logs.values()):
            return NodeStatus.STORAGE_FAILED
        return status

    app = DashboardApp(
        clock=reactor,
        settings=config.dashboard,
        users=users,
        guards=guards,
        node=BrokerNode(node_status, broker, storage.logs),
        metrics=metrics,
        mode=config.mode.value,
        # With TLS on, the dashboard is HTTPS only: its cookie is Secure and HSTS is sent.
        secure=tls is not None,
        maintenance=maintenance,
    )
    site = DashboardSite(app.app.resource(), secure=tls is not None, reactor=reactor)
    # Capped per client IP and in total as the client port is, its connections counted apart.
    capped = CappedConnections(site, ConnectionRegistry(config.connection_limits))
    # Before the client port, so that it starts first and stops last: /ready reports the drain.
    dashboard = DashboardService(
        reactor,
        config,
        capped if tls is None else TLSMemoryBIOFactory(tls.https_options, False, capped),
    )
    dashboard.bind()
    _add(root, dashboard, "dashboard")

    def listen(port: int, factory: IProtocolFactory, variable: str) -> IListeningPort:
        return listen_tcp(reactor, port, factory, config.server.bind_host, variable)

    for service in mode.listen(listen):
        _add(root, service)
    clients.bind()
    _add(root, clients, "clients")
    # The operator surfaces' view of the cluster, once the ports are bound (a node's record
    # carries them).
    view = mode.describe(clients.port_number, dashboard.port_number)
    factory.cluster = view
    factory.verifier = mode.verifier
    factory.leader_of = mode.leader_of
    app.cluster = view
    metrics.watch_cluster(view)
    if mode.open_session is not None:
        app.open_session = mode.open_session
    return root


_S = TypeVar("_S", bound=Service)


def _add(root: MultiService, service: _S, name: str | None = None) -> _S:
    """Add ``service`` to ``root`` (started after those added before it), named ``name``."""
    if name is not None:
        service.setName(name)
    service.setServiceParent(root)
    return service


def _node_mode(
    reactor: Any,
    config: BrokerConfig,
    node_id: str,
    data_dir: DataDirectory,
    fs: FileSystem,
    storage: StorageService,
    metrics: Metrics,
    guards: Guards,
    tls: ServerTls | None,
) -> NodeMode:
    """The node's mode, as ``SVC_CONTROL_PLANE`` says: a cluster member with etcd (its peer
    links with mutual TLS when the node has TLS), else a single node."""
    if config.cluster.control_plane is ControlPlaneKind.ETCD:
        peer_tls = None if tls is None else tls.peer
        return ClusterMember(reactor, config, node_id, storage, metrics, guards.sessions, peer_tls)
    return SingleNode(config, node_id, data_dir, fs, storage, storage.executor)


def _maintenance(
    root: MultiService,
    config: BrokerConfig,
    node_id: str,
    mode: NodeMode,
    storage: StorageService,
    control: ControlPlane,
    metrics: Metrics,
    reactor: Any,
) -> MaintenanceView:
    """The integrity scrub and retention, each a periodic task when configured; what the
    dashboard shows of them."""
    if mode.repairs is not None:
        storage.on_damage = mode.repairs.damage_found
    scrub = config.scrub
    scrubber = None
    if scrub.enabled:
        # Without other copies (one node, replication factor 1), every finding is unrepairable.
        repairs = mode.repairs or NoOtherCopy(metrics)
        scrubber = Scrubber(
            storage.logs,
            control,
            scrub.segments_per_tick,
            metrics,
            repairs,
            reactor,
            node_id=node_id,
        )
        _add(root, ScrubTask(scrubber, scrub.interval_ms / 1000, reactor, metrics), "scrub")
    retention = config.retention
    rule = RetentionRule(retention.max_age_ms, retention.max_bytes)
    retainer = None
    if rule.enabled:
        # With both limits unset, segments are kept forever and no retention task starts.
        retainer = mode.retention(rule, reactor, metrics)
        task = RetentionTask(retainer, retention.interval_ms / 1000, reactor, metrics)
        _add(root, task, "retention")
    return MaintenanceView(
        scrub=ScrubStatus(scrub.enabled, scrub.interval_ms, scrub.segments_per_tick),
        retention=RetentionStatus(
            rule.enabled, rule.max_age_ms, rule.max_bytes, retention.interval_ms
        ),
        scrubber=scrubber,
        retainer=retainer,
    )


def _replicated(config: BrokerConfig) -> bool:
    return config.cluster.replication_factor > 1


def log_config_for(config: BrokerConfig, shared_flush: bool = False) -> LogConfig:
    """The range logs' settings: with replication, a log is a replica (its readers see only
    what a quorum holds, its primary decides when it rolls) and the replication group commit
    settings apply (``SVC_REPLICATION_GROUP_COMMIT*``) in place of ``SVC_GROUP_COMMIT`` and
    ``SVC_GROUP_COMMIT_INTERVAL_MS``. With ``shared_flush`` (one sync for every range's
    writes) no log parks its appends: the sync's rounds are the group commit (decision 0023).
    It logs which settings do not apply."""
    given = config.storage.log
    replicated = _replicated(config)
    log_config = given
    if replicated:
        cluster = config.cluster
        log_config = attrs.evolve(
            given,
            replicated=True,
            auto_roll=False,
            group_commit=cluster.replication_group_commit,
            group_commit_interval_ms=cluster.replication_group_commit_interval_ms,
        )
    if shared_flush:
        prefix = "SVC_REPLICATION_GROUP_COMMIT" if replicated else "SVC_GROUP_COMMIT"
        log.info(
            "Group commit is the shared sync's rounds (SVC_FSYNC_SCOPE=filesystem): a range's"
            " appends that arrive while a round runs go together in its next write, into the"
            " next round, and every range's writes share each round's"
            " sync, so no append is parked;"
            " {prefix}={group_commit} and {prefix}_INTERVAL_MS={interval_ms} do not apply"
            " (they do with SVC_FSYNC_SCOPE=file)",
            prefix=prefix,
            group_commit=_flag(log_config.group_commit),
            interval_ms=log_config.group_commit_interval_ms,
        )
        return attrs.evolve(log_config, group_commit=False)
    if replicated:
        log.info(
            "Replication factor {factor}: group commit follows"
            " SVC_REPLICATION_GROUP_COMMIT={group_commit} and"
            " SVC_REPLICATION_GROUP_COMMIT_INTERVAL_MS={interval_ms};"
            " SVC_GROUP_COMMIT={unused_group_commit} and"
            " SVC_GROUP_COMMIT_INTERVAL_MS={unused_interval_ms} do not apply",
            factor=config.cluster.replication_factor,
            group_commit=_flag(log_config.group_commit),
            interval_ms=log_config.group_commit_interval_ms,
            unused_group_commit=_flag(given.group_commit),
            unused_interval_ms=given.group_commit_interval_ms,
        )
    return log_config


def _shared_flush(scope: FsyncScope) -> bool:
    """Whether one sync makes every range's writes durable together: as ``SVC_FSYNC_SCOPE``
    asks, where this machine can (else it says why, and each range's file is fsynced)."""
    if scope is FsyncScope.FILE:
        return False
    refusal = shared_sync_refusal()
    if refusal is not None:
        log.warn(
            "SVC_FSYNC_SCOPE=filesystem cannot be used here ({why}): each range's file is "
            "fsynced on its own, as with SVC_FSYNC_SCOPE=file",
            why=refusal,
        )
        return False
    return True


def _flag(value: bool) -> str:
    """A boolean as it is spelled in the environment."""
    return "true" if value else "false"
