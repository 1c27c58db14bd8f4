"""The ``collect`` command (``hostcallback-consumer collect``): a Collector on the command line.

It turns options into CollectorLimits, serves until SIGINT or SIGTERM, and ends with one line
of counts; a bad setting or a port in use is one line on stderr and a non-zero exit code, never
a traceback. The serving itself is the Collector's.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import ssl

from .cli_messages import complain
from .collector import (
    Collector,
    CollectorConfigError,
    CollectorLimits,
    read_token,
    tls_context,
)
from .protocol import TOKEN_VARIABLE


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0 to 65535; 0 picks a "
                                         "free one)")
    return port


def add_collect_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = CollectorLimits()
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; another needs a token "
                             "or --insecure)")
    parser.add_argument("--port", type=_port, required=True, help="TCP port; 0 picks a free one")
    parser.add_argument("--out", required=True, help="directory for the run files")
    parser.add_argument("--token-file", help=f"file holding the shared token (else "
                                             f"${TOKEN_VARIABLE}); never printed")
    parser.add_argument("--insecure", action="store_true",
                        help="listen beyond loopback without a token")
    parser.add_argument("--tls-cert", help="PEM certificate chain: serve over TLS (senders pass "
                                           "SocketSink(tls_ca_file=...))")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--max-record-bytes", type=int, default=defaults.max_record_bytes,
                        help="largest record accepted; a sender of a bigger one is told why and "
                             "dropped (default %(default)s)")
    parser.add_argument("--max-clients", type=int, default=defaults.max_clients,
                        help="connections served at once; more are refused (default %(default)s)")
    parser.add_argument("--max-open-runs", type=int, default=defaults.max_open_runs,
                        help="run files kept open; the least recently used is closed and "
                             "reopened on demand (default %(default)s)")
    parser.add_argument("--min-free-bytes", type=int, default=defaults.min_free_bytes,
                        help="free disk below which no record is taken, senders wait "
                             "(default %(default)s)")
    parser.add_argument("--stall-seconds", type=float, default=defaults.stall_seconds,
                        help="a sender silent this long mid-record is dropped "
                             "(default %(default)s)")
    parser.add_argument("--idle-seconds", type=float, default=defaults.idle_seconds,
                        help="a sender that sends no record or heartbeat this long is dropped; "
                             "SocketSink beats every 30 s (default %(default)s)")


def collect_command(args: argparse.Namespace) -> int:
    """Serves until SIGINT or SIGTERM; prints the address at start and the counts at the end."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        if bool(args.tls_cert) != bool(args.tls_key):
            raise CollectorConfigError("--tls-cert and --tls-key go together: pass both")
        tls = tls_context(args.tls_cert, args.tls_key) if args.tls_cert else None
        collector = Collector(args.out, token=read_token(args.token_file), insecure=args.insecure,
                              tls=tls,
                              limits=CollectorLimits(args.max_record_bytes, args.max_clients,
                                                     args.max_open_runs, args.min_free_bytes,
                                                     args.stall_seconds, args.idle_seconds))
        collector.check_bind(args.host)
    except (CollectorConfigError, OSError, ssl.SSLError) as error:
        complain("collect", str(error))
        return 2

    async def run() -> None:
        ready = asyncio.Event()
        task = asyncio.ensure_future(collector.serve(args.host, args.port, ready))
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, task.cancel)
        waiting = asyncio.ensure_future(ready.wait())
        await asyncio.wait([task, waiting], return_when=asyncio.FIRST_COMPLETED)
        if ready.is_set():
            print(f"collector listening on {args.host}:{collector.port}, writing to {args.out}",
                  flush=True)
        waiting.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    try:
        asyncio.run(run())
    except KeyboardInterrupt:  # before the signal handlers were in place
        pass
    except OSError as error:
        what = "address already in use" if error.errno in (98, 48) else error.strerror or error
        complain("collect", f"cannot listen on {args.host}:{args.port}: {what} (another "
                 "collector? pick another --port, or --port 0 for a free one)")
        return 1
    print(f"collector stopped: {collector.counts()}", flush=True)
    return 0
