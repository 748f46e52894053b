"""What `minipaged serve` checks before the model loads, so a mistake costs seconds, not a load.

    check_serve_extras()    fastapi, uvicorn, pyzmq, msgspec, prometheus_client are importable
    check_ssl(key, cert)    both given or neither, both readable, and they make a TLS context
    bind_socket(host, port) the listening socket, bound now: uvicorn serves on this very socket,
                            so nothing can take the port between the check and the first request

Each failure is a `CLIError` (one `error:` line) that names the flag and the fix.
"""
from __future__ import annotations

import errno
import importlib
import socket
from pathlib import Path
from typing import Optional

from minipaged.cli.errors import CLIError

SERVE_EXTRAS = {"fastapi": "fastapi", "uvicorn": "uvicorn", "zmq": "pyzmq",
                "msgspec": "msgspec", "prometheus_client": "prometheus_client"}  # module: package


def check_serve_extras() -> None:
    missing = []
    for module, package in SERVE_EXTRAS.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(package)
    if missing:
        raise CLIError(f"minipaged serve needs {', '.join(missing)}, which "
                       f"{'is' if len(missing) == 1 else 'are'} not installed: pip install "
                       "'minipaged[serve]' (in a clone: pip install -e '.[serve]')")


def check_ssl(keyfile: Optional[str], certfile: Optional[str]) -> None:
    if keyfile is None and certfile is None:
        return
    if keyfile is None or certfile is None:
        raise CLIError("--ssl-keyfile and --ssl-certfile go together: HTTPS needs the private key "
                       "and its certificate")
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile)):
        if not Path(path).expanduser().is_file():
            raise FileNotFoundError(f"{flag} {path}: no such file")
    import ssl
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, OSError) as e:
        raise CLIError(f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile} do not make a TLS "
                       f"certificate ({e}); they must be PEM files, the key matching the "
                       "certificate") from None


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening (uvicorn starts that)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds its own
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise CLIError(f"port {port} on {host} is already in use (another `minipaged serve` "
                           f"or another server?). Stop that process, or choose a free port: "
                           f"--port {port + 1}") from None
        if e.errno == errno.EACCES:
            raise CLIError(f"port {port} on {host}: permission denied (ports below 1024 need "
                           "root); choose one above 1024, e.g. --port 8000") from None
        raise CLIError(f"cannot listen on {host}:{port} ({e.strerror or e}); --host must be an "
                       "address of this machine: 127.0.0.1, 0.0.0.0 for every interface, or "
                       "one of its own addresses") from None
    return sock


__all__ = ["SERVE_EXTRAS", "bind_socket", "check_serve_extras", "check_ssl"]
