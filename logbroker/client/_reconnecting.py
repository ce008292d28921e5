"""A ``ClientService`` that keeps one logged-in ``BrokerClient`` connected, with backoff.

The service is a producer of its own: ``ReconnectingClient.produce`` stamps its produces with
the service's producer id, and retries through the next connection a produce whose connection
was lost before its answer, as well as one refused ``not_primary``, ``unreachable`` or
``no_quorum``, with the same stamp: never stored twice. Other requests in flight when a
connection drops fail (``ConnectionClosed``) and are not retried. Subscriptions end with the
connection too; ``on_ready`` runs on every new logged-in connection, which is the place to
subscribe again (a group's subscription resumes from its committed position).

The login happens inside the connection rather than in ``ClientService``'s
``prepareConnection``: ``ClientService`` cannot take a connection that closes before it was
handed over (as one does whose login is refused). So ``ClientService`` sees every connection
as made, which resets its count of failed attempts; the backoff here adds the logins that
failed in a row, so wrong credentials are retried ever more slowly rather than every second.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

from twisted.application.internet import ClientService, backoffPolicy
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IAddress, IReactorTime, IStreamClientEndpoint
from twisted.internet.protocol import Factory
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker.client._errors import ConnectionClosed
from logbroker.client._protocol import MAX_RESPONSE_SIZE, BrokerClient
from logbroker.client._retry import DEFAULT_PRODUCE_RETRY, ProduceRetry
from logbroker.client._stamped import StampedProducer
from logbroker.client._tls import secured
from logbroker.records import Record

log = Logger()


class ReconnectingClient(ClientService):
    """Start it (``startService``, or add it to a ``MultiService``), then produce through it,
    or ask for the current connection with ``when_ready()``::

        service = ReconnectingClient(
            HostnameEndpoint(reactor, "localhost", 4040), "app", "app123", clock=reactor
        )
        service.startService()
        await service.produce("orders", [Record(b"hello")])
        client = await service.when_ready()
        batch = await client.fetch("orders")

    ``retry_policy`` maps the number of failed attempts in a row to the seconds to wait
    (default ``backoffPolicy()``: 1 s growing by 1.5x to 60 s, plus up to 1 s of jitter), on
    ``clock``. ``produce_retry`` says how produces are retried (None: never), through this
    service's ``produce`` and the clients it hands out alike. With ``tls_hostname``, every
    connection is TLS to a broker whose certificate names that host and is signed by a CA of
    ``cafile`` (PEM; default: the system's trusted CAs).
    """

    def __init__(
        self,
        endpoint: IStreamClientEndpoint,
        user: str,
        password: str,
        *,
        clock: IReactorTime,
        retry_policy: Callable[[int], float] | None = None,
        produce_retry: ProduceRetry | None = DEFAULT_PRODUCE_RETRY,
        on_ready: Callable[[BrokerClient], object] | None = None,
        max_frame_size: int = MAX_RESPONSE_SIZE,
        tls_hostname: str | None = None,
        cafile: str | None = None,
    ) -> None:
        self._credentials = (user, password)
        self._max_frame_size = max_frame_size
        self._on_ready = on_ready
        self._policy = retry_policy or backoffPolicy()
        self._clock = clock
        self._produce_retry = produce_retry
        self._producer = StampedProducer(clock, produce_retry)
        #: Connections in a row that closed, or were refused, before their login succeeded.
        self.failed_logins = 0
        super().__init__(
            secured(endpoint, tls_hostname, cafile, clock),
            _ClientFactory(self),
            retryPolicy=lambda attempt: self._policy(attempt + self.failed_logins),
            clock=clock,
        )

    def when_ready(self, fail_after_failures: int | None = None) -> Deferred[BrokerClient]:
        """The current logged-in client, or the next one. Fails with the login's error
        (``BrokerRefused``) if the next connection's login is refused; with the connection
        error after ``fail_after_failures`` failed connection attempts in a row; with
        ``CancelledError`` when the service stops."""
        connected = self.whenConnected(failAfterFailures=fail_after_failures)
        return connected.addCallback(lambda client: cast(BrokerClient, client).ready())

    @property
    def producer_id(self) -> int:
        """The service's producer id (random), which stamps the produces of ``produce``."""
        return self._producer.producer_id

    def produce(
        self, topic: str, records: Iterable[Record], *, give_up_after: float | None = None
    ) -> Deferred[int]:
        """Produce through the current connection, or the next one; fires with the count
        appended once every record is durable. As ``BrokerClient.produce``, and a produce whose
        connection was lost before its answer is retried too, through the next connection,
        with the same stamp (so never stored twice); no try starts, nor waits for a
        connection, later than ``give_up_after`` seconds (default: ``produce_retry``'s) after
        the first."""
        return self._producer.produce(
            topic,
            tuple(records),
            self.when_ready,
            reconnects=True,
            give_up_after=give_up_after,
        )

    def stopService(self) -> Deferred[None]:
        """Stop reconnecting, close the connection; produces waiting to be retried fail."""
        self._producer.interrupt(ConnectionClosed("the reconnecting client was stopped"))
        stopped: Deferred[None] = super().stopService()
        return stopped

    def _connected(self, client: BrokerClient) -> None:
        client.ready().addCallbacks(self._logged_in, self._login_failed)

    def _logged_in(self, client: BrokerClient) -> None:
        self.failed_logins = 0
        if self._on_ready is not None:
            maybeDeferred(self._on_ready, client).addErrback(
                lambda failure: log.failure("on_ready failed", failure)
            )

    def _login_failed(self, failure: Failure) -> None:
        self.failed_logins += 1
        log.warn(
            "Could not log in to the broker ({failed} in a row): {error}",
            failed=self.failed_logins,
            error=failure.getErrorMessage(),
        )


class _ClientFactory(Factory):
    def __init__(self, service: ReconnectingClient) -> None:
        self._service = service

    def buildProtocol(self, addr: IAddress | None) -> BrokerClient:
        service = self._service
        client = BrokerClient(
            service._credentials,
            service._max_frame_size,
            clock=service._clock,
            produce_retry=service._produce_retry,
        )
        service._connected(client)
        return client
