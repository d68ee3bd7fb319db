"""Graceful drain of a dspark Serve app, coordinated through Ray's internal key-value store.

``dspark serve`` on SIGINT/SIGTERM sets the app's drain flag; every Serve replica of the app polls it (with its
own in-flight count, ``report``) twice a second, answers new /v1 requests with 503 + Retry-After once it is set,
and lets the requests it holds finish. The CLI waits until the replicas report nothing in flight (or the drain
timeout, or a second signal); then it sets the stop flag, on which every replica ends what it still holds with an
error its clients receive (a stream's error event and ``[DONE]``, a 503), and only then shuts Serve down, so no
client is cut by the proxy going first.
"""

from __future__ import annotations

from ray.experimental import internal_kv

NAMESPACE = "dspark"
POLL_S = 0.5


def _key(app: str, *parts: str) -> bytes:
    return "/".join([app, *parts]).encode()


def request_drain(app: str) -> None:
    internal_kv._internal_kv_put(_key(app, "draining"), b"1", overwrite=True, namespace=NAMESPACE)


def is_draining(app: str) -> bool:
    return internal_kv._internal_kv_exists(_key(app, "draining"), namespace=NAMESPACE)


def request_stop(app: str) -> None:
    """The drain time is over: every replica ends what it still holds with an error its clients receive."""
    internal_kv._internal_kv_put(_key(app, "stopping"), b"1", overwrite=True, namespace=NAMESPACE)


def is_stopping(app: str) -> bool:
    return internal_kv._internal_kv_exists(_key(app, "stopping"), namespace=NAMESPACE)


def report(app: str, replica: str, in_flight: int) -> None:
    internal_kv._internal_kv_put(_key(app, "in_flight", replica), str(in_flight).encode(), overwrite=True,
                                 namespace=NAMESPACE)


def total_in_flight(app: str) -> int:
    keys = internal_kv._internal_kv_list(_key(app, "in_flight", ""), namespace=NAMESPACE)
    return sum(int(internal_kv._internal_kv_get(k, namespace=NAMESPACE) or 0) for k in keys)


def clear(app: str) -> None:
    for key in internal_kv._internal_kv_list(_key(app, ""), namespace=NAMESPACE):
        internal_kv._internal_kv_del(key, namespace=NAMESPACE)
