"""The web server of one web process: Gradio's launch (the UI, its queue, the upload route, the login in front
of every route), GET /metrics and the OpenAI-compatible API (/v1, app.web.openai_api). Never imports torch."""

import logging
import os
import shutil
import tempfile

from app import limits
from app.messages import MSG_SHARE_API_OPEN, MSG_SHARE_WITHOUT_AUTH
from app.config import AppConfig, api_key_needed, handler_slots
from app.startup import started

log = logging.getLogger("app")

# Set before Gradio is imported, unless already set:
GRADIO_SETTINGS = {
    # Gradio wraps every event step in a matplotlib backend switch when matplotlib is installed; left to
    # pick its backend, matplotlib imports pyplot and builds its font cache there, in the server's event
    # loop (seconds on a fresh machine: the first reply on an H200 box reached its client 13 s late).
    "MPLBACKEND": "agg",
    # Each time an event ends, Gradio summarizes its last 10,000 events with pandas for its /monitoring
    # page: 4-5 ms of a web process's CPU a request, 14-20 once a busy server has seen 10,000 events (dev
    # core, CPU time; benchmarks/experiments/gradio_analytics.py). The app serves /metrics and its own panel
    # instead: the page is off (launch), and the summary is never made.
    "GRADIO_ANALYTICS_CACHE_FREQUENCY": str(2**62),
}


def use_upload_folder(config: AppConfig) -> str:
    """The folder Gradio keeps uploads in (GRADIO_TEMP_DIR, set here if unset: web processes started
    after this share it)."""
    from gradio.utils import get_upload_folder

    if not os.environ.get("GRADIO_TEMP_DIR"):
        # A folder of our own, emptied at start: uploads of an earlier run belong to conversations that are gone.
        own_folder = os.path.join(tempfile.gettempdir(), f"minicpmv-demo-uploads-{config.port}")
        shutil.rmtree(own_folder, ignore_errors=True)
        os.environ["GRADIO_TEMP_DIR"] = own_folder
    upload_folder = get_upload_folder()
    os.makedirs(upload_folder, exist_ok=True)
    return upload_folder


def launch(config: AppConfig, manager, prevent_thread_lock: bool = False, quiet: bool = False):
    """Serve the UI; returns the Blocks (and keeps serving in the background) when prevent_thread_lock is set."""
    for name, value in GRADIO_SETTINGS.items():
        os.environ.setdefault(name, value)
    import gradio as gr

    from app.ui.cancellable import cancel_on_reset_route
    from app.ui.layout import CSS_PATH, build_demo
    from app.ui.mcp_tools import mcp_addresses, serve_mcp_tools
    from app.web.openai_api import openai_routes
    from app.web.uploads import UploadJanitor, upload_route

    if config.share and not config.auth:
        log.warning(MSG_SHARE_WITHOUT_AUTH)
    if config.share and config.api_key is None and not api_key_needed(config):
        log.warning(MSG_SHARE_API_OPEN)
    upload_folder = use_upload_folder(config)
    demo = build_demo(manager)  # caches its example media in the upload folder, which the janitor spares
    janitor = UploadJanitor(upload_folder)
    mcp_app_kwargs = serve_mcp_tools(demo, manager, janitor) if config.mcp else {}
    # The engine keeps the only wait line (bounded, first come first served, with positions, and "busy"
    # past it): Gradio runs every generating request at once up to far more than that line holds
    # (handler_slots, the generating events' concurrency), so that none waits in Gradio's queue first or
    # hears Gradio's "Queue is full". That queue, and the thread pool each running handler holds a
    # thread of, are sized to it (the rest of the pool serves the other events); the queue's bound keeps
    # a flood's memory bounded.
    slots = handler_slots(config)
    # api_open=False: no direct route (/run/<name>) runs a queued event past the queue's bounds (docs/SECURITY.md).
    demo.queue(max_size=slots, default_concurrency_limit=1, api_open=False)
    demo.launch(server_name=config.host, server_port=config.port, share=config.share, auth=config.auth_pair(),
                # Quiet: Gradio's own lines advise `share=True` in `launch()`; this app's flag is --share.
                prevent_thread_lock=True, css_paths=[CSS_PATH], theme=gr.themes.Soft(), quiet=True,
                footer_links=["api", "gradio"], max_file_size=f"{limits.MAX_UPLOAD_MB}mb",
                max_threads=slots + 40, enable_monitoring=False,
                # Given either way: left None, Gradio reads GRADIO_MCP_SERVER (app.ui.mcp_tools).
                mcp_server=config.mcp,
                # Run history is a page the app does not link, and its routes have the server call the
                # Hugging Face Hub for whoever asks.
                run_history=False,
                # Part of the app from its first request (a route added after launch() returns, which
                # with --share is after the share-link attempt, answered 404 until then); listed before
                # Gradio's routes, so that the upload route replaces Gradio's.
                app_kwargs={"routes": [metrics_route(manager), upload_route(janitor), cancel_on_reset_route(demo),
                                       *openai_routes(manager, janitor, slots)],
                            **guards(config), **mcp_app_kwargs})
    janitor.start(running=lambda: demo.is_running)
    if not quiet:
        print(f"* Running on {demo.local_url}" + ("" if config.share else " (--share for a public link)"), flush=True)
        print(f"* OpenAI-compatible API at {demo.local_url}v1 ({api_access(config)})", flush=True)
        if config.mcp:
            print(f"* MCP server: {mcp_addresses(demo.local_url)}", flush=True)
    started()  # Gradio and the UI: 166,000 objects, 0.18 s a full collection on the dev machine
    if not prevent_thread_lock:
        demo.block_thread()
    return demo


def guards(config: AppConfig) -> dict:
    """The app's middleware and exception handlers: the login on every request (Gradio checks it route by route
    and misses some), and 404 for an event the app does not have."""
    from starlette.middleware import Middleware

    from app.web.guard import LoginRequired
    from app.web.unknown_events import unknown_event_handlers

    return {"middleware": [Middleware(LoginRequired, metrics_token=config.metrics_token, api_key=config.api_key,
                                      api_key_needed=api_key_needed(config))],
            "exception_handlers": unknown_event_handlers()}


def api_access(config: AppConfig) -> str:
    """Who may use the OpenAI-compatible API, in words for the start-up line."""
    if config.api_key is not None:
        return "with the --api-key key"
    if api_key_needed(config):
        return "closed: it needs --api-key, with --auth or beyond loopback"
    return "open: no key on loopback"


def metrics_route(manager):
    """GET /metrics: the engine's counters in Prometheus text format (counts and timings only, no content)."""
    from fastapi.responses import PlainTextResponse
    from fastapi.routing import APIRoute

    def metrics() -> PlainTextResponse:
        return PlainTextResponse(manager.metrics.prometheus(), media_type="text/plain; version=0.0.4")

    return APIRoute("/metrics", metrics, methods=["GET"])
