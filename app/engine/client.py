"""The web side's end of the engine process (app.engine.process): EngineProcess starts the engine process
and talks to it over a pipe; EngineConnection, in each of several web processes, over a local socket. Both
have the model manager's interface (app.engine.core.ModelManager), so the UI does not know which one it
talks to. No torch here.
"""

import atexit
import functools
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import queue
import threading
import time
from dataclasses import replace
from typing import Iterator

from app import limits, tuning
from app.messages import MSG_ENGINE_PROCESS_DOWN, MSG_ENGINE_PROCESS_LOST
from app.config import AppConfig
from app.engine.api import EngineCall
from app.engine.replies import follow_reply
from app.engine.stop_signal import StopSignal
from app.engine.api import ReplyEvent
from app.errors import NotReady, UserError

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
        self._switching = False  # a model switch this process asked for is under way

    @property
    def loaded(self) -> bool:
        """Connected to an engine process that takes requests (not while it restarts or switches models)."""
        return self._ready.is_set() and not self._switching

    def warm_up(self) -> float:
        return self._call(EngineCall.WARM_UP)

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
        lost = NotReady(MSG_ENGINE_PROCESS_LOST)
        for events in list(self._streams.values()):
            events.put((ReplyEvent.ERROR, lost))
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
            raise NotReady(MSG_ENGINE_PROCESS_DOWN)
        try:
            with self._send_lock:
                self._connection.send(message)
        except (OSError, ValueError) as error:  # the process has just died: the reader deals with it
            raise NotReady(MSG_ENGINE_PROCESS_LOST) from error

    def _call(self, method: EngineCall, *args):
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
        return self._call(EngineCall.INFO)

    def default_settings(self):
        # Every request starts from them and they change only with the model: a round trip per load, not per request.
        if self._default_settings is None:
            self._default_settings = self._call(EngineCall.DEFAULT_SETTINGS)
        return self._default_settings

    def plan_images(self, paths, settings):
        return self._call(EngineCall.PLAN_IMAGES, paths, settings)

    @property
    def max_context_tokens(self) -> int:
        return self._call(EngineCall.MAX_CONTEXT_TOKENS)

    @property
    def active_generations(self) -> int:
        return self._call(EngineCall.ACTIVE_GENERATIONS)

    def profile_gpu(self, seconds: float) -> dict:
        return self._call(EngineCall.PROFILE_GPU, seconds)

    def switch(self, model: str) -> dict:
        self._switching = True
        try:
            result = self._call(EngineCall.SWITCH, model)
        finally:
            self._switching = False
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
            stop.on_set(lambda: events.put((ReplyEvent.STOPPED, None)))

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
        yield from follow_reply(events, self._tokenizer_for, requested_at, close, settings=settings)

    def _tokenizer_for(self, model_path: str):
        return _tokenizer(model_path, self.config.trust_remote_code)


class EngineProcess(EngineClient):
    """Starts the engine process and talks to it over a pipe; starts a new one if it dies.

    `listen` = (socket path, key): the engine process also serves web processes that connect there
    (EngineConnection), which is how several web processes share it (app.web.processes)."""

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
        from app.engine.process import serve  # the engine side's module: light, it imports the model lazily

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
        """Connect; waits up to tuning.ENGINE_CONNECT_TIMEOUT_S for the engine process to listen."""
        deadline = time.monotonic() + tuning.ENGINE_CONNECT_TIMEOUT_S
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
        return self._call(EngineCall.METRICS_SNAPSHOT)

    def prometheus(self) -> str:
        return self._call(EngineCall.METRICS_PROMETHEUS)

    def reset(self) -> None:
        self._call(EngineCall.METRICS_RESET)

    def history(self) -> list[dict]:
        return self._call(EngineCall.METRICS_HISTORY)
