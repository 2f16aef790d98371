"""CURVE key folders: ``python -m runtime.keys init DIR`` writes the verifier's key pair and named drafter and client
key pairs with pyzmq's own ``zmq.auth.create_certificates``; the nodes and the client load them from here.

Layout (the public-key allow-lists of the verifier are the ``.key`` files of ``drafters/`` and ``clients/``)::

    DIR/server.key            the verifier's public key   (every host needs it)
    DIR/server.key_secret     the verifier's secret key   (the verifier host only)
    DIR/drafters/NAME.key     a drafter's public key      (the verifier's drafter allow-list)
    DIR/drafters/NAME.key_secret                          (that drafter's host only)
    DIR/clients/NAME.key      a client's public key       (the verifier's client allow-list)
    DIR/clients/NAME.key_secret                           (that client's host only)

Folders are 0700, secret files 0600. Existing keys are never overwritten without ``--force``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import zmq.auth

from shared.transport import DOMAINS, ClientKeys, ServerKeys

SERVER = "server"
ROLES = {"drafter": "drafters", "client": "clients"}
#: ZAP domain of each allow-list: a key is accepted only on the socket of its own role.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class KeysError(ValueError):
    """A key folder or key file that is missing, unreadable or malformed; the message says how to fix it."""


def _hint(keys_dir: Path) -> str:
    return f"create keys with `python -m runtime.keys init {keys_dir}`"


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise KeysError(f"key name {name!r}: use letters, digits, '_', '.' or '-' (at most 64 characters)")
    return name


def _folder(keys_dir: str | os.PathLike) -> Path:
    folder = Path(keys_dir).expanduser()
    if not folder.is_dir():
        raise KeysError(f"keys folder {str(folder)!r} does not exist: {_hint(folder)}")
    return folder


def _load(path: Path, keys_dir: Path, need_secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        fix = _hint(keys_dir)
        if path.parent.name in ROLES.values():
            role = path.parent.name[:-1]
            fix += f", or add one: `python -m runtime.keys add-{role} {path.name.split('.key')[0]} --dir {keys_dir}`"
        raise KeysError(f"key file {str(path)!r} is missing: {fix}")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeysError(f"key file {str(path)!r} cannot be read: {exc}") from None
    if need_secret and not secret:
        raise KeysError(f"key file {str(path)!r} holds no secret key")
    if need_secret and path.stat().st_mode & 0o077:  # as ssh does: a secret others can read is no secret
        raise KeysError(f"secret key file {str(path)!r} is readable by other users: `chmod 600 {path}`")
    return public, secret


def _server_public(folder: Path) -> bytes:
    """The verifier's public key: ``server.key``, or the pair file on the verifier host itself."""
    public_file = folder / f"{SERVER}.key"
    pair_file = folder / f"{SERVER}.key_secret"
    return _load(pair_file if pair_file.is_file() and not public_file.is_file() else public_file, folder, False)[0]


def server_public_key(keys_dir: str | os.PathLike) -> bytes:
    """The verifier's public key (z85 text) of a keys folder."""
    return _server_public(_folder(keys_dir))


def server_keys(keys_dir: str | os.PathLike) -> ServerKeys:
    """The verifier's key pair and its two allow-lists (``drafters/`` and ``clients/``)."""
    folder = _folder(keys_dir)
    public, secret = _load(folder / f"{SERVER}.key_secret", folder, need_secret=True)
    assert secret is not None  # _load checked it
    allow = {}
    for role, sub in ROLES.items():
        if not (folder / sub).is_dir():
            raise KeysError(f"keys folder {str(folder)!r} has no {sub}/ allow-list: {_hint(folder)}")
        allow[DOMAINS[role]] = folder / sub
    return ServerKeys(public, secret, allow)


def peer_keys(keys_dir: str | os.PathLike, role: str, name: str) -> ClientKeys:
    """A drafter's (``role="drafter"``) or client's key pair named ``name``, with the verifier's public key."""
    folder = _folder(keys_dir)
    public, secret = _load(folder / ROLES[role] / f"{check_name(name)}.key_secret", folder, need_secret=True)
    assert secret is not None  # _load checked it
    return ClientKeys(_server_public(folder), public, secret)


def public_key(keys_dir: str | os.PathLike, role: str, name: str) -> bytes:
    """The public key (z85 text) of the ``role`` peer ``name``: its ``.key`` file in the allow-list, no secret."""
    folder = _folder(keys_dir)
    return _load(folder / ROLES[role] / f"{check_name(name)}.key", folder, need_secret=False)[0]


def client_keys(keys_dir: str | os.PathLike, name: str = "client") -> ClientKeys:
    """The keys an :class:`~runtime.client.AsyncClient` connects with: ``AsyncClient(addr, curve=client_keys(d))``."""
    return peer_keys(keys_dir, "client", name)


#: The tenant of ``http.api_key`` (the single key of a one-user setup).
DEFAULT_TENANT = "default"
#: Shortest API key accepted (a guessable key on a network address protects nothing).
MIN_API_KEY_CHARS = 16


def check_api_key(key: object, where: str) -> str:
    """``key`` if it is a usable API key: at least :data:`MIN_API_KEY_CHARS` printable characters, no whitespace."""
    if not isinstance(key, str) or len(key) < MIN_API_KEY_CHARS or not key.isprintable() or any(
            c.isspace() for c in key):
        raise KeysError(f"{where}: a key of at least {MIN_API_KEY_CHARS} printable characters without spaces (e.g. "
                        "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    return key


def read_api_keys(path: str | os.PathLike) -> dict[str, str]:
    """``http.api_keys_file``: lines ``TENANT<TAB>KEY`` or ``TENANT:KEY`` (blank lines and ``#`` comments skipped),
    as key → tenant. Refused if others can read it (as ssh refuses a secret key file) or if a key repeats; a
    tenant may have several keys (rotation)."""
    file = Path(path).expanduser()
    try:
        mode = file.stat().st_mode
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KeysError(f"API keys file {str(file)!r} cannot be read: {exc}") from None
    if mode & 0o077:
        raise KeysError(f"API keys file {str(file)!r} is readable by other users: `chmod 600 {file}`")
    keys: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        tenant, sep, key = line.partition("\t") if "\t" in line else line.partition(":")
        where = f"API keys file {str(file)!r}, line {n}"
        if not sep:
            raise KeysError(f"{where}: write TENANT:KEY (or TENANT<TAB>KEY)")
        try:
            check_name(tenant.strip())
        except KeysError as exc:
            raise KeysError(f"{where}: tenant {exc}") from None
        key = check_api_key(key.strip(), where)
        if key in keys:
            raise KeysError(f"{where}: this key is also tenant {keys[key]!r}'s; give each tenant its own")
        keys[key] = tenant.strip()
    if not keys:
        raise KeysError(f"API keys file {str(file)!r} holds no key")
    return keys


def allowed_count(folder: Path) -> int:
    """How many public keys an allow-list folder holds."""
    return len(zmq.auth.load_certificates(folder))


# ---------------------------------------------------------------------------------------------------- writing


@contextlib.contextmanager
def _private_umask() -> Iterator[None]:
    old = os.umask(0o077)  # files are born private; chmod below sets the final modes
    try:
        yield
    finally:
        os.umask(old)


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def _write_pair(folder: Path, name: str, force: bool) -> list[Path]:
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    existing = [p for p in (public, secret) if p.exists()]
    if existing and not force:
        raise KeysError(f"{existing[0]} exists: keys are never overwritten (use --force to replace them)")
    with _private_umask():
        zmq.auth.create_certificates(folder, name)
    os.chmod(public, 0o644)
    os.chmod(secret, 0o600)
    return [public, secret]


def init(keys_dir: str | os.PathLike, clients: list[str], drafters: list[str], force: bool = False) -> list[Path]:
    """Write the verifier's key pair and the named drafter and client key pairs; returns the files written."""
    folder = Path(keys_dir).expanduser()
    names = {"client": [check_name(n) for n in dict.fromkeys(clients)],
             "drafter": [check_name(n) for n in dict.fromkeys(drafters)]}
    pairs = [(folder, SERVER)] + [(folder / ROLES[r], n) for r in names for n in names[r]]
    clash = [p for d, n in pairs for p in (d / f"{n}.key", d / f"{n}.key_secret") if p.exists()]
    if clash and not force:  # checked before anything is written, so a refusal writes nothing
        raise KeysError(f"{clash[0]} exists: keys are never overwritten (use --force to replace them)")
    _private_dir(folder)
    written = _write_pair(folder, SERVER, force)
    for role, role_names in names.items():
        _private_dir(folder / ROLES[role])
        for name in role_names:
            written += _write_pair(folder / ROLES[role], name, force)
    return written


def add(keys_dir: str | os.PathLike, role: str, name: str, force: bool = False) -> list[Path]:
    """Add one named drafter or client key pair to an existing keys folder."""
    folder = _folder(keys_dir)
    if not (folder / f"{SERVER}.key").is_file() and not (folder / f"{SERVER}.key_secret").is_file():
        raise KeysError(f"{folder} has no server key: {_hint(folder)}")
    _private_dir(folder / ROLES[role])
    return _write_pair(folder / ROLES[role], check_name(name), force)


def _parser(prog: str = "python -m runtime.keys") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("init", help="write the verifier's key pair and named drafter and client key pairs")
    i.add_argument("dir", help="the keys folder (created 0700)")
    i.add_argument("--clients", nargs="+", default=["client"], metavar="NAME", help="client key names (client)")
    i.add_argument("--drafters", nargs="+", default=["drafter"], metavar="NAME", help="drafter key names (drafter)")
    i.add_argument("--force", action="store_true", help="replace existing keys")
    for role in ROLES:
        a = sub.add_parser(f"add-{role}", help=f"add one {role} key pair to an existing keys folder")
        a.add_argument("name")
        a.add_argument("--dir", required=True, help="the keys folder")
        a.add_argument("--force", action="store_true", help="replace an existing key of that name")
    return p


def main(argv: list[str] | None = None, prog: str = "python -m runtime.keys") -> int:
    args = _parser(prog).parse_args(argv)
    try:
        if args.command == "init":
            written = init(args.dir, args.clients, args.drafters, args.force)
        else:
            written = add(args.dir, args.command.removeprefix("add-"), args.name, args.force)
    except (KeysError, OSError) as exc:
        print(f"pipespec keys: error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        kind = "secret" if path.name.endswith("_secret") else "public"
        print(f"wrote {kind} key {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
