"""The engine in a process of its own, so that the GPU's scheduler does not share the web server's GIL.

Why: the scheduler thread drives the GPU through many short torch calls, and gives up Python's GIL and
waits to take it back at each. Sharing one process with Gradio's event loop, hundreds of streaming
handlers and the text decoding of every reply, it waited for the GIL longer than for the GPU: on an H200
a decode step of 11.8 ms took 32.8 ms in-process at 200 users, 41 ms through the app
(benchmarks/RESULTS.md). So, as vLLM splits its API server from its engine core, the engine process
holds the model, the scheduler and the preparation of inputs (images decoded and sliced, prompts
rendered); the web process keeps the UI, turns token ids into text and follows each reply.

EngineProcess has the model manager's interface (app.engine.manager.ModelManager), so the UI does not
know which one it talks to. If the engine process dies (a crash in a GPU driver, say), replies in flight
end with a clear message and a new engine process is started and warmed up.

With several web processes (app.web_processes) the engine process also listens on a local socket and
serves each web process over a connection of its own (EngineConnection) as it serves its parent over the
pipe; a web process that goes away takes its requests out of the batch. The parent restarts the engine
process when it dies, and the web processes connect to the new one.

Messages, pickled over the pipe or a connection:
  web -> engine   ("stream", id, messages, settings, requested_at)   start a reply
                  ("done", id, outcome)                              the web side is done with it
                  ("call", id, method, args)                         anything else (info, switch, metrics...)
                  ("stop", None)                                     end the process
  engine -> web   ("ready", error) once, after loading (error None); then lists of
                  ("event", id, kind, value)  a reply's events (app.engine.manager.follow_reply)
                  ("result", id, error, value)
"""

import atexit
import functools
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Iterator

from app import limits
from app.config import AppConfig
from app.engine.manager import ModelManager, as_user_error, follow_reply
from app.engine.stop_signal import StopSignal
from app.errors import UserError

log = logging.getLogger(__name__)


class EngineClient:
    """The web side: the model manager's interface, answered by an engine process over one connection.

    EngineProcess starts the engine process it talks to; EngineConnection connects to one that another
    process started. Each does its own thing when the connection is lost (`_connection_lost`)."""

    def __init__(self, config: AppConfig):
        self.config = config
        self.metrics = _RemoteMetrics(self._call)
        self._ids = itertools.count()
        self._streams: dict[int, queue.SimpleQueue] = {}  # id -> the reply's events
        self._calls: dict[int, queue.SimpleQueue] = {}  # id -> where the result goes
        self._send_lock = threading.Lock()
        self._ready = threading.Event()  # connected to an engine process that serves
        self._connection = None
        self._closing = False
        self._default_settings = None  # cached per loaded model (see default_settings)

    @property
    def loaded(self) -> bool:
        return self._ready.is_set()

    def warm_up(self) -> float:
        return self._call("warm_up")

    def _serve_over(self, connection) -> None:
        """Talk to the engine process over `connection` from now on (a thread of its own reads it)."""
        self._connection = connection
        self._default_settings = None
        threading.Thread(target=self._read, args=(connection,), name="engine-reader", daemon=True).start()
        self._ready.set()
        self._tokenizer_for(self.info().path)  # loaded now rather than in the first reply

    def _read(self, connection) -> None:
        """Hand every message of the engine process to its reply or call, until the connection ends."""
        try:
            while True:
                for message in connection.recv():
                    target = (self._streams if message[0] == "event" else self._calls).get(message[1])
                    if target is not None:
                        target.put(message[2:])
        except (EOFError, OSError):
            pass
        if self._closing:
            return
        self._ready.clear()
        lost = UserError(limits.MSG_ENGINE_PROCESS_LOST)
        for events in list(self._streams.values()):
            events.put(("error", lost))
        for results in list(self._calls.values()):
            results.put((lost, None))
        self._connection_lost()

    def _connection_lost(self) -> None:
        """Runs on the reader's thread once the replies and calls in flight have been told."""
        raise NotImplementedError

    def _send(self, message, wait: bool = True) -> None:
        """Send `message`; while the engine process (re)starts, wait for it (or, not `wait`, drop the message)."""
        if not self._ready.wait(limits.SWITCH_WAIT_S if wait else 0):
            if not wait:
                return
            raise UserError(limits.MSG_ENGINE_PROCESS_DOWN)
        try:
            with self._send_lock:
                self._connection.send(message)
        except (OSError, ValueError) as error:  # the process has just died: the reader deals with it
            raise UserError(limits.MSG_ENGINE_PROCESS_LOST) from error

    def _call(self, method: str, *args):
        call_id = next(self._ids)
        results = self._calls[call_id] = queue.SimpleQueue()
        try:
            self._send(("call", call_id, method, args))
            error, value = results.get()
        finally:
            del self._calls[call_id]
        if error is not None:
            raise error
        return value

    # The model manager's interface -------------------------------------------------------------------

    def info(self):
        return self._call("info")

    def default_settings(self):
        # Every request starts from them and they change only with the model: a round trip per load, not per request.
        if self._default_settings is None:
            self._default_settings = self._call("default_settings")
        return self._default_settings

    def plan_images(self, paths, settings):
        return self._call("plan_images", paths, settings)

    @property
    def max_context_tokens(self) -> int:
        return self._call("max_context_tokens")

    @property
    def active_generations(self) -> int:
        return self._call("active_generations")

    def profile_gpu(self, seconds: float) -> dict:
        return self._call("profile_gpu", seconds)

    def switch(self, model: str) -> dict:
        try:
            result = self._call("switch", model)
        finally:
            self._default_settings = None
        self.config = replace(self.config, model=model)  # so that a restarted engine process loads this one
        self._tokenizer_for(self.info().path)
        return result

    def stream(self, messages: list[dict], settings, stop: StopSignal | None = None) -> Iterator:
        """Stream a reply, as ModelManager.stream does."""
        requested_at = time.perf_counter()
        request_id = next(self._ids)
        events = self._streams[request_id] = queue.SimpleQueue()
        if stop is not None:
            stop.on_set(lambda: events.put(("stopped", None)))

        def close(outcome: str) -> None:
            del self._streams[request_id]
            try:
                self._send(("done", request_id, outcome), wait=False)
            except UserError:  # the engine process is gone, and the request with it
                pass

        try:
            self._send(("stream", request_id, _plain(messages), settings, requested_at))
        except UserError:
            del self._streams[request_id]
            raise
        yield from follow_reply(events, self._tokenizer_for, requested_at, close)

    def _tokenizer_for(self, model_path: str):
        return _tokenizer(model_path, self.config.trust_remote_code)


class EngineProcess(EngineClient):
    """Starts the engine process and talks to it over a pipe; starts a new one if it dies.

    `listen` = (socket path, key): the engine process also serves web processes that connect there
    (EngineConnection), which is how several web processes share it (app.web_processes)."""

    def __init__(self, config: AppConfig, listen: tuple[str, bytes] | None = None):
        super().__init__(config)
        self.listen = listen
        self._process = None

    @property
    def pid(self) -> int | None:
        """The engine process's id (tools that watch its CPU use); None before load()."""
        return self._process.pid if self._process is not None else None

    def load(self) -> None:
        """Start the engine process and wait until it has loaded the model (errors of the load are raised here)."""
        context = multiprocessing.get_context("spawn")  # a fork would copy the web server's threads and locks
        ours, theirs = context.Pipe()
        # Not a daemon: it starts processes of its own (app.engine.preparers); close() ends it at exit.
        process = context.Process(target=serve, args=(self.config, theirs, self.listen), name="minicpmv-engine")
        process.start()
        theirs.close()
        try:
            _, error = ours.recv()  # ("ready", error), after the model has loaded
        except EOFError:
            process.join()
            raise RuntimeError(f"The engine process stopped while loading the model (exit code {process.exitcode})") from None
        if error is not None:
            process.join()
            raise error
        if self._process is None:
            atexit.register(self.close)  # before multiprocessing stops the process, so that it is not restarted
        self._process = process
        self._serve_over(ours)
        log.info("Engine process %d serves %s", process.pid, self.config.model)

    def close(self) -> None:
        """Stop the engine process; also run at exit."""
        if self._closing or self._connection is None:
            return
        try:
            self._send(("stop", None), wait=False)
        except UserError:  # already gone
            pass
        self._closing = True
        self._ready.clear()
        self._process.join(30)

    def _connection_lost(self) -> None:
        self._process.join(5)
        log.error("The engine process stopped (exit code %s); starting a new one", self._process.exitcode)
        try:
            self.load()
            if self.config.warmup:
                self.warm_up()
        except Exception as error:
            log.error("The engine process could not be started again; requests are refused", exc_info=error)


class EngineConnection(EngineClient):
    """A web process's connection to an engine process that another process started and keeps running
    (EngineProcess with `listen`). When the connection is lost it connects again, to the new engine process."""

    def __init__(self, config: AppConfig, address: str, key: bytes):
        super().__init__(config)
        self.address, self.key = address, key

    def load(self) -> None:
        """Connect; waits up to limits.ENGINE_CONNECT_TIMEOUT_S for the engine process to listen."""
        deadline = time.monotonic() + limits.ENGINE_CONNECT_TIMEOUT_S
        while True:
            try:
                connection = multiprocessing.connection.Client(self.address, authkey=self.key)
                break
            except (OSError, EOFError):  # not listening yet, or still the socket of one that is dying
                if time.monotonic() > deadline:
                    raise RuntimeError(f"No engine process listens at {self.address}") from None
                time.sleep(0.2)
        self._serve_over(connection)

    def close(self) -> None:
        self._closing = True
        self._ready.clear()
        if self._connection is not None:
            self._connection.close()

    def _connection_lost(self) -> None:
        log.error("Lost the engine process; connecting to its successor")
        try:
            self.load()
        except Exception as error:
            log.error("No engine process to connect to; requests are refused", exc_info=error)


def _plain(value):
    """Messages in built-in types only: Gradio hands file paths as its own str subclass, and unpickling
    one would import Gradio into the engine process (seconds, on its first request)."""
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, str):
        return str(value)
    return value


@functools.lru_cache(maxsize=4)
def _tokenizer(model_path: str, trust_remote_code: bool):
    """The tokenizer of the checkpoint the engine process serves, to turn token ids into text here."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)


class _RemoteMetrics:
    """EngineMetrics' reading side, answered by the engine process."""

    def __init__(self, call):
        self._call = call

    def snapshot(self) -> dict:
        return self._call("metrics.snapshot")

    def prometheus(self) -> str:
        return self._call("metrics.prometheus")

    def reset(self) -> None:
        self._call("metrics.reset")


# The engine side ---------------------------------------------------------------------------------------

def serve(config: AppConfig, connection, listen: tuple[str, bytes] | None = None) -> None:
    """The engine process's main: load the model, then serve its parent (and, with `listen`, the web
    processes that connect) until the parent goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C in a terminal reaches us too: the parent stops us
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    manager = ModelManager(config)
    try:
        manager.load()
    except Exception as error:
        if not isinstance(error, UserError):
            log.error("Loading the model failed", exc_info=error)
        connection.send(("ready", _wire_error(error)))
        return
    if listen is not None:
        address, key = listen
        if os.path.exists(address):  # the socket of the engine process this one replaces
            os.unlink(address)
        listener = multiprocessing.connection.Listener(address, family="AF_UNIX", authkey=key)
        threading.Thread(target=_accept, args=(manager, listener), name="engine-listener", daemon=True).start()
    connection.send(("ready", None))
    _EngineSide(manager, connection).run()
    manager.preparer.close()  # its worker processes first: this process's exit waits for them


def _accept(manager, listener) -> None:
    """Serve each web process that connects, on threads of its own."""
    while True:
        try:
            connection = listener.accept()
        except (OSError, EOFError, multiprocessing.AuthenticationError) as error:  # a stranger, or one that left
            log.warning("Refused a connection: %s", error)
            continue
        side = _EngineSide(manager, connection)
        threading.Thread(target=side.run, kwargs={"cancel_when_gone": True}, name="engine-connection", daemon=True).start()


class _EngineSide:
    def __init__(self, manager, connection):
        self.manager = manager
        self.connection = connection
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.requests: dict[int, threading.Event] = {}  # id -> the request's cancelled flag, until it is done
        # Threads that wait for the manager's preparer (which bounds the work) and put requests in line.
        self.preparing = ThreadPoolExecutor(32, thread_name_prefix="prepare")
        self.calls = ThreadPoolExecutor(4, thread_name_prefix="call")

    def run(self, cancel_when_gone: bool = False) -> None:
        """Serve the connection until it ends; `cancel_when_gone`: its requests then leave the batch (a web
        process that went away; when the parent goes, the whole process ends)."""
        threading.Thread(target=self._send_batches, name="engine-sender", daemon=True).start()
        while True:
            try:
                message = self.connection.recv()
            except (EOFError, OSError):
                break
            kind, message_id, *rest = message
            if kind == "stop":
                break
            if kind == "stream":
                self.requests[message_id] = cancelled = threading.Event()
                self.preparing.submit(self._start, message_id, cancelled, *rest)
            elif kind == "done":
                cancelled = self.requests.pop(message_id, None)
                if cancelled is not None:
                    self.manager.end_request(cancelled, rest[0])
            elif kind == "call":
                self.calls.submit(self._answer, message_id, *rest)
        if cancel_when_gone:
            for cancelled in list(self.requests.values()):
                self.manager.end_request(cancelled, "stopped")
            self.outbox.put(None)  # ends the sender
            self.preparing.shutdown(wait=False)
            self.calls.shutdown(wait=False)

    def _start(self, request_id: int, cancelled: threading.Event, messages, settings, requested_at: float) -> None:
        def emit(kind: str, value) -> None:
            self.outbox.put(("event", request_id, kind, as_user_error(value) if kind == "error" else value))

        if cancelled.is_set():  # dropped while it waited for a preparing thread
            return
        try:
            self.manager.start(messages, settings, emit, requested_at, cancelled)
        except Exception as error:  # bad input: not counted as a request, as in-process
            self.requests.pop(request_id, None)
            if not cancelled.is_set():  # else nobody waits for it (stopped while it was prepared)
                emit("error", error)

    def _answer(self, call_id: int, method: str, args: tuple) -> None:
        try:
            target = self.manager
            for name in method.split("."):
                target = getattr(target, name)
            value = target(*args) if callable(target) else target
            self.outbox.put(("result", call_id, None, value))
        except Exception as error:
            self.outbox.put(("result", call_id, _wire_error(error), None))

    def _send_batches(self) -> None:
        """One write for every message ready: hundreds of replies stream at once."""
        while True:
            batch = [self.outbox.get()]
            while not self.outbox.empty():
                batch.append(self.outbox.get())
            if None in batch:
                return
            try:
                self.connection.send(batch)
            except (OSError, ValueError):  # gone: run() ends too
                return


def _wire_error(error: BaseException) -> Exception:
    """An error of a call as the web process should see it: a UserError as it is, others by type and message
    (an exception of a library may not survive pickling)."""
    if isinstance(error, UserError):
        return error
    return RuntimeError(f"{type(error).__name__}: {error}")
