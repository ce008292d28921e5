"""The composition root: what ``build_service`` sets up before the reactor runs."""

from __future__ import annotations

import errno
import gc
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import CannotListenError
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.ssl import Certificate, optionsForClientTLS
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import formatEvent, globalLogPublisher
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.test import iosim

from logbroker.config import ANY_ADDRESS, BrokerConfig, ConfigError
from logbroker.dashboard import NodeStatus
from logbroker.maintenance.periodic import PeriodicTask
from logbroker.metrics import Metrics
from logbroker.service import (
    GC_THRESHOLDS,
    GIL_SWITCH_INTERVAL_SECONDS,
    ClientPortService,
    SealsSettleService,
    StorageService,
    build_service,
    listen_tcp,
    log_config_for,
)
from logbroker.storage import DataDirectory, LogConfig, OsFileSystem, RangeLog, SegmentInfo
from logbroker.testing import ImmediateExecutor, ManualExecutor, MemoryFileSystem
from tests.certificates import issue, make_ca, serving
from tests.unit.storage.helpers import append_each, record, result_of, result_of_running


@pytest.fixture
def switch_interval() -> Iterator[None]:
    """Restore this test process's GIL switch interval and garbage collector, which the
    composition root changes."""
    before = sys.getswitchinterval()
    thresholds = gc.get_threshold()
    try:
        yield
    finally:
        sys.setswitchinterval(before)
        gc.set_threshold(*thresholds)
        gc.unfreeze()


@pytest.mark.usefixtures("switch_interval")
def test_the_broker_hands_the_gil_to_its_writer_threads_within_half_a_millisecond(
    tmp_path: Path,
) -> None:
    sys.setswitchinterval(0.005)
    config, _ = BrokerConfig.from_env({}, cwd=str(tmp_path))
    data_dir = DataDirectory.open(config.storage.data_dir, OsFileSystem())

    root = build_service(MemoryReactorClock(), config, data_dir, None)

    assert root.getServiceNamed("storage") is not None
    assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_SECONDS)


@pytest.mark.usefixtures("switch_interval")
def test_the_broker_collects_garbage_less_often_and_sets_aside_what_start_up_built(
    tmp_path: Path,
) -> None:
    gc.set_threshold(700, 10, 10)
    config, _ = BrokerConfig.from_env({}, cwd=str(tmp_path))
    data_dir = DataDirectory.open(config.storage.data_dir, OsFileSystem())
    reactor = MemoryReactorClock()

    build_service(reactor, config, data_dir, None)

    assert gc.get_threshold() == GC_THRESHOLDS
    assert gc.get_freeze_count() == 0
    reactor.run()
    assert gc.get_freeze_count() > 10_000


@pytest.mark.usefixtures("switch_interval")
def test_the_client_port_serves_tls_and_counts_its_handshakes(tmp_path: Path) -> None:
    config, _ = BrokerConfig.from_env({}, cwd=str(tmp_path))
    data_dir = DataDirectory.open(config.storage.data_dir, OsFileSystem())
    ca = make_ca()
    reactor = MemoryReactorClock()
    root = build_service(reactor, config, data_dir, serving(issue(ca)))
    # The dashboard port first, then the client port.
    [_, (_, factory, _, _)] = reactor.tcpServers
    options = optionsForClientTLS("localhost", trustRoot=Certificate.loadPEM(ca.cert_pem))
    client = TLSMemoryBIOFactory(options, True, Factory.forProtocol(Protocol), reactor)

    iosim.connectedServerAndClient(
        lambda: factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", 50000)),
        lambda: client.buildProtocol(None),
        clock=reactor,
    )

    assert root.metrics.snapshot().tls_handshakes == {"ok": 1, "failed": 0}


class _NoIpv6Reactor(MemoryReactorClock):
    """A host whose kernel has no IPv6: listening on ``::`` fails as it would there."""

    def listenTCP(self, port: int, factory: object, backlog: int = 50, interface: str = "") -> Any:
        if ":" in interface:
            raise CannotListenError(interface, port, OSError(errno.EAFNOSUPPORT, "no IPv6"))
        return super().listenTCP(port, factory, backlog, interface)  # type: ignore[arg-type]


def test_without_ipv6_the_default_address_falls_back_to_every_ipv4_interface() -> None:
    reactor = _NoIpv6Reactor()
    listen_tcp(reactor, 4040, Factory(), ANY_ADDRESS, "SVC_TCP_PORT")
    [(port, _, _, interface)] = reactor.tcpServers
    assert (port, interface) == (4040, "0.0.0.0")


def test_an_explicit_ipv6_address_that_cannot_be_listened_on_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as error:
        listen_tcp(_NoIpv6Reactor(), 4041, Factory(), "::1", "SVC_DASHBOARD_PORT")
    assert error.value.variable == "SVC_DASHBOARD_PORT"
    assert "4041" in str(error.value)


@pytest.mark.usefixtures("switch_interval")
def test_storage_recovery_reports_to_the_metrics_the_tree_exposes(
    tmp_path: Path, logged_errors: list[dict[str, Any]]
) -> None:
    config, _ = BrokerConfig.from_env({}, cwd=str(tmp_path))
    fs = OsFileSystem()
    data_dir = DataDirectory.open(config.storage.data_dir, fs)
    range_dir = data_dir.range_path("orders.0")
    range_log = result_of(
        RangeLog.open(range_dir, fs=fs, clock=Clock(), executor=ImmediateExecutor())
    )
    append_each(range_log, 0, 5)
    result_of(range_log.close())
    segment = Path(range_dir, "00000000000000000000.log")
    data = bytearray(segment.read_bytes())
    data[-3] ^= 0xFF  # in the last record's value
    segment.write_bytes(bytes(data))

    root = build_service(MemoryReactorClock(), config, data_dir, None)

    assert len(logged_errors) == 1, "the damage is logged"
    logged_errors.clear()
    snapshot = root.metrics.snapshot()
    assert snapshot.integrity_failures["checksum"] == 1
    assert snapshot.storage_segments == {"active": 0, "sealed": 0, "closed": 1}
    lag = root.getServiceNamed("reactor-lag")
    assert isinstance(lag, PeriodicTask)
    assert lag.task_name == "reactor_lag"
    assert snapshot.periodic_task_failures == {
        "storage_recovery": 0,
        "reactor_lag": 0,
        "scrub": 0,
        "rate_limit_cleanup": 0,
    }


def test_a_stopping_node_waits_for_its_seals_behind_the_appends_before_the_control_plane() -> None:
    sealed: list[SegmentInfo] = []
    executor = ManualExecutor()
    opening = RangeLog.open(
        "/data/ranges/orders.0",
        fs=MemoryFileSystem(),
        clock=Clock(),
        executor=executor,
        config=LogConfig(roll_bytes=200, group_commit=False),
        on_sealed=sealed.append,
    )
    range_log = result_of_running(opening, executor)
    for n in range(2):
        result_of_running(range_log.append([record(n)]), executor)
    appended = range_log.append([record(2)])  # rolls over: segment 0's seal runs behind it
    executor.run_next()
    assert result_of(appended).base_offset == 2
    settle = SealsSettleService(lambda: [range_log])
    settle.startService()

    stopping = settle.stopService()

    assert not stopping.called, "segment 0's seal has not run yet"
    executor.run_all()
    assert [info.base_offset for info in sealed] == [0]
    assert stopping.called
    result_of_running(range_log.close(), executor)


class StubFactory:
    """What the client port service asks of its factory: nothing in flight to drain."""

    def drain(self, clock: object, grace_seconds: float) -> Deferred[None]:
        return succeed(None)


def test_svc_ready_is_1_from_accepting_clients_until_stopping(tmp_path: Path) -> None:
    config, _ = BrokerConfig.from_env({}, cwd=str(tmp_path))
    reactor = MemoryReactorClock()
    metrics = Metrics(reactor)
    preparing: Deferred[None] = Deferred()
    factory: Any = StubFactory()
    clients = ClientPortService(reactor, config, factory, lambda: preparing, metrics)
    clients.bind()

    clients.startService()
    assert not metrics.snapshot().ready, "not before the broker is ready"
    preparing.callback(None)
    assert metrics.snapshot().ready
    stopping = clients.stopService()

    assert not metrics.snapshot().ready
    result_of(stopping)


def test_the_client_port_reports_starting_ready_then_draining(tmp_path: Path) -> None:
    config, _ = BrokerConfig.from_env({}, cwd=str(tmp_path))
    reactor = MemoryReactorClock()
    preparing: Deferred[None] = Deferred()
    factory: Any = StubFactory()
    clients = ClientPortService(reactor, config, factory, lambda: preparing, Metrics(reactor))
    clients.bind()

    clients.startService()
    seen = [clients.status]
    preparing.callback(None)
    seen.append(clients.status)
    stopping = clients.stopService()
    seen.append(clients.status)
    result_of(stopping)

    assert seen == [NodeStatus.STARTING, NodeStatus.READY, NodeStatus.DRAINING]


def test_a_stop_while_getting_ready_never_reports_ready(tmp_path: Path) -> None:
    config, _ = BrokerConfig.from_env({}, cwd=str(tmp_path))
    reactor = MemoryReactorClock()
    preparing: Deferred[None] = Deferred()
    metrics = Metrics(reactor)
    factory: Any = StubFactory()
    clients = ClientPortService(reactor, config, factory, lambda: preparing, metrics)
    clients.bind()

    clients.startService()
    stopping = clients.stopService()
    preparing.callback(None)

    assert clients.status is NodeStatus.DRAINING
    assert not metrics.snapshot().ready
    result_of(stopping)


class _BusyPortReactor(MemoryReactorClock):
    """Another process holds port 4041."""

    def listenTCP(self, port: int, factory: object, backlog: int = 50, interface: str = "") -> Any:
        if port == 4041:
            raise CannotListenError(interface, port, OSError(errno.EADDRINUSE, "in use"))
        return super().listenTCP(port, factory, backlog, interface)  # type: ignore[arg-type]


@pytest.mark.usefixtures("switch_interval")
def test_a_dashboard_port_in_use_is_a_config_error_naming_its_variable(tmp_path: Path) -> None:
    config, _ = BrokerConfig.from_env({}, cwd=str(tmp_path))
    data_dir = DataDirectory.open(config.storage.data_dir, OsFileSystem())

    with pytest.raises(ConfigError) as error:
        build_service(_BusyPortReactor(), config, data_dir, None)

    assert error.value.variable == "SVC_DASHBOARD_PORT"


@pytest.mark.usefixtures("switch_interval")
def test_the_dashboard_starts_before_the_client_port_and_so_stops_after_it(
    tmp_path: Path,
) -> None:
    config, _ = BrokerConfig.from_env({}, cwd=str(tmp_path))
    data_dir = DataDirectory.open(config.storage.data_dir, OsFileSystem())
    reactor = MemoryReactorClock()

    root = build_service(reactor, config, data_dir, None)

    names = [service.name for service in root]
    assert names.index("dashboard") == names.index("clients") - 1
    assert [(port, interface) for port, _, _, interface in reactor.tcpServers] == [
        (4041, "::"),
        (4040, "::"),
    ]


def _tree(root: Any) -> list[str]:
    """The services of ``root`` in start order: by name, or a periodic task by its task."""
    names = []
    for service in root:
        if service.name:
            names.append(service.name)
        elif isinstance(service, PeriodicTask):
            names.append(f"task {service.task_name}")
        else:
            names.append(type(service).__name__)
    return names


@pytest.mark.usefixtures("switch_interval")
def test_a_single_node_and_a_cluster_member_start_their_services_in_this_order(
    tmp_path: Path,
) -> None:
    single, _ = BrokerConfig.from_env({}, cwd=str(tmp_path / "single"))
    member, _ = BrokerConfig.from_env(
        {
            "SVC_CONTROL_PLANE": "etcd://127.0.0.1:2379",
            "SVC_LOG_REPLICATION_FACTOR": "3",
            "SVC_PEER_PORT": "4042",
        },
        cwd=str(tmp_path / "member"),
    )
    fs = OsFileSystem()
    trees = []
    ports = []
    for config in (single, member):
        reactor = MemoryReactorClock()
        data_dir = DataDirectory.open(config.storage.data_dir, fs)
        trees.append(_tree(build_service(reactor, config, data_dir, None)))
        ports.append([port for port, _, _, _ in reactor.tcpServers])

    common_head = ["StopOnSigterm", "storage", "storage-recovery", "control-plane"]
    # A single node records its own seals: they end before its control plane closes. A
    # member's segments are sealed by their primary (``seal_copy``), none behind the appends.
    # Both scrub their sealed segments (a member repairs from its replicas).
    common_tail = ["reactor-lag", "scrub", "auth-threads"]
    assert trees[0] == [
        *common_head,
        "seals-settle",
        *common_tail,
        "rate-limit-cleanup",
        "dashboard",
        "clients",
    ]
    # A member leaves the cluster before its control plane flushes, keeps sessions shared until
    # its listeners are closed, and closes its peer port before its dashboard.
    assert trees[1] == [
        *common_head,
        "membership",
        "peer-links",
        "task takeover_sweep",
        "task healing",
        "task etcd_compaction",
        *common_tail,
        "shared-sessions",
        "rate-limit-cleanup",
        "dashboard",
        "peer-port",
        "clients",
    ]
    assert ports == [[4041, 4040], [4041, 4042, 4040]]


@pytest.mark.usefixtures("switch_interval")
@pytest.mark.parametrize(
    ("limits", "runs"),
    [
        ({}, False),
        ({"SVC_RETENTION_INTERVAL_MS": "1000"}, False),
        ({"SVC_RETENTION_MAX_BYTES": "0"}, True),
        ({"SVC_RETENTION_MAX_AGE_MS": "604800000"}, True),
    ],
)
def test_a_retention_task_runs_only_with_a_limit_set(
    tmp_path: Path, limits: dict[str, str], runs: bool
) -> None:
    config, _ = BrokerConfig.from_env(limits, cwd=str(tmp_path))
    data_dir = DataDirectory.open(config.storage.data_dir, OsFileSystem())

    tree = _tree(build_service(MemoryReactorClock(), config, data_dir, None))

    # With both limits unset, segments are kept forever and no retention task starts.
    assert ("retention" in tree) is runs
    if runs:
        assert tree.index("retention") == tree.index("scrub") + 1


def test_a_members_chores_wait_for_its_control_plane_to_load(tmp_path: Path) -> None:
    # etcd has not answered yet (with thousands of ranges its state takes seconds to load):
    # the takeover sweep and healing come round and find nothing to do, rather than failing
    # with tracebacks at every boot.
    config, _ = BrokerConfig.from_env(
        {"SVC_CONTROL_PLANE": "etcd://127.0.0.1:2379", "SVC_LOG_REPLICATION_FACTOR": "3"},
        cwd=str(tmp_path),
    )
    reactor = MemoryReactorClock()
    data_dir = DataDirectory.open(config.storage.data_dir, OsFileSystem())
    root = build_service(reactor, config, data_dir, None)
    chores = [
        service
        for service in root
        if isinstance(service, PeriodicTask) and service.task_name in ("takeover_sweep", "healing")
    ]
    assert len(chores) == 2
    for chore in chores:
        chore.startService()
    reactor.advance(5)
    assert [chore.failures for chore in chores] == [0, 0]
    assert all(chore.last_success is not None for chore in chores)
    for chore in chores:
        chore.stopService()


def test_with_replication_the_logs_are_replicas_and_take_the_replication_group_commit() -> None:
    replicated = log_config_for(
        BrokerConfig.from_env(
            {
                "SVC_CONTROL_PLANE": "etcd://e1:2379",
                "SVC_LOG_REPLICATION_FACTOR": "3",
                "SVC_GROUP_COMMIT": "false",
                "SVC_REPLICATION_GROUP_COMMIT": "true",
                "SVC_REPLICATION_GROUP_COMMIT_INTERVAL_MS": "7",
                "SVC_SEGMENT_MAX_BYTES": "1048576",
            }
        )[0]
    )
    assert replicated.replicated
    assert not replicated.auto_roll, "the primary rolls its segments through the control plane"
    assert replicated.group_commit
    assert replicated.group_commit_interval_ms == 7
    assert replicated.roll_bytes == 1048576

    single = log_config_for(
        BrokerConfig.from_env(
            {"SVC_GROUP_COMMIT": "true", "SVC_REPLICATION_GROUP_COMMIT": "false"}
        )[0]
    )
    assert not single.replicated
    assert single.auto_roll
    assert single.group_commit, "replication factor 1 keeps SVC_GROUP_COMMIT"


def test_with_replication_the_boot_log_says_which_group_commit_settings_apply() -> None:
    lines: list[str] = []

    def observe(event: dict[str, Any]) -> None:
        if event.get("log_namespace") == "logbroker.service":
            lines.append(formatEvent(event))

    globalLogPublisher.addObserver(observe)
    try:
        log_config_for(
            BrokerConfig.from_env(
                {
                    "SVC_CONTROL_PLANE": "etcd://e1:2379",
                    "SVC_LOG_REPLICATION_FACTOR": "3",
                    "SVC_GROUP_COMMIT": "true",
                    "SVC_GROUP_COMMIT_INTERVAL_MS": "2",
                    "SVC_REPLICATION_GROUP_COMMIT_INTERVAL_MS": "7",
                }
            )[0]
        )
        replicated = list(lines)
        lines.clear()
        log_config_for(BrokerConfig.from_env({"SVC_GROUP_COMMIT": "true"})[0])
    finally:
        globalLogPublisher.removeObserver(observe)

    assert replicated == [
        "Replication factor 3: group commit follows SVC_REPLICATION_GROUP_COMMIT=false and"
        " SVC_REPLICATION_GROUP_COMMIT_INTERVAL_MS=7; SVC_GROUP_COMMIT=true and"
        " SVC_GROUP_COMMIT_INTERVAL_MS=2 do not apply"
    ]
    assert lines == [], "at replication factor 1, SVC_GROUP_COMMIT* apply as set"


def test_with_one_sync_for_every_range_no_log_parks_and_the_boot_log_says_so() -> None:
    lines: list[str] = []

    def observe(event: dict[str, Any]) -> None:
        if event.get("log_namespace") == "logbroker.service":
            lines.append(formatEvent(event))

    single_env = {"SVC_GROUP_COMMIT": "true", "SVC_GROUP_COMMIT_INTERVAL_MS": "4"}
    replicated_env = {
        "SVC_CONTROL_PLANE": "etcd://e1:2379",
        "SVC_LOG_REPLICATION_FACTOR": "3",
        "SVC_REPLICATION_GROUP_COMMIT": "true",
        "SVC_REPLICATION_GROUP_COMMIT_INTERVAL_MS": "7",
    }
    globalLogPublisher.addObserver(observe)
    try:
        single = log_config_for(BrokerConfig.from_env(single_env)[0], shared_flush=True)
        replicated = log_config_for(BrokerConfig.from_env(replicated_env)[0], shared_flush=True)
    finally:
        globalLogPublisher.removeObserver(observe)

    assert not single.group_commit
    assert single.auto_roll
    assert not single.replicated
    assert not replicated.group_commit
    assert replicated.replicated
    assert not replicated.auto_roll
    assert len(lines) == 2
    assert lines[0].startswith("Group commit is the shared sync's rounds")
    assert "SVC_GROUP_COMMIT=true and SVC_GROUP_COMMIT_INTERVAL_MS=4 do not apply" in lines[0]
    assert (
        "SVC_REPLICATION_GROUP_COMMIT=true and SVC_REPLICATION_GROUP_COMMIT_INTERVAL_MS=7 do not"
        " apply" in lines[1]
    )


def test_with_one_sync_for_every_range_the_storage_says_which_thread_runs_the_rounds(
    tmp_path: Path, logged: list[dict[str, Any]]
) -> None:
    from logbroker.storage import SYNC_THREAD, LogConfig

    reactor = MemoryReactorClock()
    fs = OsFileSystem(shared_sync=True)
    data_dir = DataDirectory.open(str(tmp_path / "data"), fs)
    storage = StorageService(
        reactor, data_dir, fs, LogConfig(), Metrics(Clock()), shared_flush=True
    )
    storage.startService()
    # The native thread's event descriptor is watched while the storage runs, and only then.
    watched = len(reactor.readers)
    try:
        for hook, args, kwargs in reactor.whenRunningHooks:
            hook(*args, **kwargs)
    finally:
        result_of(storage.stopService())

    ready = [formatEvent(e) for e in logged if formatEvent(e).startswith("Storage ready")]
    if SYNC_THREAD == "native":
        assert "one sync for every range's writes, on the native sync thread" in ready[0]
        assert watched == 1
    else:
        assert "one sync for every range's writes, on a Python thread" in ready[0]
        assert watched == 0
    assert reactor.readers == set()


def test_the_storage_says_at_boot_which_encoder_and_decoder_it_runs_and_warns_without_native(
    tmp_path: Path, logged: list[dict[str, Any]]
) -> None:
    from logbroker.storage import BATCH_ENCODER, LogConfig
    from logbroker.wire.primitives import RECORD_DECODER

    reactor = MemoryReactorClock()
    fs = OsFileSystem()
    data_dir = DataDirectory.open(str(tmp_path / "data"), fs)
    storage = StorageService(reactor, data_dir, fs, LogConfig(), Metrics(Clock()))
    storage.startService()
    try:
        for hook, args, kwargs in reactor.whenRunningHooks:
            hook(*args, **kwargs)
    finally:
        result_of(storage.stopService())

    texts = [formatEvent(event) for event in logged]
    ready = [text for text in texts if text.startswith("Storage ready")]
    assert len(ready) == 1
    assert f"{BATCH_ENCODER} batch encoder, {RECORD_DECODER} record decoder" in ready[0]
    warned = [text for text in texts if "is not built" in text]
    # Built (the default suite), no warning; not built (the suite's --without-native pass,
    # scripts/check), the Python paths run and the broker says why produce is slower.
    if BATCH_ENCODER == RECORD_DECODER == "native":
        assert warned == []
    else:
        assert len(warned) == 1
        assert "python encoder and the python decoder" in warned[0]
