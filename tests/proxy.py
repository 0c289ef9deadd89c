"""A TCP proxy on 127.0.0.1 that can hold replies back: a late reply caused on purpose.

Commands pass to the server at once (so it runs them); while ``hold_s`` is set, each reply
chunk waits that long before it goes back to the client, longer than the client's per-call
timeout: the client gives up on a call the server did run.
"""

from __future__ import annotations

import contextlib
import socket
import threading

from tests.procs import free_port


class DelayProxy:
    """Forwards ``127.0.0.1:port`` to ``127.0.0.1:target_port``; ``hold_s`` delays replies."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.hold_s = 0.0
        #: hold the very first reply (of any connection) this long, once: a cold first
        #: answer (connection set-up, a cache warming) that only one client meets
        self.hold_first_s = 0.0
        #: hold, this long and once, the reply to the first request that contains
        #: ``hold_reply_to`` (a report of one broker, say): a late reply to one call only,
        #: whatever else the client's other connections do meanwhile
        self.hold_reply_to: bytes | None = None
        self.hold_reply_s = 0.0
        self._armed: set[int] = set()
        #: replies that were held back (a test asserts the fault it caused happened)
        self.held = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.settimeout(0.2)
        self._sockets: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False, id(client)),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True, id(client)),
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool, conn: int) -> None:
        try:
            while not self._stop.is_set():
                data = src.recv(65536)
                if not data:
                    break
                hold = self.hold_s if replies else 0.0
                if replies and self.hold_first_s > 0:
                    with self._lock:
                        first, self.hold_first_s = self.hold_first_s, 0.0
                    hold = max(hold, first)
                if not replies and self.hold_reply_to is not None and self.hold_reply_to in data:
                    with self._lock:
                        self.hold_reply_to = None
                        self._armed.add(conn)
                if replies and conn in self._armed:
                    with self._lock:
                        self._armed.discard(conn)
                    hold = max(hold, self.hold_reply_s)
                if hold > 0:
                    with self._lock:
                        self.held += 1
                    # The fault itself: the reply arrives late (or, when closed meanwhile,
                    # never: what a link cut mid-stream loses).
                    self._stop.wait(hold)
                    if self._stop.is_set():
                        break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.close()
        self._thread.join(5)
