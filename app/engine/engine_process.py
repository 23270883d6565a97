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

Messages, pickled over one duplex pipe:
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
from app.errors import UserError

log = logging.getLogger(__name__)


class EngineProcess:
    """The web side: the model manager's interface, served by the engine process."""

    def __init__(self, config: AppConfig):
        self.config = config
        self.metrics = _RemoteMetrics(self._call)
        self._ids = itertools.count()
        self._streams: dict[int, queue.SimpleQueue] = {}  # id -> the reply's events
        self._calls: dict[int, queue.SimpleQueue] = {}  # id -> where the result goes
        self._send_lock = threading.Lock()
        self._ready = threading.Event()  # an engine process is up and serving
        self._process = None
        self._connection = None
        self._closing = False
        self._default_settings = None  # cached per loaded model (see default_settings)

    # Life of the engine process --------------------------------------------------------------------

    @property
    def loaded(self) -> bool:
        return self._ready.is_set()

    @property
    def pid(self) -> int | None:
        """The engine process's id (tools that watch its CPU use); None before load()."""
        return self._process.pid if self._process is not None else None

    def load(self) -> None:
        """Start the engine process and wait until it has loaded the model (errors of the load are raised here)."""
        context = multiprocessing.get_context("spawn")  # a fork would copy the web server's threads and locks
        ours, theirs = context.Pipe()
        # Not a daemon: it starts processes of its own (app.engine.preparers); close() ends it at exit.
        process = context.Process(target=serve, args=(self.config, theirs), name="minicpmv-engine")
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
        self._process, self._connection = process, ours
        self._default_settings = None
        threading.Thread(target=self._read, args=(process, ours), name="engine-reader", daemon=True).start()
        self._ready.set()
        self._tokenizer_for(self.info().path)  # loaded now rather than in the first reply
        log.info("Engine process %d serves %s", process.pid, self.config.model)

    def warm_up(self) -> float:
        return self._call("warm_up")

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

    def _read(self, process, connection) -> None:
        """Hand every message of the engine process to its reply or call, until the process ends."""
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
        process.join(5)
        log.error("The engine process stopped (exit code %s); starting a new one", process.exitcode)
        lost = UserError(limits.MSG_ENGINE_PROCESS_LOST)
        for events in list(self._streams.values()):
            events.put(("error", lost))
        for results in list(self._calls.values()):
            results.put((lost, None))
        try:
            self.load()
            if self.config.warmup:
                self.warm_up()
        except Exception as error:
            log.error("The engine process could not be started again; requests are refused", exc_info=error)

    def _send(self, message, wait: bool = True) -> None:
        """Send `message`; while a new engine process starts, wait for it (or, not `wait`, drop the message)."""
        if not self._ready.wait(limits.SWITCH_WAIT_S if wait else 0):
            if not wait:
                return
            raise UserError(limits.MSG_ENGINE_PROCESS_DOWN)
        try:
            with self._send_lock:
                self._connection.send(message)
        except (OSError, ValueError) as error:  # the process has just died: its reader starts a new one
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

    def switch(self, model: str) -> dict:
        try:
            result = self._call("switch", model)
        finally:
            self._default_settings = None
        self.config = replace(self.config, model=model)  # so that a restarted engine process loads this one
        self._tokenizer_for(self.info().path)
        return result

    def stream(self, messages: list[dict], settings) -> Iterator:
        """Stream a reply, as ModelManager.stream does."""
        requested_at = time.perf_counter()
        request_id = next(self._ids)
        events = self._streams[request_id] = queue.SimpleQueue()

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

def serve(config: AppConfig, connection) -> None:
    """The engine process's main: load the model, then serve the web process until it goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C in a terminal reaches us too: the web process stops us
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    manager = ModelManager(config)
    try:
        manager.load()
    except Exception as error:
        if not isinstance(error, UserError):
            log.error("Loading the model failed", exc_info=error)
        connection.send(("ready", _wire_error(error)))
        return
    connection.send(("ready", None))
    _EngineSide(manager, connection).run()
    manager.preparer.close()  # its worker processes first: this process's exit waits for them


class _EngineSide:
    def __init__(self, manager, connection):
        self.manager = manager
        self.connection = connection
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.requests: dict[int, threading.Event] = {}  # id -> the request's cancelled flag, until it is done
        # Threads that wait for the manager's preparer (which bounds the work) and put requests in line.
        self.preparing = ThreadPoolExecutor(32, thread_name_prefix="prepare")
        self.calls = ThreadPoolExecutor(4, thread_name_prefix="call")

    def run(self) -> None:
        threading.Thread(target=self._send_batches, name="engine-sender", daemon=True).start()
        while True:
            try:
                message = self.connection.recv()
            except (EOFError, OSError):
                return
            kind, message_id, *rest = message
            if kind == "stop":
                return
            if kind == "stream":
                self.requests[message_id] = cancelled = threading.Event()
                self.preparing.submit(self._start, message_id, cancelled, *rest)
            elif kind == "done":
                cancelled = self.requests.pop(message_id, None)
                if cancelled is not None:
                    self.manager.end_request(cancelled, rest[0])
            elif kind == "call":
                self.calls.submit(self._answer, message_id, *rest)

    def _start(self, request_id: int, cancelled: threading.Event, messages, settings, requested_at: float) -> None:
        def emit(kind: str, value) -> None:
            self.outbox.put(("event", request_id, kind, as_user_error(value) if kind == "error" else value))

        if cancelled.is_set():  # dropped while it waited for a preparing thread
            return
        try:
            self.manager.start(messages, settings, emit, requested_at, cancelled)
        except Exception as error:  # bad input: not counted as a request, as in-process
            self.requests.pop(request_id, None)
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
        """One pipe write for every message ready: hundreds of replies stream at once."""
        while True:
            batch = [self.outbox.get()]
            while not self.outbox.empty():
                batch.append(self.outbox.get())
            self.connection.send(batch)


def _wire_error(error: BaseException) -> Exception:
    """An error of a call as the web process should see it: a UserError as it is, others by type and message
    (an exception of a library may not survive pickling)."""
    if isinstance(error, UserError):
        return error
    return RuntimeError(f"{type(error).__name__}: {error}")
