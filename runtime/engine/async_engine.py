"""``AsyncEngine``: the engine behind asyncio callers (a web server), stepped by one thread.

Only the engine thread touches the engine: callers send commands (add, abort) through a queue
and receive ``RequestOutput`` snapshots on a per-request asyncio queue. A caller that goes away
(a client disconnect cancels its coroutine) aborts its request, which frees its KV pages. A request
that fails alone inside a step (``RequestOutput.error``) raises ``RequestFailed`` in its caller only.
If a step raises (an actor died), every request in flight gets the error and ``recover`` is called
(the cluster layer rebuilds the replica) before new requests are taken.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from runtime.engine.core import Engine
from runtime.engine.heap import freeze_long_lived, unfreeze_long_lived
from runtime.engine.outputs import RequestOutput
from runtime.sampling.sampling_params import SamplingParams

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05
GRAMMAR_TIMEOUT_S = 10.0  # a structured request's grammar must compile within this (ServeArgs.grammar_compile_timeout_s)
GRAMMAR_WORKERS = 2  # grammars compiled at once, off the engine's thread


class Overloaded(RuntimeError):
    """Too many requests wait for a slot; retry later."""


class RequestFailed(RuntimeError):
    """This request alone failed inside a step (``RequestOutput.error`` says why, ``code`` its
    ``RequestOutput.error_code``); the others went on."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


class StepFailed(RuntimeError):
    """A whole step failed (an actor died, a device or collective error): every request in flight failed."""


class Stopping(RuntimeError):
    """The server is stopping and this request had not finished when its drain time ended (``stop_all``)."""


@dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop

    def push(self, item: RequestOutput | BaseException) -> bool:
        """Hand ``item`` to the caller's loop; False if that loop is gone (the caller cannot read it)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            return False
        return True


class AsyncEngine:
    def __init__(self, engine_of: Callable[[], Engine], recover: Callable[[BaseException], None] | None = None,
                 max_waiting: int = 1024, probe: Callable[[], object] | None = None, probe_interval_s: float = 2.0,
                 grammar_timeout_s: float = GRAMMAR_TIMEOUT_S):
        """``engine_of()`` returns the current engine (the cluster layer replaces it when it rebuilds). ``probe``,
        called by the engine thread every ``probe_interval_s`` while no request runs, raises when the models are
        lost (a dead actor): that is recovered at once, as a failed step would be, without waiting for traffic.
        A structured request's grammar is compiled on a small pool of its own, never on the engine's thread: one
        that takes longer than ``grammar_timeout_s`` fails its request (``ValueError`` naming the limit)."""
        self.engine_of, self.recover, self.max_waiting = engine_of, recover, max_waiting
        self.grammar_timeout_s = grammar_timeout_s
        self._grammar_pool = ThreadPoolExecutor(max_workers=GRAMMAR_WORKERS, thread_name_prefix="dspark-grammar")
        self.probe, self.probe_interval_s = probe, probe_interval_s
        self.recovering = False  # True while ``recover`` rebuilds the models (health checks answer 503)
        self.recovery_failed: BaseException | None = None  # the last rebuild's error, until one succeeds
        self._last_probe = time.monotonic()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._pending_adds = 0  # adds queued but not yet applied by the engine thread
        self._pending_lock = threading.Lock()
        self._ids = itertools.count()
        self._stopped = threading.Event()
        self._beat = time.monotonic()  # when the engine thread last came round its loop (a step ended, or idle)
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        freeze_long_lived("the serving engine")  # startup is done: full collections skip what it built
        self._thread.start()

    @property
    def engine(self) -> Engine:
        return self.engine_of()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams) + self._pending_adds

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       follows: str | None = None, index: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every step that committed tokens for it (what it holds:
        ``params.output_kind``; with "final_only" the one finished output), the last one finished. Raises ``ValueError`` for a request the engine refuses, ``Overloaded`` when too many wait.
        ``follows``/``index``: another sample of the same prompt and this sample's index (``Engine.add_request``)."""
        request_id = request_id or f"req-{next(self._ids)}"
        self.engine.validate_request(prompt_token_ids, params)
        if self.engine.num_waiting + self._pending_adds >= self.max_waiting:
            raise Overloaded(f"{self.max_waiting} requests are already waiting")
        grammar = await self._compile_grammar(params) if params.structured_outputs is not None else None
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop())
        with self._pending_lock:
            self._pending_adds += 1
        self._commands.put(("add", request_id, list(prompt_token_ids), params, stream, follows, index, grammar))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the caller went away: free the request's pages
                self._commands.put(("abort", request_id))

    async def _compile_grammar(self, params: SamplingParams):
        """``params``' grammar compiled on the grammar pool, within ``grammar_timeout_s`` (a compile that outlasts it
        finishes on its worker, unawaited; the pool's few workers bound how many such run at once)."""
        work = asyncio.get_running_loop().run_in_executor(self._grammar_pool, self.engine.compile_grammar, params)
        try:
            return await asyncio.wait_for(work, self.grammar_timeout_s)
        except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
            raise ValueError(f"SamplingParams.structured_outputs: its grammar did not compile within "
                             f"{self.grammar_timeout_s:g} s (the server's grammar_compile_timeout_s); ask for a "
                             "simpler schema, regex or grammar") from None

    def stop_all(self, reason: str) -> None:
        """End every request in flight (queued ones too) with ``Stopping(reason)``: their callers answer it (an error
        event and [DONE] for a stream, a 503 otherwise) instead of being cut when the process goes."""
        self._commands.put(("stop_all", reason))

    def shutdown(self) -> None:
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        self._stopped.set()
        self._commands.put(("stop",))
        self._thread.join(timeout=30)
        unfreeze_long_lived()

    # ---- the engine thread --------------------------------------------------------------------

    def stalled_s(self) -> float:
        """Seconds since the engine thread last came round its loop: a step longer than this is still running (or
        hung); idle, it comes round every ``IDLE_WAIT_S``."""
        return time.monotonic() - self._beat

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._beat = time.monotonic()
            self._drain(block=not self.engine.has_unfinished())
            if self._stopped.is_set():
                continue
            if not self.engine.has_unfinished():
                self._probe_when_due()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # an actor died or hung: fail what is in flight, then recover
                self._fail_all(exc)
                continue
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                failed = None if out.error is None else RequestFailed(out.error, out.error_code)
                if not stream.push(out if failed is None else failed):  # caller's loop closed
                    del self._streams[out.request_id]
                    self.engine.abort(out.request_id)
                elif out.finished:
                    del self._streams[out.request_id]

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, params, stream, follows, index, grammar = command
            with self._pending_lock:
                self._pending_adds -= 1
            try:
                self.engine.add_request(prompt, params, request_id, follows, index, grammar)
                self._streams[request_id] = stream
            except ValueError as exc:
                stream.push(exc)
        elif kind == "abort":
            self._streams.pop(command[1], None)
            self.engine.abort(command[1])
        elif kind == "stop_all":
            self.engine.abort_all()
            error = Stopping(command[1])
            for stream in self._streams.values():
                stream.push(error)
            self._streams.clear()

    def _probe_when_due(self) -> None:
        if self.probe is None or time.monotonic() - self._last_probe < self.probe_interval_s:
            return
        self._last_probe = time.monotonic()
        try:
            self.probe()
        except Exception as exc:  # the models are lost while idle: rebuild now, not at the next request
            log.error("dspark: idle health probe failed: %s", exc)
            self._fail_all(exc)

    def _fail_all(self, exc: Exception) -> None:
        log.error("dspark: step failed, failing %d request(s): %s", len(self._streams), exc)
        failed = self.engine.abort_all()
        error = StepFailed(f"{type(exc).__name__}: {exc}")
        for stream in self._streams.values():
            stream.push(error)
        self._streams.clear()
        if self.recover is None:
            return
        self.recovering = True
        unfreeze_long_lived()  # the lost engine's reference cycles can be collected once it is replaced
        try:
            self.recover(exc)
            self.recovery_failed = None
            freeze_long_lived("the rebuilt engine")
        except Exception as failure:  # keep serving errors rather than dying; health checks report the state
            log.exception("dspark: recovery failed after %d failed request(s)", failed)
            self.recovery_failed = failure
        finally:
            self.recovering = False
            self._last_probe = time.monotonic()
