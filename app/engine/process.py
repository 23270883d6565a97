"""The engine in a process of its own, so that the GPU's scheduler does not share the web server's GIL.

Why: the scheduler thread drives the GPU through many short torch calls, and gives up Python's GIL and
waits to take it back at each. Sharing one process with Gradio's event loop, hundreds of streaming
handlers and the text decoding of every reply, it waited for the GIL longer than for the GPU: on an H200
a decode step of 11.8 ms took 32.8 ms in-process at 200 users, 41 ms through the app
(docs/DECISIONS.md D1). So, as vLLM splits its API server from its engine core, the engine process
holds the model, the scheduler and the preparation of inputs (images decoded and sliced, prompts
rendered); the web process keeps the UI, turns token ids into text and follows each reply.

EngineProcess has the model manager's interface (app.engine.core.ModelManager), so the UI does not
know which one it talks to. If the engine process dies (a crash in a GPU driver, say), replies in flight
end with a clear message and a new engine process is started and warmed up.

With several web processes (app.web.processes) the engine process also listens on a local socket and
serves each web process over a connection of its own (EngineConnection) as it serves its parent over the
pipe; a web process that goes away takes its requests out of the batch. The parent restarts the engine
process when it dies, and the web processes connect to the new one.

Messages, pickled over the pipe or a connection:
  web -> engine   ("stream", id, messages, settings, requested_at)   start a reply
                  ("done", id, outcome)                              the web side is done with it
                  ("call", id, method, args)                         an api.EngineCall (info, switch, metrics...)
                  ("stop", None)                                     end the process
  engine -> web   ("ready", error) once, after loading (error None); then lists of
                  ("event", id, kind, value)  a reply's events (app.engine.replies.follow_reply)
                  ("result", id, error, value)
"""

import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

from app.config import AppConfig
from app.startup import start_process
from app.engine.replies import as_user_error
from app.engine.api import EngineCall, ReplyEvent
from app.errors import UserError

log = logging.getLogger(__name__)


# How the engine process answers each EngineCall: with the model manager's own method or property.
_CALLS = {
    EngineCall.WARM_UP: lambda manager: manager.warm_up(),
    EngineCall.INFO: lambda manager: manager.info(),
    EngineCall.DEFAULT_SETTINGS: lambda manager: manager.default_settings(),
    EngineCall.PLAN_IMAGES: lambda manager, paths, settings: manager.plan_images(paths, settings),
    EngineCall.MAX_CONTEXT_TOKENS: lambda manager: manager.max_context_tokens,
    EngineCall.ACTIVE_GENERATIONS: lambda manager: manager.active_generations,
    EngineCall.PROFILE_GPU: lambda manager, seconds: manager.profile_gpu(seconds),
    EngineCall.SWITCH: lambda manager, model: manager.switch(model),
    EngineCall.METRICS_SNAPSHOT: lambda manager: manager.metrics.snapshot(),
    EngineCall.METRICS_PROMETHEUS: lambda manager: manager.metrics.prometheus(),
    EngineCall.METRICS_RESET: lambda manager: manager.metrics.reset(),
    EngineCall.METRICS_HISTORY: lambda manager: manager.metrics.history(),
}


def serve(config: AppConfig, connection, listen: tuple[str, bytes] | None = None) -> None:
    """The engine process's main: load the model, then serve its parent (and, with `listen`, the web
    processes that connect) until the parent goes away."""
    start_process("engine")
    from app.engine.core import ModelManager  # here, not at import: the web side imports this module's serve

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
            self.outbox.put(("event", request_id, kind, as_user_error(value) if kind == ReplyEvent.ERROR else value))

        if cancelled.is_set():  # dropped while it waited for a preparing thread
            return
        try:
            self.manager.start(messages, settings, emit, requested_at, cancelled)
        except Exception as error:  # bad input: not counted as a request, as in-process
            self.requests.pop(request_id, None)
            if not cancelled.is_set():  # else nobody waits for it (stopped while it was prepared)
                emit(ReplyEvent.ERROR, error)

    def _answer(self, call_id: int, method: str, args: tuple) -> None:
        try:
            value = _CALLS[EngineCall(method)](self.manager, *args)
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
