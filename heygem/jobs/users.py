"""The users of a shared server (``python app.py --users FILE``): who may sign in, with which secret,
who is an admin, and which jobs each may see.

A users file lists one user a line, ``NAME:SECRET``, with ``admin`` and a space in front for an admin::

    # heygem users: blank lines and lines starting with # are skipped
    admin alice:correct-horse-battery
    bob:another-long-secret
    carol:pbkdf2_sha256$600000$9c1f...$4be0...

A user's SECRET is their password on the page and for HTTP basic auth (``curl -u bob:SECRET``), and
their API key (``Authorization: Bearer SECRET``), so no two users may share one. A secret may be
written hashed, as ``python -m heygem users hash`` prints it (PBKDF2-SHA256), so the file need not
hold it in the clear. NAME is letters, digits and ``. _ @ -``.

Every job records the user who submitted it; a user sees, fetches, cancels and deletes only their own,
an admin every job (also those made without a user, by the CLI or before the server had users).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from heygem.errors import HeygemError

HASH_SCHEME = "pbkdf2_sha256"
HASH_ITERATIONS = 600_000
NAME_PATTERN = re.compile(r"^[\w.@-]{1,64}$")
ADMIN_ROLE = "admin"
MAX_REMEMBERED = 4096  # hashed-secret checks remembered (right and wrong ones), then forgotten


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


class Users:
    """The users of a server, looked up by name and password or by API key.

    A hashed secret costs a PBKDF2 run to check, so the outcome of a check is remembered (keyed by the
    given secret's SHA-256) for the next request.
    """

    def __init__(self, users: list[User]):
        self._by_name = {user.name: user for user in users}
        self._checked: dict[tuple[str, str], bool] = {}
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: str | Path) -> Users:
        """Read a users file (see the module's docstring); HeygemError naming the line to fix."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise HeygemError(f"the users file {path} cannot be read: {error}") from None
        return cls.parse(text, str(path))

    @classmethod
    def parse(cls, text: str, source: str = "the users file") -> Users:
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
            if any(user.name == name for user in users):
                raise HeygemError(f"{where}: {name} is listed twice")
            same = next((user for user in users if not user.hashed and user.secret == secret), None)
            if same is not None:  # the secret is also an API key, which must name one user
                raise HeygemError(f"{where}: {name} has the same secret as {same.name}; give each user their own")
            users.append(User(name, admin, secret))
        if not users:
            raise HeygemError(f"{source} lists no users: write one NAME:SECRET a line")
        return cls(users)

    def __iter__(self) -> Iterator[User]:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str | None) -> User | None:
        return self._by_name.get(name) if name else None

    def _is_secret_of(self, user: User, given: str) -> bool:
        if not user.hashed:
            return _matches(user.secret, given)
        key = (user.name, hashlib.sha256(given.encode("utf-8")).hexdigest())
        with self._lock:
            known = self._checked.get(key)
        if known is None:
            known = _matches(user.secret, given)
            with self._lock:
                if len(self._checked) >= MAX_REMEMBERED:
                    self._checked.clear()
                self._checked[key] = known
        return known

    def check_password(self, name: str, password: str) -> User | None:
        """The user with this name and password, or None."""
        user = self.get(name)
        return user if user is not None and self._is_secret_of(user, password) else None

    def check_key(self, key: str) -> User | None:
        """The one user whose secret is this API key, or None."""
        found = [user for user in self if key and self._is_secret_of(user, key)]
        return found[0] if len(found) == 1 else None

    def from_authorization(self, header: str) -> User | None:
        """The user an HTTP Authorization header names (``Basic`` name:secret or ``Bearer`` secret), or None."""
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
