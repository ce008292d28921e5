"""A delaying TCP relay, for the slow-link drill: this kernel has no netem, so latency is added
in user space.

``python -m tests.certify.relay PORT DELAY_MS MARK`` listens on 127.0.0.1:PORT in the namespace
it runs in. Connections are sent to it by an nftables ``redirect`` (the harness's slow-link
rules); for each, it reads the original destination (``SO_ORIGINAL_DST``), connects there
with its own packets marked ``MARK`` (so the redirect lets them pass), and forwards each chunk,
in both directions and in order, ``DELAY_MS`` after it arrived. It runs until killed.
"""

from __future__ import annotations

import queue
import socket
import struct
import sys
import threading
import time

_SO_ORIGINAL_DST = 80
_SO_MARK = 36


def _original_destination(connection: socket.socket) -> tuple[str, int]:
    raw = connection.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
    port = struct.unpack("!H", raw[2:4])[0]
    return socket.inet_ntoa(raw[4:8]), port


def _pump(source: socket.socket, target: socket.socket, delay: float) -> None:
    """Forward what ``source`` sends to ``target``, each chunk ``delay`` seconds late."""
    pending: queue.Queue[tuple[float, bytes]] = queue.Queue()

    def deliver() -> None:
        try:
            while True:
                due, chunk = pending.get()
                if not chunk:
                    target.shutdown(socket.SHUT_WR)
                    return
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                target.sendall(chunk)
        except OSError:
            source.close()
            target.close()

    threading.Thread(target=deliver, daemon=True).start()
    try:
        while chunk := source.recv(65536):
            pending.put((time.monotonic() + delay, chunk))
    except OSError:
        pass
    pending.put((0.0, b""))


def _relay(connection: socket.socket, delay: float, mark: int) -> None:
    try:
        destination = _original_destination(connection)
        onward = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        onward.setsockopt(socket.SOL_SOCKET, _SO_MARK, mark)
        onward.connect(destination)
    except OSError:
        connection.close()
        return
    for sock in (connection, onward):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    threading.Thread(target=_pump, args=(onward, connection, delay), daemon=True).start()
    _pump(connection, onward, delay)


def main(argv: list[str]) -> None:
    port, delay_ms, mark = int(argv[0]), float(argv[1]), int(argv[2], 0)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    print(f"relaying with {delay_ms:g} ms of delay on 127.0.0.1:{port}", flush=True)
    while True:
        connection, _ = listener.accept()
        threading.Thread(
            target=_relay, args=(connection, delay_ms / 1000, mark), daemon=True
        ).start()


if __name__ == "__main__":
    main(sys.argv[1:])
