"""The users of a shared server (``python app.py --users FILE``): who may sign in, with which secret,
who is an admin, and which jobs each may see; and how signing in is defended.

A users file lists one user a line, ``NAME:SECRET``, with ``admin`` and a space in front for an admin::

    # heygem users: blank lines and lines starting with # are skipped
    admin alice:correct-horse-battery
    bob:another-long-secret
    carol:pbkdf2_sha256$600000$9c1f...$4be0...

A user's SECRET (12 characters at least) is their password on the page and for HTTP basic auth
(``curl -u bob:SECRET``). Their API key is ``NAME:SECRET`` (``Authorization: Bearer bob:SECRET``), or
the secret alone where it is written plain, so no two users may share one. A secret may be written
hashed, as ``python -m heygem users hash`` prints it (PBKDF2-SHA256), so the file need not hold it in
the clear; such a user's key is always ``NAME:SECRET``. NAME is letters, digits and ``. _ @ -``.

A check costs at most one hash whatever is presented: a key names its user or is a plain secret found
by its keyed digest; an unknown name, and a plain secret in a file that also holds hashed ones, cost a
hash all the same, so that names do not show by timing; only right secrets are remembered. The file is
read again when it changes (looked at once a second) and on SIGHUP. :class:`FailedSignIns` refuses a
client address or a user name for a while after repeated failures; :func:`foreign_origin` tells a
cross-site request, which a state-changing REST call must not be.

Every job records the user who submitted it; a user sees, fetches, cancels and deletes only their own,
an admin every job (also those made without a user, by the CLI or before the server had users).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import re
import secrets
import signal
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from heygem.errors import HeygemError

logger = logging.getLogger("heygem")

HASH_SCHEME = "pbkdf2_sha256"
HASH_ITERATIONS = 600_000
MIN_SECRET_LENGTH = 12  # a plain secret of the users file, or --auth's password, is at least this long
NAME_PATTERN = re.compile(r"^[\w.@-]{1,64}$")
ADMIN_ROLE = "admin"
MAX_REMEMBERED = 4096  # right secrets remembered (wrong ones never are), then the least recently used forgotten
LOOK_AT_FILE_SECONDS = 1.0  # how often the users file is looked at for changes
FAILURES_ALLOWED = 10  # failed sign-ins allowed per client address, and per user name, within FAILURE_WINDOW_SECONDS
FAILURE_WINDOW_SECONDS = 60.0
MAX_COUNTED = 10_000  # addresses and names whose failures are counted at once
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})

_PROCESS_KEY = secrets.token_bytes(32)  # keys the digests that find plain secrets and remember right ones


def _digest(*parts: str) -> bytes:
    """A keyed digest of ``parts``: cheap, and of no use to anyone outside this process."""
    return hmac.new(_PROCESS_KEY, "\0".join(parts).encode("utf-8"), hashlib.sha256).digest()


@dataclass(frozen=True)
class User:
    """One line of the users file."""

    name: str
    admin: bool = False
    secret: str = field(default="", repr=False)  # as written: plain, or pbkdf2_sha256$iterations$salt$hash

    @property
    def hashed(self) -> bool:
        return self.secret.startswith(HASH_SCHEME + "$")


def hash_secret(secret: str, iterations: int = HASH_ITERATIONS) -> str:
    """``secret`` as the users file takes it hashed: pbkdf2_sha256$ITERATIONS$SALT$HASH (hex)."""
    salt = secrets.token_hex(16)
    digest = hashlib.pbkdf2_hmac("sha256", secret.encode("utf-8"), bytes.fromhex(salt), iterations)
    return f"{HASH_SCHEME}${iterations}${salt}${digest.hex()}"


def _matches(stored: str, given: str) -> bool:
    """Whether ``given`` is the secret ``stored`` (plain or hashed), compared in constant time."""
    if not stored.startswith(HASH_SCHEME + "$"):
        return hmac.compare_digest(stored.encode("utf-8"), given.encode("utf-8"))
    _, iterations, salt, expected = stored.split("$")
    digest = hashlib.pbkdf2_hmac("sha256", given.encode("utf-8"), bytes.fromhex(salt), int(iterations))
    return hmac.compare_digest(digest.hex(), expected)


def _check_hash(secret: str, where: str) -> None:
    parts = secret.split("$")
    try:
        valid = len(parts) == 4 and int(parts[1]) > 0 and bytes.fromhex(parts[2]) and len(bytes.fromhex(parts[3])) == 32
    except ValueError:
        valid = False
    if not valid:
        raise HeygemError(f"{where}: a hashed secret is {HASH_SCHEME}$ITERATIONS$SALT$HASH, as "
                          "`python -m heygem users hash` prints it")


def check_secret_length(secret: str, what: str) -> None:
    """HeygemError unless ``secret`` (a plain one) is at least MIN_SECRET_LENGTH characters long."""
    if len(secret) < MIN_SECRET_LENGTH:
        raise HeygemError(f"{what} is shorter than {MIN_SECRET_LENGTH} characters: choose a longer one")


def parse_users(text: str, source: str = "the users file", min_secret_length: int = 0) -> list[User]:
    """The users of a users file's text (see the module's docstring); HeygemError naming the line to fix."""
    users: list[User] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}, line {number}"
        role, _, rest = line.partition(" ")
        admin = role == ADMIN_ROLE and bool(rest.strip())
        entry = rest.strip() if admin else line
        name, colon, secret = entry.partition(":")
        if not colon or not NAME_PATTERN.match(name):
            raise HeygemError(f"{where}: write NAME:SECRET, or admin NAME:SECRET (NAME is letters, digits "
                              "and . _ @ -)")
        if not secret.strip():
            raise HeygemError(f"{where}: {name} has no secret")
        secret = secret.strip()
        if secret.startswith(HASH_SCHEME + "$"):
            _check_hash(secret, where)
        elif len(secret) < min_secret_length:
            check_secret_length(secret, f"{where}: {name}'s secret")
        if any(user.name == name for user in users):
            raise HeygemError(f"{where}: {name} is listed twice")
        same = next((user for user in users if not user.hashed and user.secret == secret), None)
        if same is not None:  # the secret is also an API key, which must name one user
            raise HeygemError(f"{where}: {name} has the same secret as {same.name}; give each user their own")
        users.append(User(name, admin, secret))
    if not users:
        raise HeygemError(f"{source} lists no users: write one NAME:SECRET a line")
    return users


@dataclass(frozen=True)
class _Table:
    """One reading of the users: by name, plain secrets by their keyed digest, and the secret an unknown
    name is checked against (hashed as the slowest user's where any is hashed, so it costs the same)."""

    by_name: dict[str, User]
    by_key: dict[bytes, User]
    stand_in: str

    @classmethod
    def of(cls, users: list[User]) -> _Table:
        iterations = max((int(user.secret.split("$")[1]) for user in users if user.hashed), default=0)
        stand_in = (f"{HASH_SCHEME}${iterations}${secrets.token_hex(16)}${secrets.token_hex(32)}" if iterations
                    else secrets.token_urlsafe(24))
        return cls({user.name: user for user in users},
                   {_digest(user.secret): user for user in users if not user.hashed}, stand_in)

    @property
    def any_hashed(self) -> bool:
        return self.stand_in.startswith(HASH_SCHEME + "$")


def claimed_name(header: str) -> str | None:
    """The user name an Authorization header claims (basic auth's, or a ``Bearer NAME:SECRET`` key's)."""
    scheme, _, value = (header or "").strip().partition(" ")
    value = value.strip()
    if scheme.lower() == "basic":
        try:
            name, colon, _ = base64.b64decode(value, validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            return None
        return name if colon else None
    if scheme.lower() == "bearer":
        name, colon, _ = value.partition(":")
        return name if colon and NAME_PATTERN.match(name) else None
    return None


class Users:
    """The users of a server, looked up by name and password or by API key.

    Made by :meth:`load`, they follow their file: it is looked at (its size and time) at most once every
    LOOK_AT_FILE_SECONDS and read again when it changed, or at once on :meth:`reread` (SIGHUP); a file
    that no longer reads keeps the users as they were, with one error line in the log. ``generation``
    counts the readings, so that sessions of users no longer listed can be ended.
    """

    def __init__(self, users: list[User], path: Path | None = None):
        self._table = _Table.of(users)
        self._path = path
        self._stamp = self._stamp_of(path) if path is not None else None
        self._next_look = time.monotonic() + LOOK_AT_FILE_SECONDS
        self._remembered: OrderedDict[bytes, None] = OrderedDict()  # digests of (name, stored, given) found right
        self._lock = threading.Lock()
        self._reading = threading.Lock()
        self.generation = 0

    @classmethod
    def load(cls, path: str | Path) -> Users:
        """Read a users file (see the module's docstring); HeygemError naming the line to fix."""
        path = Path(path)
        return cls(cls._read(path), path)

    @staticmethod
    def _read(path: Path) -> list[User]:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise HeygemError(f"the users file {path} cannot be read: {error}") from None
        return parse_users(text, str(path), MIN_SECRET_LENGTH)

    @classmethod
    def parse(cls, text: str, source: str = "the users file") -> Users:
        return cls(parse_users(text, source))

    @staticmethod
    def _stamp_of(path: Path) -> tuple | None:
        try:
            status = path.stat()
        except OSError:
            return None
        return status.st_mtime_ns, status.st_size, status.st_ino

    # ------------------------------------------------------------------ the file

    def _current(self) -> _Table:
        if self._path is not None and time.monotonic() >= self._next_look:
            self.reread(only_if_changed=True)
        return self._table

    def reread(self, only_if_changed: bool = False) -> bool:
        """Read the users file again (``only_if_changed``: when its size or time changed); whether the
        users were replaced."""
        if self._path is None:
            return False
        with self._reading:
            self._next_look = time.monotonic() + LOOK_AT_FILE_SECONDS
            stamp = self._stamp_of(self._path)
            if only_if_changed and stamp == self._stamp:
                return False
            self._stamp = stamp
            try:
                users = self._read(self._path)
            except HeygemError as problem:
                logger.error("the users stay as they were: %s", problem)
                return False
            with self._lock:
                self._table = _Table.of(users)
                self._remembered.clear()
                self.generation += 1
        logger.info("read the users file %s again: %d users", self._path, len(users))
        return True

    def reread_on_hangup(self) -> None:
        """Read the users file again when the process gets SIGHUP (where there is one; from the main thread)."""
        main_thread = threading.current_thread() is threading.main_thread()  # where handlers can be set
        if self._path is None or not hasattr(signal, "SIGHUP") or not main_thread:
            return
        signal.signal(signal.SIGHUP, lambda *_: threading.Thread(target=self.reread, name="heygem-users",
                                                                 daemon=True).start())

    # ------------------------------------------------------------------ who

    def __iter__(self) -> Iterator[User]:
        return iter(self._current().by_name.values())

    def __len__(self) -> int:
        return len(self._current().by_name)

    def get(self, name: str | None) -> User | None:
        return self._current().by_name.get(name) if name else None

    def check_password(self, name: str, password: str) -> User | None:
        """The user with this name and password, or None. Costs one hash where the file holds hashed
        secrets, whether the name is known or not (none where it was right before)."""
        table = self._current()
        user = table.by_name.get(name)
        stored = user.secret if user is not None else table.stand_in
        remembered = _digest(name, stored, password)
        with self._lock:
            if remembered in self._remembered:  # right for this very line of the file
                self._remembered.move_to_end(remembered)
                return user
        right = _matches(stored, password) and user is not None
        if table.any_hashed and not stored.startswith(HASH_SCHEME + "$"):
            _matches(table.stand_in, password)  # a plain secret takes a hashed one's time: names do not show
        if not right:
            return None
        with self._lock:
            self._remembered[remembered] = None
            while len(self._remembered) > MAX_REMEMBERED:
                self._remembered.popitem(last=False)
        return user

    def check_key(self, key: str) -> User | None:
        """The user whose API key this is (NAME:SECRET, or a plain secret alone), or None; at most one hash."""
        if not key:
            return None
        user = self._current().by_key.get(_digest(key))
        if user is not None:
            return user
        name, colon, secret = key.partition(":")
        return self.check_password(name, secret) if colon and NAME_PATTERN.match(name) else None

    def from_authorization(self, header: str) -> User | None:
        """The user an HTTP Authorization header names (``Basic`` name:secret or ``Bearer`` key), or None."""
        scheme, _, value = (header or "").strip().partition(" ")
        value = value.strip()
        if scheme.lower() == "bearer":
            return self.check_key(value)
        if scheme.lower() != "basic":
            return None
        try:
            name, colon, password = base64.b64decode(value, validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            return None
        return self.check_password(name, password) if colon else None


def shared_password_matches(shared: tuple[str, str], name: str, password: str) -> bool:
    """Whether ``name`` and ``password`` are --auth's, compared in constant time."""
    name_ok = hmac.compare_digest(name.encode("utf-8"), shared[0].encode("utf-8"))
    password_ok = hmac.compare_digest(password.encode("utf-8"), shared[1].encode("utf-8"))
    return name_ok and password_ok


def parse_shared_auth(text: str) -> tuple[str, str]:
    """--auth's USER:PASS; HeygemError saying what to write."""
    user, colon, password = text.partition(":")
    if not colon or not user or not password:
        raise HeygemError("--auth takes USER:PASS")
    check_secret_length(password, "--auth's password")
    return user, password


def server_sign_in(users_path: str | None, auth_text: str | None, share: bool) -> tuple[tuple | None, Users | None]:
    """What app.py serves with: (--auth's name and password, --users' users), one of them or neither;
    HeygemError for a bad value. --share with neither logs a warning: the public link is then open."""
    if users_path and auth_text:
        raise HeygemError("give --users (a user file) or --auth (one shared user), not both")
    if users_path:
        return None, Users.load(users_path)
    if auth_text:
        return parse_shared_auth(auth_text), None
    if share:
        logger.warning("--share without --users or --auth: anyone with the public link can use this server")
    return None, None


class FailedSignIns:
    """Failed sign-ins, counted per client address and per user name. Past FAILURES_ALLOWED within
    FAILURE_WINDOW_SECONDS, an address or a name is refused until its oldest counted failure is that old
    (one log line when it starts); a right secret does not clear the count."""

    def __init__(self, allowed: int = FAILURES_ALLOWED, window_seconds: float = FAILURE_WINDOW_SECONDS,
                 clock: Callable[[], float] = time.monotonic):
        self.allowed, self.window_seconds, self._clock = allowed, window_seconds, clock
        self._failures: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _keys(address: str | None, name: str | None) -> list[str]:
        return ([f"address {address}"] if address else []) + ([f"name {name!r}"] if name else [])

    def retry_after(self, address: str | None, name: str | None = None) -> int:
        """Seconds until a sign-in from ``address`` as ``name`` is taken again; 0: now."""
        now = self._clock()
        wait = 0.0
        with self._lock:
            for key in self._keys(address, name):
                times = self._failures.get(key)
                if times is not None and len(times) >= self.allowed:
                    wait = max(wait, times[0] + self.window_seconds - now)
        return int(wait) + 1 if wait > 0 else 0

    def failed(self, address: str | None, name: str | None = None) -> None:
        """Count a failed sign-in from ``address`` as ``name``."""
        now = self._clock()
        refused = []
        with self._lock:
            for key in self._keys(address, name):
                times = self._failures.pop(key, None) or deque(maxlen=self.allowed)
                while times and times[0] <= now - self.window_seconds:
                    times.popleft()
                times.append(now)
                self._failures[key] = times  # the most recently failed last
                if len(times) == self.allowed:
                    refused.append(key)
            while len(self._failures) > MAX_COUNTED:
                del self._failures[next(iter(self._failures))]
        if refused:
            logger.warning("sign-in refused for %.0f s to %s: %d failures within that time", self.window_seconds,
                           " and ".join(refused), self.allowed)


def _origin_of(url: str) -> str | None:
    parts = urlsplit(url)
    if not parts.hostname:
        return None
    try:
        port = parts.port
    except ValueError:
        return None
    return parts.hostname.lower() + (f":{port}" if port and port not in (80, 443) else "")


def foreign_origin(method: str, origin: str | None, referer: str | None, host: str | None) -> str | None:
    """The foreign origin a request comes from, where it must be refused; else None. A request that names
    an Origin other than the server's own (its Host) is refused; a state-changing one (POST, PUT, PATCH,
    DELETE) also by a foreign Referer. A request with neither (curl, gradio_client) is taken."""
    own = _origin_of(f"http://{host}") if host else None
    if origin is not None and origin.strip():
        if _origin_of(origin.strip()) != own or own is None:
            return origin.strip()
        return None
    if method.upper() in STATE_CHANGING and referer and referer.strip():
        if _origin_of(referer.strip()) != own or own is None:
            return referer.strip()
    return None


def sees_every_job(user: User | None) -> bool:
    """Without users (None: a server for one person) and for an admin, every job is visible."""
    return user is None or user.admin


def submitter_filter(user: User | None) -> str | None:
    """The submitter a listing keeps to: None (all) for an admin or a server without users."""
    return None if sees_every_job(user) else user.name


def may_see(user: User | None, submitter: str | None) -> bool:
    """Whether ``user`` may see a job submitted by ``submitter``."""
    return sees_every_job(user) or submitter == user.name


def log_for(user: User | None, log_text: str, server_folders: dict[Path, str]) -> str:
    """A job's log as ``user`` may read it: for a user who is not an admin, every folder of
    ``server_folders`` (the job's, the outputs, the weights...) written as its short name instead."""
    if sees_every_job(user):
        return log_text
    for folder in sorted(server_folders, key=lambda path: len(str(path)), reverse=True):
        log_text = log_text.replace(str(folder), server_folders[folder])
    return log_text
