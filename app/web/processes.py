"""Several web processes sharing one engine process, behind one address (--web-processes N).

Why: one web process's Python is the limit of the app path under load. On an H200 at 200 users the one
web process ran at 0.8 of a core (Gradio's uploads, queue and server-sent events, and the text of 200
streaming replies) while the GPU was busy 66% of the time, and the app delivered 2,635 tokens/s where the
engine called from a script delivered 4,066 (docs/DECISIONS.md D28). Gradio serves a session from one
process, so the processes cannot simply share a port: app.web.proxy sends each session to its own process.

Layout, all started here: the engine process (app.engine.process, listening on a local socket),
then N web processes one after another (each the whole Gradio app on a local port, with its own
connection to the engine process), then the front processes (app.web.proxy.Front), which take turns at the
public address's socket. This process watches them until it is stopped (Ctrl+C, SIGTERM). A web or front
process that dies is started again; the engine process is restarted by its EngineProcess, as with one
web process, and the web processes connect to the new one.
"""

import logging
import multiprocessing
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import replace

from app import tuning
from app.config import AppConfig
from app.startup import start_process, started
from app.engine.client import EngineConnection, EngineProcess

log = logging.getLogger(__name__)

def start_engine(config: AppConfig) -> EngineProcess:
    """The engine process, listening for web processes on a socket of its own; loaded and warmed up."""
    address = os.path.join(tempfile.mkdtemp(prefix="minicpmv-engine-"), "engine.sock")
    from app.engine.backends import load_and_warm_up

    engine = EngineProcess(config, listen=(address, os.urandom(32)))
    load_and_warm_up(engine, config)
    return engine


class ChildProcesses:
    """`count` processes of one kind, each telling the parent when it serves; one that dies is started again."""

    kind = "Child process"

    def __init__(self, count: int):
        self._processes: list = [None] * count
        self._context = multiprocessing.get_context("spawn")  # a fork would copy this process's threads
        self._ready = self._context.Queue()
        self._closing = threading.Event()

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes if process is not None]

    def _main(self, index: int) -> tuple:
        """The child's target and its arguments (the ready queue is added)."""
        raise NotImplementedError

    def _serves(self, index: int) -> str:
        raise NotImplementedError

    def start(self) -> None:
        self._start(range(len(self._processes)))
        self._watch_thread()

    def _watch_thread(self) -> None:
        threading.Thread(target=self._watch, name=f"{self.kind.lower()}-watch", daemon=True).start()

    def _start(self, indices) -> None:
        """Start the processes `indices` and wait until every one of them serves."""
        starting = {}
        for index in indices:
            target, *args = self._main(index)
            process = self._context.Process(target=target, args=(*args, self._ready),
                                            name=f"minicpmv-{self.kind.lower().replace(' ', '-')}-{index}")
            process.start()
            self._processes[index] = starting[index] = process
        deadline = time.monotonic() + tuning.WEB_PROCESS_START_TIMEOUT_S
        while starting:
            try:
                index = self._ready.get(timeout=1)
            except queue.Empty:
                for late, process in starting.items():
                    if not process.is_alive() or time.monotonic() > deadline:
                        process.kill()
                        raise RuntimeError(f"{self.kind} {late} did not start (exit code {process.exitcode}); see the log above")
                continue
            if index in starting:
                process = starting.pop(index)
                log.info("%s %d (pid %d) serves %s", self.kind, index, process.pid, self._serves(index))

    def _watch(self) -> None:
        while not self._closing.wait(1):
            for index, process in enumerate(self._processes):
                if process.is_alive() or self._closing.is_set():
                    continue
                log.error("%s %d stopped (exit code %s); starting a new one", self.kind, index, process.exitcode)
                try:
                    self._start([index])
                except RuntimeError as error:
                    log.error("%s", error)

    def stop(self) -> None:
        """Ask every process to end (SIGTERM), without waiting."""
        self._closing.set()
        for process in self._processes:
            if process is not None and process.is_alive():
                process.terminate()

    def close(self) -> None:
        self.stop()
        for process in self._processes:
            if process is not None:
                process.join(10)
                if process.is_alive():  # stuck: it must not outlive the app
                    process.kill()


class WebProcesses(ChildProcesses):
    """`count` web processes on local ports, each serving the whole app over its own engine connection."""

    kind = "Web process"

    def __init__(self, config: AppConfig, engine_listen: tuple[str, bytes], count: int):
        super().__init__(count)
        self.config, self.engine_listen = config, engine_listen
        self.ports = [_free_port() for _ in range(count)]

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    def _main(self, index: int) -> tuple:
        local = replace(self.config, host="127.0.0.1", port=self.ports[index], public_host=self.config.host)
        return _serve_web, local, index, self.engine_listen

    def _serves(self, index: int) -> str:
        return f"on port {self.ports[index]}"

    def start(self) -> None:
        # The first caches the example media in the shared upload folder; the others, started together
        # after it, find them there. Each takes seconds (Gradio's import, the UI), one after another
        # 20 s each on an H200 box.
        self._start([0])
        self._start(range(1, len(self.ports)))
        self._watch_thread()


class Fronts(ChildProcesses):
    """`count` proxy processes (app.web.proxy) taking turns at one listening socket, the public address.

    Why more than one: every byte of every upload and every streamed message of every user passes through
    the proxy. On the dev machine it spends about 12 ms of CPU on one 5.4 MB upload (a web process 25); a
    burst of 200 users' uploads is then seconds of one process's work, whatever the web processes' count
    (docs/DECISIONS.md D29).
    The socket is bound here, once: a port already taken fails here, clearly, and the processes inherit it.
    """

    kind = "Front"

    def __init__(self, host: str, port: int, backends: list[str], count: int):
        from app.web.proxy import MovedSessions

        super().__init__(count)
        self.host, self.port, self.backends = host, port, backends
        self.moved = MovedSessions(self._context)  # shared by the fronts, and kept for one that is started again
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self.socket = socket.create_server((host, port), family=family, backlog=2048)
        except OSError as error:
            raise RuntimeError(f"Could not serve on {host}:{port}: {error}") from None

    def _main(self, index: int) -> tuple:
        return _serve_front, index, self.socket, self.backends, self.moved

    def _serves(self, index: int) -> str:
        return f"{self.host}:{self.port} for {len(self.backends)} web processes"

    def close(self) -> None:
        super().close()
        self.socket.close()


def _serve_web(config: AppConfig, index: int, engine_listen: tuple[str, bytes], ready) -> None:
    """A web process's main: connect to the engine process, then serve the app on config's local port."""
    # The parent stops us with SIGTERM: exit as Python does, releasing what we hold.
    start_process(f"web {index}", on_sigterm=lambda: sys.exit(0))
    from app.web.server import launch

    manager = EngineConnection(config, *engine_listen)
    manager.load()
    demo = launch(config, manager, prevent_thread_lock=True, quiet=True)
    ready.put(index)
    demo.block_thread()


def _serve_front(index: int, listening: socket.socket, backends: list[str], moved, ready) -> None:
    """A front's main: serve the public address's connections that this process accepts, until SIGTERM."""
    stop = threading.Event()
    start_process(f"front {index}", on_sigterm=stop.set)
    server = start_front(listening, backends, moved)
    started()  # 212,000 start-up objects, 0.17-0.21 s a full collection on the dev machine
    ready.put(index)
    while not stop.wait(0.5) and server.thread.is_alive():
        pass
    # The parent stops the web processes next: the streams relayed from them end, and uvicorn's graceful
    # shutdown with them.
    server.front.closing = True
    server.should_exit = True
    server.thread.join(15)


def start_front(listening: socket.socket, backends: list[str], moved=None):
    """Serve connections of the `listening` socket (uvicorn, on a thread of its own, so that it installs no
    signal handlers) until the returned server's should_exit is set; `moved`: app.web.proxy.MovedSessions, if shared."""
    import uvicorn

    from app.web.proxy import Front

    front = Front(backends, moved)
    server = uvicorn.Server(uvicorn.Config(front, lifespan="off", ws="none", log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, name="front", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("The front did not start; see the log above")
        time.sleep(0.05)
    server.thread, server.front = thread, front
    return server


def serve_with_web_processes(config: AppConfig) -> None:
    """Start everything, serve until Ctrl+C or SIGTERM, then stop every process."""
    from app.web.server import use_upload_folder

    use_upload_folder(config)  # before the web processes start: they share it
    engine = start_engine(config)
    web = WebProcesses(config, engine.listen, config.web_processes)
    fronts = None
    try:
        web.start()
        fronts = Fronts(config.host, config.port, web.urls, front_processes(config))
        fronts.start()
        stop = threading.Event()
        for signal_number in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signal_number, lambda *_: stop.set())
        proxies = len(fronts.pids)
        print(f"* Running on http://{config.host}:{config.port} ({config.web_processes} web processes, "
              f"{proxies} proxy process{'es' if proxies > 1 else ''}, one engine process)", flush=True)
        while not stop.wait(0.5):  # a timed wait: the signal handlers run between waits
            pass
    finally:
        close_serving(web, fronts)
        engine.close()
        shutil.rmtree(os.path.dirname(engine.listen[0]), ignore_errors=True)  # the engine's socket


def close_serving(web: WebProcesses, fronts: Fronts | None) -> None:
    """Stop the web processes and the proxies in front of them (None: not started)."""
    if fronts is not None:
        fronts.stop()  # first: they stop taking connections, and end as the streams they relay end
    web.close()
    if fronts is not None:
        fronts.close()


def front_processes(config: AppConfig) -> int:
    """--front-processes, or when it is 0, one for every WEB_PROCESSES_PER_FRONT web processes."""
    return config.front_processes or -(-config.web_processes // tuning.WEB_PROCESSES_PER_FRONT)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
