"""A level's users (benchmarks/concurrency.py): threads of this process, each sending its requester's
requests back to back, or clients in processes of their own (app and openai modes), each process's users
connected and their conversations opened before the level's clock starts."""

import os
import ssl
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.cpu_use import CpuUse, own_cpu_seconds
from benchmarks.requesters import Aborted, app_requester, openai_requesters

CLIENT_PROCESSES = 8  # app mode: gradio_client users are spread over this many processes


def opened_users(make_requester, first_user: int, users: int) -> list:
    """`make_requester(user)` for each of `users` users numbered from `first_user`, all at once (a
    follow-up's users open their conversations together, as a level's first requests would)."""
    with ThreadPoolExecutor(max_workers=users) as pool:
        return list(pool.map(make_requester, range(first_user, first_user + users)))


def drive_users(requesters: list, stop_issuing: float, deadline: float) -> tuple[list, list, int]:
    """A thread for each of `requesters` (one user's), sending requests back to back until stop_issuing
    (wall-clock time); what is still in flight at `deadline` is aborted. Returns (ttft ms, latency ms, new
    tokens, finished at, stats) per request, failures, and the number aborted."""
    results, failures, aborted = [], [], []
    lock = threading.Lock()
    abort = threading.Event()

    def user(request):
        while time.time() < stop_issuing:
            started = time.time()
            try:
                ttft_ms, stats = request(abort)
                with lock:
                    results.append((ttft_ms, (time.time() - started) * 1000, stats["new_tokens"], time.time(), stats))
            except Aborted:
                with lock:
                    aborted.append(1)
            except Exception as error:  # counted and reported; a busy answer is retried a second later
                with lock:
                    failures.append(repr(error)[:200])
                time.sleep(1.0)

    threads = [threading.Thread(target=user, args=(request,), daemon=True) for request in requesters]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.time()))
    abort.set()  # what is still waiting or streaming leaves now, so the next level starts clean
    for thread in threads:
        thread.join(60)
    return results, failures, len(aborted)


def _app_client_process(url, users, first_user, duration, grace, workload, settings, switch_interval, ready, go,
                        out) -> None:
    """Clients in a process of their own, so that they do not share the server's GIL (openai mode: `url`
    is ("openai", the API's base URL, the model's name, plain HTTP or the SDK))."""
    from gradio_client import Client

    # A client's upload, like a web process's, is many small steps, each waiting for the GIL among the
    # process's other users' threads; a browser user's is not.
    sys.setswitchinterval(switch_interval)

    # A client's first contact fetches the app's config and API description, and its first request
    # builds a session in the server: heavy work for the web process that a user with the page open
    # has behind them. Done here, 200 clients connecting at once took seconds of a level's window.
    # gradio_client makes a new httpx client for each upload and each request, and with it a TLS context
    # that loads the CA certificates (even for http URLs): at 200 users 30% of a client process's CPU
    # (py-spy). One context per process, made here, is what a browser's TLS setup amounts to.
    tls = ssl.create_default_context()
    connecting = time.time()
    if isinstance(url, tuple):
        make_requester = openai_requesters(*url[1:], workload, settings, users)
    else:
        clients = [Client(url, verbose=False, ssl_verify=tls) for _ in range(users)]

        def make_requester(user):
            return app_requester(clients[user - first_user], workload, settings, user)
    connect_s = time.time() - connecting
    opening = time.time()
    requesters = opened_users(make_requester, first_user, users)

    ready.put((connect_s, time.time() - opening))
    go.wait()
    started, cpu_started = time.time(), own_cpu_seconds()
    results = drive_users(requesters, started + duration, started + duration + grace)
    out.put((*results, own_cpu_seconds() - cpu_started, time.time() - started))


def run_clients(users: int, first_user: int, duration: float, grace: float, metrics, app, engine_pid, serving,
                client_processes: int) -> tuple:
    """run_level's users as clients in processes of their own: their results, failures, unfinished count, the
    cores they used, the seconds they took to connect and to open their conversations, the CPU measure and
    the level's start."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    ready, go, out = context.Queue(), context.Event(), context.Queue()
    url, workload, settings, switch_interval = app
    shares = [users // client_processes + (i < users % client_processes) for i in range(client_processes)]
    firsts = [first_user + sum(shares[:i]) for i in range(client_processes)]
    processes = [context.Process(target=_app_client_process, args=(url, share, first, duration, grace, workload, settings,
                                                                   switch_interval, ready, go, out))
                 for share, first in zip(shares, firsts) if share]
    for process in processes:
        process.start()
    readiness = [ready.get(timeout=600) for _ in processes]
    metrics.reset()  # also the GPU memory peak
    cpu = CpuUse(engine_pid or os.getpid(), clients=tuple(process.pid for process in processes), serving=serving)
    started = time.time()
    go.set()
    results, failures, unfinished, client_cores = [], [], 0, 0.0
    for _ in processes:
        part = out.get(timeout=duration + grace + 180)
        results += part[0]
        failures += part[1]
        unfinished += part[2]
        client_cores += part[3] / part[4]
    for process in processes:
        process.join(30)
    return (results, failures, unfinished, client_cores, max(r[0] for r in readiness), max(r[1] for r in readiness),
            cpu, started)
