"""N users at once, each sending requests back to back: time to first token, latency, throughput, success.

Each request: exactly --new-tokens new tokens, greedy, after what --workload says (benchmarks/workloads.py):
  image-1344  one 1344x1344 image (640 visual tokens) and a short question: the default, and every table of
              RESULTS.md unless it says otherwise (--image-format: a 4.6 MB noise PNG, or the same as a JPEG),
  image-448   one 448x448 JPEG photo (64 visual tokens) and the same question,
  text        a text-only chat turn: a short prompt,
  follow-up   a follow-up in a conversation that holds a 1344x1344 image (a JPEG unless --image-format says
              otherwise): [user: the image and a question,
              assistant: the engine's answer to it, user: a new question]. Each user opens its conversation
              (a first question of its own, answered by the engine) before the level's clock; each timed
              request is the next turn of the user's one conversation, which grows by each question and its
              answer, as a chat's does (see prompt_tokens), for 10 turns, then starts again from its
              opening. In app mode /ask keeps the conversation in the
              server (settings follow_up); the OpenAI-style modes send the opening again each time, with a
              question not sent before,
  video-16    a 16-frame video (a 16 s synthetic mp4, sampled at 1 frame a second, at most 16) and a question.
Each level runs for --duration seconds of new requests, then waits up to --grace seconds for those in
flight; unfinished ones are reported, not hidden. Each level gives the mean, p50 and p95 of the time to first
token and of the response time (a request's whole latency), tokens/s and success, then a table of them at the
end; first, one request of the workload through the engine says what each holds (prompt and visual tokens,
video frames). Modes:
  --mode engine  the engine called from this script, as a Python program would (what the GPU can do),
  --mode app     the full app through gradio_client (what a browser user gets); the clients run in
                 processes of their own, so that they do not slow the server down, and connect before
                 the level's clock starts, as users whose page is open (connecting is timed apart),
  --mode openai  the same requests through the app's OpenAI-compatible API with the official `openai`
                 client, streamed, the image or video as a base64 data URL (clients as in app mode; the
                 columns that need the engine's own stats of each reply are left out); --mode openai-http:
                 the same with plain httpx clients, each body's media encoded once.
Either way the engine runs in a process of its own, as `python app.py` runs it; --in-process-engine runs
it in the benchmark's (or the app's) process instead, as before that split. In app and openai mode, --web-processes N
serves the app as `python app.py --web-processes N` does: N web processes behind app.web.proxy's proxy, in
--front-processes processes (0: as many as the app would start).
Random weights at the real MiniCPM-V 4.6 shape by default (timings do not depend on weight values):

    python benchmarks/concurrency.py --levels 1,10,50,100,200 --json results.json
    python benchmarks/concurrency.py --model tiny-random --levels 1,4 --duration 10   # a quick CPU check
    python benchmarks/concurrency.py --model tiny-random --mode openai --levels 1,4 --duration 5
    python benchmarks/concurrency.py --workload follow-up --levels 10,50,100,200 --duration 10 --grace 10
    python benchmarks/concurrency.py --workload text,image-448,follow-up --levels 10,50,100,200   # several, one engine
"""

import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.real_shape import benchmark_parser, chosen_model  # noqa: E402
from benchmarks.cpu_use import CpuUse  # noqa: E402
from benchmarks.report import write_json  # noqa: E402
from benchmarks.requesters import engine_requester  # noqa: E402
from benchmarks.users import CLIENT_PROCESSES, drive_users, opened_users, run_clients  # noqa: E402
from benchmarks.workloads import FOLLOW_UP_TURNS, WORKLOADS, make_workload  # noqa: E402


def percentile(values: list[float], fraction: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(fraction * len(ordered)))], 1)


def share(flags: list[bool]) -> float | None:
    return round(sum(flags) / len(flags), 3) if flags else None


def p50_p95(name: str, values: list[float]) -> dict:
    return {f"{name}_p50": percentile(values, 0.5), f"{name}_p95": percentile(values, 0.95)}


def mean_p50_p95(name: str, values: list[float]) -> dict:
    return {f"{name}_mean": round(sum(values) / len(values), 1) if values else None, **p50_p95(name, values)}


def p50_p95_each(name: str, series: dict[str, list[float]]) -> dict:
    """p50_p95 of several series at once: {name_p50: {key: p50}, name_p95: {key: p95}}."""
    return {f"{name}_{label}": {key: percentile(values, fraction) for key, values in series.items()}
            for label, fraction in (("p50", 0.5), ("p95", 0.95))}


def run_level(users: int, duration: float, grace: float, metrics, make_requester=None, app=None,
              engine_pid: int | None = None, serving: dict[str, tuple[int, ...]] | None = None,
              client_processes: int = CLIENT_PROCESSES, first_user: int = 1) -> dict:
    """One level, its users numbered from `first_user`; in-process users are `make_requester(user)`'s, or
    `app` = (url, workload, settings, the clients' GIL switch interval) runs clients in up to
    `client_processes` processes. `metrics` (the engine's) says where the scheduler's time went and how
    much GPU memory the level took at most; the CPU each process used is measured too (`serving`: the web
    and front processes, by group)."""
    client_cores, connect_s = 0.0, None
    if app is None:
        opening = time.time()
        requesters = opened_users(make_requester, first_user, users)
        opening_s = time.time() - opening
        metrics.reset()  # also the GPU memory peak
        cpu = CpuUse(engine_pid or os.getpid())
        started = time.time()
        results, failures, unfinished = drive_users(requesters, started + duration, started + duration + grace)
    else:
        results, failures, unfinished, client_cores, connect_s, opening_s, cpu, started = run_clients(
            users, first_user, duration, grace, metrics, app, engine_pid, serving, client_processes)
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
        **mean_p50_p95("ttft_ms", ttfts),
        **mean_p50_p95("latency_ms", latencies),  # the response time: a request's whole latency
        "tokens_per_s": round(sum(r[2] for r in results) / window, 1) if results else 0.0,
        # What the requests held (the engine's or the API's count), and (with the conversation cache) how
        # much of it an earlier request's state spared.
        **{key: value for name in ("prompt_tokens", "reused_prompt_tokens")
           for key, value in p50_p95(name, [r[4][name] for r in results if r[4].get(name) is not None]).items()},
        # The share of requests that went on from a kept conversation (a follow-up's restart may not:
        # benchmarks/workloads.py).
        "reused_share": share([r[4]["reused_prompt_tokens"] > 0 for r in results
                               if r[4].get("reused_prompt_tokens") is not None]),
        # The share whose earlier images' features were kept though their conversation's state was not (a restart).
        "kept_images_share": share([r[4]["reused_image_tokens"] > 0 for r in results
                                    if r[4].get("reused_image_tokens") is not None]),
        "opening_s": round(opening_s, 1),  # before the clock: a follow-up's users opening their conversations
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


def serve(config, manager, mode: str) -> tuple:
    """The app served as `python app.py` serves it: (what the clients' processes connect to: the app's URL, or
    in openai modes ("openai", the API's base URL, the model's name, plain HTTP or the SDK), the web processes
    and the fronts, or None and None with one web process, this one)."""
    web = fronts = None
    if config.web_processes > 1:
        from app.web.processes import Fronts, WebProcesses, front_processes

        web = WebProcesses(config, manager.listen, config.web_processes)
        web.start()
        fronts = Fronts("127.0.0.1", config.port, web.urls, front_processes(config))
        fronts.start()
        print(f"web processes: {' '.join(map(str, web.pids))}", flush=True)
        print(f"front processes: {' '.join(map(str, fronts.pids))}", flush=True)
        url = f"http://127.0.0.1:{config.port}/"
    else:
        from app.web.server import launch

        url = launch(config, manager, prevent_thread_lock=True).local_url
    if mode.startswith("openai"):
        from app.web.openai_api import served_model

        url = ("openai", url + "v1", served_model(manager), mode == "openai-http")
    return url, web, fronts


def request_shape(request) -> dict:
    """What a request holds, from its engine stats (`request`: an engine requester)."""
    _, stats = request(threading.Event())
    return {key: stats.get(key) for key in ("prompt_tokens", "visual_tokens", "image_tokens", "video_frames",
                                            "video_tokens", "new_tokens", "reused_prompt_tokens") if key in stats}


def summary_table(levels: list[dict]) -> str:
    """The levels' headline figures as a markdown table (the shape of the seed's evaluation, issue 32)."""
    def ms(value):
        return "-" if value is None else f"{value:,.0f}"

    rows = ["| users | response time mean / p95 (ms) | first token mean / p95 (ms) | tokens/s | success |",
            "|---|---|---|---|---|"]
    for level in levels:
        success = "-" if level["success_rate"] is None else f"{100 * level['success_rate']:.1f}%"
        rows.append(f"| {level['users']} | {ms(level['latency_ms_mean'])} / {ms(level['latency_ms_p95'])} | "
                    f"{ms(level['ttft_ms_mean'])} / {ms(level['ttft_ms_p95'])} | {level['tokens_per_s']:,.0f} | {success} |")
    return "\n".join(rows)


# How a follow-up user's conversation goes on, by mode (benchmarks/workloads.py).
CONVERSATIONS = {
    "engine": f"grows by each turn, {FOLLOW_UP_TURNS} turns at most, then starts again from its opening",
    "app": "grows by each turn (/ask follow_up)",
    "openai": "each request the opening, its answer and a new question",
    "openai-http": "each request the opening, its answer and a new question",
}


def run_workload(args, name: str, config, manager, levels: list[int], first_user: int, url, web, fronts) -> dict:
    """Every level of workload `name`, its users numbered from `first_user`: the report."""
    import torch
    import transformers

    from app.engine.settings import GenerationSettings

    workload = make_workload(name, args.image_format)
    settings = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens, "do_sample": False}
    generation = GenerationSettings(**settings, **workload.settings)

    def make_requester(user):
        return engine_requester(manager, workload, generation, user)

    app = (url, workload, settings, args.client_switch_interval) if url else None
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "model": args.model or "random weights, real MiniCPM-V 4.6 shape", "mode": args.mode,
        "engine": "process of its own" if config.engine_process else "in-process",
        "web_processes": config.web_processes, "front_processes": len(fronts.pids) if fronts else 0,
        **({"client_switch_interval_s": args.client_switch_interval} if app else {}),
        "workload": name, "new_tokens": args.new_tokens,
        "image_format": workload.media["path"].rsplit(".", 1)[1] if workload.media else None,
        **({"conversation": CONVERSATIONS[args.mode]} if workload.follow_up else {}),
        # One request of the workload through the engine, before the levels: what each one holds.
        "request": request_shape(make_requester(0)), "duration_s": args.duration, "levels": [],
    }
    print(f"{name}: {json.dumps(report['request'])}", flush=True)
    if getattr(manager, "pid", None):
        print(f"engine process: {manager.pid}", flush=True)
    for users in levels:
        print(f"level {users} users: started", flush=True)  # for a profiler waiting to attach
        level = run_level(users, args.duration, args.grace, manager.metrics, make_requester, app, getattr(manager, "pid", None),
                          {"web_processes": tuple(web.pids), "fronts": tuple(fronts.pids)} if web else None,
                          args.client_processes, first_user)
        first_user += users
        report["levels"].append(level)
        print(json.dumps(level), flush=True)
    print(summary_table(report["levels"]), flush=True)
    return report


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--mode", choices=["engine", "app", "openai", "openai-http"], default="engine")
    parser.add_argument("--levels", default="1,10,50,100,200")
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--grace", type=float, default=60.0)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--workload", default="image-1344",
                        help=f"what each request holds (see above): one of {', '.join(WORKLOADS)}, or several, comma-separated "
                             "(engine mode only: run one after the other on the same engine, which keeps its conversations and grown "
                             "slot store from one to the next; --json then holds a report for each)")
    parser.add_argument("--image-format", choices=["png", "jpeg"],
                        help="image-1344 and follow-up: the 1344x1344 image as a noise PNG (4.6 MB; image-1344's default, "
                             "as in RESULTS.md) or the same as a JPEG (1.3 MB; follow-up's default)")
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
    workloads = args.workload.split(",")
    if unknown := [name for name in workloads if name not in WORKLOADS]:
        parser.error(f"unknown workload {', '.join(unknown)}: one of {', '.join(WORKLOADS)}")
    if args.image_format and not {"image-1344", "follow-up"} & set(workloads):
        parser.error(f"--image-format is for image-1344 and follow-up; {args.workload} sends no 1344x1344 image")
    if len(workloads) > 1 and args.mode != "engine":
        parser.error("several workloads run in engine mode only")

    from app.config import AppConfig
    from app.engine.client import EngineProcess
    from app.engine.core import ModelManager

    from app import tuning

    # The users' threads here take their replies' tokens as a web process's do, so at its switch
    # interval (at Python's 5 ms the first token's delivery p95 was 132-328 ms, docs/DECISIONS.md D14).
    sys.setswitchinterval(tuning.SWITCH_INTERVAL_S)
    model = chosen_model(args)
    levels = [int(level) for level in args.levels.split(",")]
    config = AppConfig(model=model, queue_size=max(levels) + 1, port=7899, engine_process=not args.in_process_engine,
                       web_processes=args.web_processes, front_processes=args.front_processes,
                       prepare_processes=args.prepare_processes)
    started = time.perf_counter()
    if config.web_processes > 1:
        from app.web.server import use_upload_folder
        from app.web.processes import start_engine

        use_upload_folder(config)
        manager = start_engine(config)
        engine_start = {"load_and_warm_up_s": round(time.perf_counter() - started, 1)}
    else:
        manager = (EngineProcess if config.engine_process else ModelManager)(config)
        manager.load()
        loaded = time.perf_counter()
        manager.warm_up()
        engine_start = {"load_s": round(loaded - started, 1), "warm_up_s": round(time.perf_counter() - loaded, 1)}
    print(f"engine started: {json.dumps(engine_start)}", flush=True)

    url, web, fronts = serve(config, manager, args.mode) if args.mode != "engine" else (None, None, None)
    reports, first_user = [], 1  # every level's users are new ones: a follow-up's conversations are all different
    for name in workloads:
        reports.append(run_workload(args, name, config, manager, levels, first_user, url, web, fronts))
        first_user += sum(levels)
    for report in reports:
        report["engine_start"] = engine_start  # a change's cost at start (more graphs captured, a slower load)
    write_json(args.json, reports[0] if len(reports) == 1 else {"workloads": reports})
    if web:
        from app.web.processes import close_serving

        close_serving(web, fronts)


if __name__ == "__main__":
    main()
