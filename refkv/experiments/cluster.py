"""Running experiment cells on a Dask cluster instead of local processes.

A full-powered grid is many core-hours. :func:`dask_executor` gives
:func:`refkv.experiments.runner.run` a ``concurrent.futures`` executor backed by Dask
distributed: either a cluster that already runs somewhere (``scheduler="tcp://host:8786"``,
started with ``dask scheduler`` and ``dask worker`` on the machines you have) or a
``LocalCluster`` of worker processes on this machine (``scheduler="local"``), which the tests
use. The runner stays the only writer of records, so resume, progress and the records'
format are those of a local run; every cell is a pure function of its parameters, so the
results are the same wherever it ran.

Dask is optional: ``pip install -e ".[sweeps]"``.
"""

from __future__ import annotations

import contextlib

from ..validation import check_int

__all__ = ["CONNECT_TIMEOUT", "check_scheduler", "dask_executor"]

#: Address schemes Dask's communication layer understands.
_SCHEMES = ("tcp://", "tls://", "inproc://", "ucx://", "ws://", "wss://")


#: Seconds a connection to a remote scheduler may take (handshake included) before it fails.
CONNECT_TIMEOUT = 10


def check_scheduler(scheduler: str) -> str:
    """Validate a ``--scheduler`` value: ``"local"`` or a Dask address such as ``tcp://host:8786``.

    Checked before connecting: the scheme, a host, and a port in [1, 65535] for the
    network schemes (``tcp``, ``tls``, ``ws``, ``wss``), so a typo fails at once instead of
    after a connection timeout.
    """
    if not isinstance(scheduler, str) or not (scheduler == "local" or scheduler.startswith(_SCHEMES)):
        raise ValueError(f"scheduler must be 'local' or a Dask scheduler address like tcp://HOST:8786, "
                         f"got {scheduler!r}")
    scheme, _, rest = scheduler.partition("://")
    if scheme in ("tcp", "tls", "ws", "wss"):
        host, colon, port = rest.rstrip("/").rpartition(":")
        if not colon:
            host, port = rest.rstrip("/"), ""
        if not host or "/" in host or any(c.isspace() for c in host):
            raise ValueError(f"scheduler {scheduler!r} has no valid host; expected {scheme}://HOST:PORT")
        if port:
            if not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ValueError(f"scheduler {scheduler!r}: invalid port {port!r}; a port is an integer in "
                                 f"[1, 65535]")
    return scheduler


def _probe(scheduler: str, timeout: float = CONNECT_TIMEOUT) -> None:
    """Connect to ``scheduler`` and ask its identity, all within ``timeout`` seconds.

    Dask's ``Client`` bounds the TCP connection but not the exchange after it: a server
    that accepts the connection and never answers (a web server on that port) would hold
    it forever. This probe bounds the whole exchange; a ValueError names the address.
    """
    import asyncio

    from distributed.comm import connect

    async def identity():
        comm = await connect(scheduler, timeout=timeout)
        try:
            await comm.write({"op": "identity", "reply": True})
            return await comm.read()
        finally:
            comm.abort()

    try:
        reply = asyncio.run(asyncio.wait_for(identity(), timeout))
    except (OSError, TimeoutError, asyncio.TimeoutError, EOFError, ValueError, TypeError) as err:
        raise ValueError(f"scheduler {scheduler}: no Dask scheduler answered within {timeout} s "
                         f"({type(err).__name__}{': ' + str(err)[:120] if str(err) else ''}); is the address "
                         f"right and is the scheduler running?") from None
    if not isinstance(reply, dict):
        raise ValueError(f"scheduler {scheduler}: the server there is not a Dask scheduler (it answered "
                         f"{type(reply).__name__})")


@contextlib.contextmanager
def dask_executor(scheduler: str = "local", *, n_workers: int = 2, threads_per_worker: int = 1):
    """A ``concurrent.futures`` executor that runs cells on a Dask cluster.

    Parameters
    ----------
    scheduler : str
        ``"local"`` starts a ``LocalCluster`` of ``n_workers`` processes bound to
        127.0.0.1 (no dashboard) for the duration of the ``with`` block; any other value is
        the address of a running scheduler, which is left running afterwards; connecting to it
        fails after :data:`CONNECT_TIMEOUT` seconds with a ValueError.
    n_workers : int
        Worker processes of the local cluster (ignored for a remote scheduler).
    threads_per_worker : int
        Task threads per local worker; 1 keeps one cell per process, like ``--jobs``.
        (Dask's nanny starts workers with one BLAS thread each.)

    Yields
    ------
    concurrent.futures.Executor
        ``submit`` returns :class:`concurrent.futures.Future` objects.

    Raises
    ------
    ValueError
        A malformed scheduler or worker count, or Dask not installed.
    """
    scheduler = check_scheduler(scheduler)
    n_workers = check_int("n_workers", n_workers, 1)
    threads_per_worker = check_int("threads_per_worker", threads_per_worker, 1)
    try:
        from distributed import Client, LocalCluster
    except ImportError:
        raise ValueError('scheduler needs Dask distributed, which is not installed: pip install -e ".[sweeps]"') \
            from None
    with contextlib.ExitStack() as stack:
        if scheduler == "local":
            cluster = stack.enter_context(LocalCluster(
                n_workers=n_workers, threads_per_worker=threads_per_worker, processes=True,
                host="127.0.0.1", dashboard_address=None))
            client = stack.enter_context(Client(cluster))
        else:
            _probe(scheduler, CONNECT_TIMEOUT)
            client = stack.enter_context(Client(scheduler, timeout=CONNECT_TIMEOUT))
        yield client.get_executor()
