"""N users at once, each sending requests back to back: time to first token, latency, throughput, success.

Each request: one 1344x1344 image (640 visual tokens), a short question, exactly --new-tokens new tokens,
greedy. Each level runs for --duration seconds of new requests, then waits up to --grace seconds for those in
flight; unfinished ones are reported, not hidden. Two modes:
  --mode engine  the engine called from this script, as a Python program would (what the GPU can do),
  --mode app     the full app through gradio_client (what a browser user gets); the clients run in
                 processes of their own, so that they do not slow the server down, and connect before
                 the level's clock starts, as users whose page is open (connecting is timed apart),
  --mode openai  the same requests through the app's OpenAI-compatible API with the official `openai`
                 client, streamed, the image as a base64 data URL (clients as in app mode; the columns
                 that need the engine's own stats of each reply are left out); --mode openai-http: the
                 same with plain httpx clients, each request's JSON body encoded once.
Either way the engine runs in a process of its own, as `python app.py` runs it; --in-process-engine runs
it in the benchmark's (or the app's) process instead, as before that split. In app and openai mode, --web-processes N
serves the app as `python app.py --web-processes N` does: N web processes behind app.web.proxy's proxy, in
--front-processes processes (0: as many as the app would start).
Random weights at the real MiniCPM-V 4.6 shape by default (timings do not depend on weight values):

    python benchmarks/concurrency.py --levels 1,10,50,100,200 --json results.json
    python benchmarks/concurrency.py --model tiny-random --levels 1,4 --duration 10   # a quick CPU check
    python benchmarks/concurrency.py --model tiny-random --mode openai --levels 1,4 --duration 5
"""

import argparse
import json
import os
import ssl
import sys
import threading
import time
from contextlib import closing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.real_shape import DEFAULT_FOLDER, QUESTION, benchmark_request, ensure_real_shape_checkpoint  # noqa: E402
from benchmarks.cpu_use import CpuUse, own_cpu_seconds  # noqa: E402
from benchmarks.report import write_json  # noqa: E402
from benchmarks.streaming_client import streamed_outputs  # noqa: E402


def percentile(values: list[float], fraction: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(fraction * len(ordered)))], 1)


def p50_p95(name: str, values: list[float]) -> dict:
    return {f"{name}_p50": percentile(values, 0.5), f"{name}_p95": percentile(values, 0.95)}


def p50_p95_each(name: str, series: dict[str, list[float]]) -> dict:
    """p50_p95 of several series at once: {name_p50: {key: p50}, name_p95: {key: p95}}."""
    return {f"{name}_{label}": {key: percentile(values, fraction) for key, values in series.items()}
            for label, fraction in (("p50", 0.5), ("p95", 0.95))}


CLIENT_PROCESSES = 8  # app mode: gradio_client users are spread over this many processes


class Aborted(Exception):
    """The level's time ran out while this request was still waiting or streaming."""


def engine_request(manager, messages, settings, abort: threading.Event) -> tuple[float, dict]:
    """(time to first token in ms, the reply's stats), in-process."""
    with closing(manager.stream(messages, settings)) as updates:
        for update in updates:
            if abort.is_set():
                raise Aborted
    return update.stats["ttft_ms"], update.stats


def app_request(client, image_path, settings, abort: threading.Event) -> tuple[float, dict]:
    """(time to first token in ms as the client saw it, the reply's stats), through gradio_client."""
    from gradio_client import handle_file

    started, submitted_at = time.perf_counter(), time.time()
    first = None
    job = client.submit(QUESTION, [handle_file(image_path)], settings, api_name="/ask")
    for reply, _ in streamed_outputs(job, poll_s=0.01):  # 200 users' threads: 10 ms polls
        if abort.is_set():
            job.cancel()
            raise Aborted
        if reply and first is None:
            first = time.perf_counter()
    return round(((first or time.perf_counter()) - started) * 1000, 1), {**job.result()[1], "submitted_at": submitted_at,
                                                                         **status_times(job)}


def openai_request(client, model: str, image_url: str, settings: dict, abort: threading.Event) -> tuple[float, dict]:
    """(time to first token in ms as the client saw it, the reply's new tokens), streamed through the OpenAI-compatible API."""
    started, first, usage = time.perf_counter(), None, None
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                             {"type": "text", "text": QUESTION}]}]
    with client.chat.completions.create(model=model, messages=messages, max_tokens=settings["max_new_tokens"], temperature=0,
                                        stream=True, stream_options={"include_usage": True},
                                        extra_body={"min_tokens": settings["min_new_tokens"]}) as stream:
        for chunk in stream:
            if abort.is_set():
                raise Aborted
            delta = chunk.choices[0].delta if chunk.choices else None
            if first is None and delta is not None and (delta.content or getattr(delta, "reasoning_content", None)):
                first = time.perf_counter()
            usage = chunk.usage or usage
    return round(((first or time.perf_counter()) - started) * 1000, 1), {"new_tokens": usage.completion_tokens}


def http_request(client, url: str, body: bytes, abort: threading.Event) -> tuple[float, dict]:
    """The same request as openai_request, as plain HTTP: its JSON body made once for every request, the
    server-sent events read line by line (what the server can do, without the SDK's work in the client)."""
    started, first, new_tokens = time.perf_counter(), None, None
    with client.stream("POST", url, content=body, headers={"Content-Type": "application/json"}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if abort.is_set():
                raise Aborted
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            deltas = [choice.get("delta") or {} for choice in event.get("choices", [])]
            if first is None and any(delta.get("content") or delta.get("reasoning_content") for delta in deltas):
                first = time.perf_counter()
            new_tokens = (event.get("usage") or {}).get("completion_tokens", new_tokens)
    return round(((first or time.perf_counter()) - started) * 1000, 1), {"new_tokens": new_tokens}


def status_times(job) -> dict:
    """When this client heard (Unix time) that its request joined Gradio's queue, after the upload and the
    join. gradio_client keeps every status update it got, each stamped on arrival, in a queue that nothing
    reads unless the job is iterated."""
    from gradio_client.utils import Status, StatusUpdate

    heard = {}
    updates = job.communicator.updates
    while not updates.empty():
        update = updates.get_nowait()
        if isinstance(update, StatusUpdate):
            heard.setdefault(update.code, update.time.timestamp())
    return {"joined_at": heard[Status.IN_QUEUE]} if Status.IN_QUEUE in heard else {}


def drive_users(users: int, stop_issuing: float, deadline: float, make_requester) -> tuple[list, list, int]:
    """`users` threads sending requests back to back until stop_issuing (wall-clock time); what is still in
    flight at `deadline` is aborted. Returns (ttft ms, latency ms, new tokens, finished at, stats) per
    request, failures, and the number aborted."""
    results, failures, aborted = [], [], []
    lock = threading.Lock()
    abort = threading.Event()

    def user():
        request = make_requester()
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

    threads = [threading.Thread(target=user, daemon=True) for _ in range(users)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.time()))
    abort.set()  # what is still waiting or streaming leaves now, so the next level starts clean
    for thread in threads:
        thread.join(60)
    return results, failures, len(aborted)


def _app_client_process(url, users, duration, grace, image_path, settings, switch_interval, ready, go, out) -> None:
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
        make_requester = _openai_requesters(*url[1:], image_path, settings, users)
    else:
        clients = [Client(url, verbose=False, ssl_verify=tls) for _ in range(users)]

        def make_requester():
            client = clients.pop()
            return lambda abort: app_request(client, image_path, settings, abort)
    connect_s = time.time() - connecting

    ready.put(connect_s)
    go.wait()
    started, cpu_started = time.time(), own_cpu_seconds()
    results = drive_users(users, started + duration, started + duration + grace, make_requester)
    out.put((*results, own_cpu_seconds() - cpu_started, time.time() - started))


def _openai_requesters(base_url: str, model: str, plain_http: bool, image_path: str, settings: dict, users: int):
    """make_requester for openai mode: one client a user, the image as the data URL each request sends;
    `plain_http` (openai-http mode): httpx alone, the body encoded once."""
    import base64

    import httpx
    from openai import OpenAI

    with open(image_path, "rb") as file:
        image_url = f"data:image/{image_path.rsplit('.', 1)[1]};base64," + base64.b64encode(file.read()).decode()
    # One connection a user, as each of them would hold (the SDK's default pool is shared and kept small).
    limits = httpx.Limits(max_connections=users, max_keepalive_connections=users)
    if plain_http:
        body = json.dumps({"model": model, "max_tokens": settings["max_new_tokens"], "min_tokens": settings["min_new_tokens"],
                           "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                           "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                                                     {"type": "text", "text": QUESTION}]}]}).encode()
        http = httpx.Client(limits=limits, timeout=600)
        return lambda: (lambda abort: http_request(http, base_url + "/chat/completions", body, abort))
    client = OpenAI(base_url=base_url, api_key="benchmark", max_retries=0, timeout=600,
                    http_client=httpx.Client(limits=limits, timeout=600))
    return lambda: (lambda abort: openai_request(client, model, image_url, settings, abort))


def run_level(users: int, duration: float, grace: float, metrics, make_requester=None, app=None,
              engine_pid: int | None = None, serving: dict[str, tuple[int, ...]] | None = None,
              client_processes: int = CLIENT_PROCESSES) -> dict:
    """One level; in-process users call `make_requester`, or `app` = (url, image, settings, the clients'
    GIL switch interval) runs clients in up to `client_processes` processes. `metrics` (the engine's) says
    where the scheduler's time went and how much GPU memory the level took at most; the CPU each process
    used is measured too (`serving`: the web and front processes, by group)."""
    import multiprocessing

    metrics.reset()  # also the GPU memory peak
    client_cores = 0.0
    if app is None:
        cpu = CpuUse(engine_pid or os.getpid())
        started = time.time()
        results, failures, unfinished = drive_users(users, started + duration, started + duration + grace, make_requester)
    else:
        context = multiprocessing.get_context("spawn")
        ready, go, out = context.Queue(), context.Event(), context.Queue()
        url, image_path, settings, switch_interval = app
        shares = [users // client_processes + (i < users % client_processes) for i in range(client_processes)]
        processes = [context.Process(target=_app_client_process,
                                     args=(url, share, duration, grace, image_path, settings, switch_interval, ready, go, out))
                     for share in shares if share]
        for process in processes:
            process.start()
        connect_s = max(ready.get(timeout=600) for _ in processes)
        cpu = CpuUse(engine_pid or os.getpid(), clients=tuple(process.pid for process in processes), serving=serving)
        started = time.time()
        go.set()
        results, failures, unfinished = [], [], 0
        for _ in processes:
            part = out.get(timeout=duration + grace + 180)
            results += part[0]
            failures += part[1]
            unfinished += part[2]
            client_cores += part[3] / part[4]
        for process in processes:
            process.join(30)
    cores = cpu.cores()
    ended = max([r[3] for r in results], default=time.time())
    window = ended - started
    ttfts, latencies = [r[0] for r in results], [r[1] for r in results]
    gradio = app is not None and not isinstance(app[0], tuple)  # app mode; openai mode's replies carry no engine stats
    replies = [r[4] for r in results if "preprocess_ms" in r[4]]  # the engine's stats of each reply, where there are
    if gradio:
        to_engine = [(r[4]["requested_at"] - r[4]["submitted_at"]) * 1000 for r in results]
        heard = [r[4] for r in results if "joined_at" in r[4]]
        way_in = {"upload_and_join": [(s["joined_at"] - s["submitted_at"]) * 1000 for s in heard],
                  "gradio_queue": [(s["handler_started_at"] - s["joined_at"]) * 1000 for s in heard],
                  "handler_to_engine": [(s["requested_at"] - s["handler_started_at"]) * 1000 for s in heard]} if heard else {}
        from_engine = [r[0] - to - r[4]["ttft_ms"] for r, to in zip(results, to_engine)]
    engine = metrics.snapshot()
    busy = engine["busy_seconds"]
    attempted = len(results) + len(failures) + unfinished
    return {
        "users": users,
        "completed": len(results),
        "failed": len(failures),
        "unfinished": unfinished,
        "success_rate": round(len(results) / attempted, 3) if attempted else None,
        **p50_p95("ttft_ms", ttfts),
        **p50_p95("latency_ms", latencies),
        "tokens_per_s": round(sum(r[2] for r in results) / window, 1) if results else 0.0,
        "peak_gpu_gib": round(engine["gpu_memory_peak_bytes"] / 2**30, 2) if engine["gpu_memory_peak_bytes"] else None,
        # Where a request's time to first token went: preprocessing (CPU, waiting for a turn included),
        # then the wait for a prefill wave.
        **p50_p95("preprocess_ms", [stats["preprocess_ms"] for stats in replies]),
        # ...split: reaching the preparer, waiting for a worker, the work, its way back, staging on the GPU.
        **p50_p95_each("preparation_ms", {stage: [stats["preparation_ms"][stage] for stats in replies]
                                          for stage in (replies[0]["preparation_ms"] if replies else ())}),
        **p50_p95("queue_ms", [stats["queue_ms"] for stats in replies]),
        # From the scheduler's loop to the reply's consumer (in app mode a web process, through the pipe
        # from the engine's process).
        **p50_p95("first_token_delivery_ms", [stats.get("first_token_delivery_ms", 0) for stats in replies]),
        # App mode: the part of the client's time to first token spent outside the engine's reply (the
        # upload, Gradio's queue until the handler runs, and the first update's way back to the client),
        # then split (this host's clock): from the client's submit to the web process asking the engine,
        # and from the engine's first token to the client seeing it.
        **({**p50_p95("outside_engine_ttft_ms", [r[0] - r[4]["ttft_ms"] for r in results]),
            **p50_p95("to_engine_ms", to_engine), **p50_p95("from_engine_ms", from_engine),
            # ...and that way in split: the upload and the join until the client heard it had joined (so
            # with that message's way back), Gradio's queue until the handler started, the handler's way to
            # the engine (these two stamped in the server).
            **p50_p95_each("way_in_ms", way_in)} if gradio else {}),
        # Where the scheduler's time went over the whole level (the rest it waited for work), and the
        # media encoder's, which on a GPU runs on a stream of its own alongside both.
        "prefill_busy_share": round(busy["prefill"] / window, 3),
        "decode_busy_share": round(busy["decode"] / window, 3),
        "vision_busy_share": round(busy["vision"] / window, 3),
        "prefill_ms_per_wave": round(1000 * busy["prefill"] / engine["prefill_waves"], 1) if engine["prefill_waves"] else None,
        "vision_ms_per_wave": round(1000 * busy["vision"] / engine["prefill_waves"], 1) if engine["prefill_waves"] else None,
        "decode_ms_per_step": round(1000 * busy["decode"] / engine["decode_steps"], 2) if engine["decode_steps"] else None,
        # Cores each process used on average (this one: the users' threads, or in app mode the web server).
        "cpu_cores": {**cores, "clients": round(client_cores, 2)} if app else cores,
        **({"clients_connect_s": round(connect_s, 1)} if app else {}),
        "failure_examples": failures[:3],
    }


def main() -> None:
    from app.config import apply_environment

    apply_environment()  # the limits and knobs the environment sets, as the app's processes read them (app.startup)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint (Hub id, folder or tiny-random) instead of the real-shape random one")
    parser.add_argument("--checkpoint", default=DEFAULT_FOLDER)
    parser.add_argument("--mode", choices=["engine", "app", "openai", "openai-http"], default="engine")
    parser.add_argument("--levels", default="1,10,50,100,200")
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--grace", type=float, default=60.0)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--image-format", choices=["png", "jpeg"], default="png",
                        help="the request's image: a noise PNG (5.4 MB, as in RESULTS.md) or the same as a JPEG")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--prepare-processes", type=int, default=-1, help="preparing worker processes (python app.py --prepare-processes)")
    parser.add_argument("--in-process-engine", action="store_true", help="the engine in this process (as before the split)")
    parser.add_argument("--client-processes", type=int, default=CLIENT_PROCESSES, help="app mode: processes the users' clients run in")
    parser.add_argument("--client-switch-interval", type=float, default=0.005,
                        help="app mode: the client processes' GIL switch interval in seconds (default Python's, as in the runs "
                             "recorded before this option)")
    parser.add_argument("--web-processes", type=int, default=1,
                        help="app mode: web processes behind app.web.proxy (python app.py --web-processes)")
    parser.add_argument("--front-processes", type=int, default=0,
                        help="app mode, with --web-processes above 1: proxy processes (python app.py --front-processes)")
    args = parser.parse_args()

    import torch
    import transformers

    from app.config import AppConfig
    from app.engine.client import EngineProcess
    from app.engine.core import ModelManager
    from app.engine.settings import GenerationSettings

    from app import tuning

    # The users' threads here take their replies' tokens as a web process's do, so at its switch
    # interval (at Python's 5 ms the first token's delivery p95 was 132-328 ms, docs/DECISIONS.md D14).
    sys.setswitchinterval(tuning.SWITCH_INTERVAL_S)
    model = args.model or ensure_real_shape_checkpoint(args.checkpoint)
    levels = [int(level) for level in args.levels.split(",")]
    config = AppConfig(model=model, queue_size=max(levels) + 1, port=7899, engine_process=not args.in_process_engine,
                       web_processes=args.web_processes, front_processes=args.front_processes,
                       prepare_processes=args.prepare_processes)
    if config.web_processes > 1:
        from app.web.server import use_upload_folder
        from app.web.processes import start_engine

        use_upload_folder(config)
        manager = start_engine(config)
    else:
        manager = (EngineProcess if config.engine_process else ModelManager)(config)
        manager.load()
        manager.warm_up()

    image_path, messages = benchmark_request(args.image_format)
    settings = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens, "do_sample": False}
    generation = GenerationSettings(**settings)

    def make_requester():
        return lambda abort: engine_request(manager, messages, generation, abort)

    app, web, fronts = None, None, None
    if args.mode != "engine" and config.web_processes > 1:
        from app.web.processes import Fronts, WebProcesses, close_serving, front_processes

        web = WebProcesses(config, manager.listen, config.web_processes)
        web.start()
        fronts = Fronts("127.0.0.1", config.port, web.urls, front_processes(config))
        fronts.start()
        print(f"web processes: {' '.join(map(str, web.pids))}", flush=True)
        print(f"front processes: {' '.join(map(str, fronts.pids))}", flush=True)
        url = f"http://127.0.0.1:{config.port}/"
    elif args.mode != "engine":
        from app.web.server import launch

        url = launch(config, manager, prevent_thread_lock=True).local_url
    if args.mode.startswith("openai"):
        from app.web.openai_api import served_model

        # The clients' processes take the API's address.
        url = ("openai", url + "v1", served_model(manager), args.mode == "openai-http")
    if args.mode != "engine":
        app = (url, image_path, settings, args.client_switch_interval)

    report = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "model": args.model or "random weights, real MiniCPM-V 4.6 shape", "mode": args.mode,
        "engine": "process of its own" if config.engine_process else "in-process",
        "web_processes": config.web_processes, "front_processes": len(fronts.pids) if fronts else 0,
        **({"client_switch_interval_s": args.client_switch_interval} if app else {}),
        "new_tokens": args.new_tokens, "image_format": args.image_format, "duration_s": args.duration, "levels": [],
    }
    if getattr(manager, "pid", None):
        print(f"engine process: {manager.pid}", flush=True)
    for users in levels:
        print(f"level {users} users: started", flush=True)  # for a profiler waiting to attach
        level = run_level(users, args.duration, args.grace, manager.metrics, make_requester, app, getattr(manager, "pid", None),
                          {"web_processes": tuple(web.pids), "fronts": tuple(fronts.pids)} if web else None,
                          args.client_processes)
        report["levels"].append(level)
        print(json.dumps(level), flush=True)
    write_json(args.json, report)
    if web:
        close_serving(web, fronts)


if __name__ == "__main__":
    main()
