"""How the page's Live tab signs in to /api/live without the REST API's credentials.

The page's own sign-in (Gradio's login) gives its Python events the user, but not the page's script:
a plain ``fetch`` to /api/live carries no basic auth or key. So the Start button first runs a private
page event that knows the user and asks :meth:`LiveTickets.issue` for a ticket: 32 random bytes, bound
to that user, good for TICKET_SECONDS and one use. The script sends it with its offer (header
TICKET_HEADER), and POST /api/live takes it in place of basic or bearer auth, as that user
(:meth:`LiveTickets.pass_for`). The session then started answers with its key (32 random bytes again),
which the script sends (header KEY_HEADER) to that session's own routes (say, end, its PCM WebSocket)
while the session lasts. Programs keep using the REST API's credentials.

One registry serves a server's page and its routes: it rides on the LiveSettings that app.py hands to
both (heygem.live.sessions.LiveSettings.tickets). Only digests of tickets and keys are kept.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from heygem.errors import HeygemError

TICKET_HEADER = "X-Heygem-Live-Ticket"
KEY_HEADER = "X-Heygem-Live-Key"
TICKET_SECONDS = 60.0  # a ticket not used within this long is refused (the browser's offer takes ~3 s)
MAX_TICKETS = 10_000  # tickets (used or not) remembered at once; the oldest go first


class TicketRefused(HeygemError):
    """A live ticket or session key that does not sign anyone in (HTTP 401)."""


@dataclass(frozen=True)
class LivePass:
    """Who a ticket or session key signs in: the user's name (None on a server with one shared password)."""

    user_name: str | None


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "replace")).digest()


class LiveTickets:
    """The tickets a server's page has handed out and the keys of its live sessions. Thread-safe: the
    page's events run in worker threads, the routes in the event loop and worker threads."""

    def __init__(self, seconds: float = TICKET_SECONDS, clock: Callable[[], float] = time.monotonic):
        self.seconds = seconds
        self.clock = clock
        # digest of a ticket -> (its user, when it expires, whether it was used)
        self._tickets: OrderedDict[bytes, tuple[str | None, float, bool]] = OrderedDict()
        self._keys: dict[str, tuple[bytes, str | None]] = {}  # session id -> (digest of its key, its user)
        self._lock = threading.Lock()

    def issue(self, user_name: str | None) -> str:
        """A new ticket for ``user_name``, good for one POST /api/live within ``seconds``."""
        ticket = secrets.token_urlsafe(32)
        now = self.clock()
        with self._lock:
            while self._tickets and (len(self._tickets) >= MAX_TICKETS
                                     or next(iter(self._tickets.values()))[1] < now):
                self._tickets.popitem(last=False)  # the oldest expire first: tickets are kept in issuing order
            self._tickets[_digest(ticket)] = (user_name, now + self.seconds, False)
        return ticket

    def redeem(self, ticket: str) -> LivePass:
        """The user a ticket was issued to, once; TicketRefused when it was used, has expired or was never
        issued here."""
        digest = _digest(ticket.strip())
        with self._lock:
            found = self._tickets.get(digest)
            if found is None:
                raise TicketRefused("this live ticket is not one this server gave: press Start again")
            user_name, expires, used = found
            if used:
                raise TicketRefused("this live ticket was used already: press Start again")
            self._tickets[digest] = (user_name, expires, True)
        if self.clock() > expires:
            raise TicketRefused(f"this live ticket has expired (they last {self.seconds:g} s): press Start again")
        return LivePass(user_name)

    def issue_key(self, session_id: str, user_name: str | None) -> str:
        """The key of a new session: it signs in as ``user_name`` on that session's routes until it ends."""
        key = secrets.token_urlsafe(32)
        with self._lock:
            self._keys[session_id] = (_digest(key), user_name)
        return key

    def forget_key(self, session_id: str) -> None:
        with self._lock:
            self._keys.pop(session_id, None)

    def pass_for(self, method: str, path: str, path_params: Mapping[str, str],
                 headers: Mapping[str, str]) -> LivePass | None:
        """Who a request signs in as with a ticket or a session key; None when it carries neither (it
        signs in as any other request); TicketRefused when the one it carries is not good for it."""
        ticket, key = headers.get(TICKET_HEADER.lower()), headers.get(KEY_HEADER.lower())
        if ticket is None and key is None:
            return None
        session_id = path_params.get("session_id")
        if ticket is not None:
            if method != "POST" or session_id is not None or not path.rstrip("/").endswith("/live"):
                raise TicketRefused("a live ticket only starts a session (POST /api/live)")
            return self.redeem(ticket)
        with self._lock:
            found = self._keys.get(session_id) if session_id else None
        if found is None or not hmac.compare_digest(found[0], _digest(key.strip())):
            raise TicketRefused("this is not the key of that live session")
        return LivePass(found[1])
