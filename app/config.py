"""Command-line options of the demo, each of which can also be set by an environment variable (for Spaces),
and the limits and tuning knobs that environment variables set (apply_environment): the one place that
reads the app's environment."""

import argparse
import dataclasses
import importlib.util
import ipaddress
import os
import sys
from dataclasses import dataclass

from app import limits, tuning
from app.errors import UserError

DEFAULT_MODEL = "openbmb/MiniCPM-V-4.6"
TINY_RANDOM = "tiny-random"


@dataclass(frozen=True)
class AppConfig:
    model: str = DEFAULT_MODEL
    device: str = "auto"
    dtype: str = "auto"
    attn_implementation: str = "sdpa"
    host: str = "127.0.0.1"
    port: int = 7860
    share: bool = False
    max_new_tokens: int = 512
    visual_token_budget: int = limits.DEFAULT_VISUAL_TOKEN_BUDGET
    queue_size: int = limits.DEFAULT_QUEUE_SIZE
    max_batch_size: int = limits.DEFAULT_MAX_BATCH_SIZE
    warmup: bool = True
    auth: str | None = None  # "user:password"
    trust_remote_code: bool = False
    load_in_4bit: bool = False
    allow_model_switch: bool = False
    engine_process: bool = True  # the model runs in a process of its own (app.engine.process)
    prepare_processes: int = -1  # app.engine.preparers.preparer_processes
    web_processes: int = 1  # Gradio servers sharing the engine process, behind one address (app.web.processes)
    front_processes: int = 0  # with web_processes > 1: proxies at that address; 0: app.web.processes.front_processes
    backend: str = "transformers"
    openai_base_url: str = "http://127.0.0.1:8000/v1"
    openai_model: str = "openbmb/MiniCPM-V-4.6"
    mcp: bool = False  # the model's MCP tools at /gradio_api/mcp/ (app.ui.mcp_tools)
    # A scraper's bearer token for /metrics (app.web.guard); from the environment only, so that it is not
    # shown in the process list, and left out of repr so that it is not logged.
    metrics_token: str | None = dataclasses.field(default=None, repr=False)
    # The OpenAI-compatible API's key (app.web.guard: api_key_needed says when one is needed); not logged.
    api_key: str | None = dataclasses.field(default=None, repr=False)
    # Where users reach the app when this process listens elsewhere (a web process behind the fronts' address).
    public_host: str | None = None

    def auth_pair(self) -> tuple[str, str] | None:
        if not self.auth:
            return None
        user, _, password = self.auth.partition(":")
        return user, password


def is_loopback(host: str) -> bool:
    """Whether `host` (an address to listen on) can be reached from this machine alone."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name: it may resolve to any address
        return False


def api_key_needed(config: AppConfig) -> bool:
    """Whether the OpenAI-compatible API takes requests only with a key: with --auth (the page's login does
    not open it), or when the app listens beyond loopback. Without --api-key it is then closed."""
    return bool(config.auth) or not is_loopback(config.public_host or config.host)


def serving_slots(config: AppConfig) -> int:
    """Requests the engine holds at once: a full batch plus its wait line; it tells the next one that the
    demo is busy."""
    return config.max_batch_size + config.queue_size


def handler_slots(config: AppConfig) -> int:
    """Generating requests Gradio runs at once: the engine's batch and wait line, and room beyond them
    (tuning.BUSY_HEADROOM) for a crowd to reach the engine together and be told at once that it is busy,
    so that the engine's line is the only one."""
    return serving_slots(config) + tuning.BUSY_HEADROOM


def apply_environment(environ=os.environ) -> None:
    """Set each limit and tuning knob named in app.limits and app.tuning's FROM_ENVIRONMENT from its
    MINICPMV_<NAME> variable, or back to its default where that is unset. Every process runs this as it
    starts (app.startup.start_process); nothing reads these variables at import."""
    for module in (limits, tuning):
        for name, default in module.FROM_ENVIRONMENT.items():
            value = environ.get(f"MINICPMV_{name}", "")
            try:
                setattr(module, name, type(default)(value) if value != "" else default)
            except ValueError:
                kind = "a whole number" if isinstance(default, int) else "a number"
                raise UserError(f"MINICPMV_{name}={value!r} is not {kind}") from None


# (flag, field, environment variable, type, help)
_OPTIONS = [
    ("--model", "model", "MINICPMV_MODEL", str,
     f"Hub id or local folder of a MiniCPM-V checkpoint, or '{TINY_RANDOM}' for a tiny random-weight model "
     "built offline (for tests and trying the UI without weights)."),
    ("--device", "device", "MINICPMV_DEVICE", str, "'auto' (CUDA if present, else CPU), 'cuda', 'cuda:N' or 'cpu'."),
    ("--dtype", "dtype", "MINICPMV_DTYPE", str, "'auto' (bfloat16 on CUDA, float32 on CPU), 'bfloat16', 'float16' or 'float32'."),
    ("--attn-implementation", "attn_implementation", "MINICPMV_ATTN", str, "Attention kernels: 'sdpa', 'eager' or 'flash_attention_2'."),
    ("--host", "host", "GRADIO_SERVER_NAME", str, "Address to listen on; 0.0.0.0 to serve a network."),
    ("--port", "port", "GRADIO_SERVER_PORT", int, "Port to listen on."),
    ("--max-new-tokens", "max_new_tokens", "MINICPMV_MAX_NEW_TOKENS", int, "Default reply length (at most MINICPMV_MAX_NEW_TOKENS_LIMIT, 8192)."),
    ("--visual-token-budget", "visual_token_budget", "MINICPMV_VISUAL_TOKEN_BUDGET", int,
     "Default visual tokens one request may spend on all its images together."),
    ("--backend", "backend", "MINICPMV_BACKEND", str,
     "'transformers' loads the model here; 'openai' sends requests to an OpenAI-compatible server "
     "(vLLM, SGLang, Ollama, transformers serve) given by --openai-base-url and --openai-model."),
    ("--openai-base-url", "openai_base_url", "MINICPMV_OPENAI_BASE_URL", str,
     "Base URL of the OpenAI-compatible server, ending in /v1. Its API key comes from OPENAI_API_KEY."),
    ("--openai-model", "openai_model", "MINICPMV_OPENAI_MODEL", str, "Model name the server knows."),
    ("--queue-size", "queue_size", "MINICPMV_QUEUE_SIZE", int,
     "Requests allowed to wait while the batch is full; more are told the demo is busy."),
    ("--prepare-processes", "prepare_processes", "MINICPMV_PREPARE_PROCESSES", int,
     "Worker processes that decode and slice images for the engine; -1: half the CPU cores (at most 8) "
     "with a CUDA GPU, 0 (threads of the engine's process) otherwise."),
    ("--web-processes", "web_processes", "MINICPMV_WEB_PROCESSES", int,
     "Web server processes sharing the model, behind one address; more serve more users at once when one "
     "process's Python is the limit (200 users at once on a GPU box: 8). Not with --share, --auth, "
     "--allow-model-switch, --mcp, --in-process-engine or --backend openai."),
    ("--front-processes", "front_processes", "MINICPMV_FRONT_PROCESSES", int,
     "With --web-processes above 1: processes relaying the public address's traffic to the web processes; "
     f"0: one for every {tuning.WEB_PROCESSES_PER_FRONT} web processes."),
    ("--max-batch-size", "max_batch_size", "MINICPMV_MAX_BATCH_SIZE", int,
     "Requests decoded together in one batch (each costs GPU memory for its state: about 19 MB plus 12 KB "
     "per token at the 4.6 shape)."),
]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


class _HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in its help, but not a flag's: a flag is off until given, and for one that
    sets its field false (--no-warmup) argparse would print "(default: True)"."""

    def _get_help_string(self, action):
        return action.help if action.nargs == 0 else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    defaults = AppConfig()
    parser = argparse.ArgumentParser(
        prog="python app.py",
        description="MiniCPM-V web demo: chat about images, several images or a video, with streamed replies.",
        formatter_class=_HelpWithDefaults,
    )
    for flag, field, env, kind, help_text in _OPTIONS:
        default = kind(os.environ.get(env, getattr(defaults, field)))
        parser.add_argument(flag, dest=field, type=kind, default=default, help=f"{help_text} [env {env}]")
    parser.add_argument("--share", action="store_true", default=_env_flag("MINICPMV_SHARE"),
                        help="Also serve through a public Gradio share link. [env MINICPMV_SHARE]")
    parser.add_argument("--auth", default=os.environ.get("MINICPMV_AUTH") or None, metavar="USER:PASSWORD",
                        help="Ask for this user name and password on the page and the API. [env MINICPMV_AUTH]")
    parser.add_argument("--api-key", default=os.environ.get("MINICPMV_API_KEY") or None, metavar="KEY",
                        help="The key of the OpenAI-compatible API at /v1, sent as `Authorization: Bearer KEY`. "
                             "Without it the API is open on loopback and closed with --auth or on any other "
                             "address. [env MINICPMV_API_KEY]")
    parser.add_argument("--trust-remote-code", action="store_true", default=_env_flag("MINICPMV_TRUST_REMOTE_CODE"),
                        help="Allow a checkpoint to run its own Python code. Off unless you trust its author. "
                             "[env MINICPMV_TRUST_REMOTE_CODE]")
    parser.add_argument("--allow-model-switch", action="store_true", default=_env_flag("MINICPMV_ALLOW_MODEL_SWITCH"),
                        help="Show a model picker: whoever uses the page can change the model for everyone, so "
                             "keep it for your own machine or behind --auth. [env MINICPMV_ALLOW_MODEL_SWITCH]")
    parser.add_argument("--load-in-4bit", action="store_true", default=_env_flag("MINICPMV_LOAD_IN_4BIT"),
                        help="Quantize the language model's weights to 4 bits (bitsandbytes NF4) while loading a "
                             "16-bit checkpoint: CUDA only, needs `pip install bitsandbytes`. [env MINICPMV_LOAD_IN_4BIT]")
    parser.add_argument("--in-process-engine", dest="engine_process", action="store_false",
                        default=not _env_flag("MINICPMV_IN_PROCESS_ENGINE"),
                        help="Run the model in the web server's process. Without it the model runs in a process "
                             "of its own, faster under load: the two do not share Python's GIL. "
                             "[env MINICPMV_IN_PROCESS_ENGINE]")
    # Gradio's own variable too: the API page's MCP tab tells a user of an app without MCP to set it.
    parser.add_argument("--mcp", action="store_true",
                        default=_env_flag("MINICPMV_MCP") or _env_flag("GRADIO_MCP_SERVER"),
                        help="Also serve the model as MCP tools (describe_image, ask_about_images, ask_about_video) "
                             "at /gradio_api/mcp/ (streamable HTTP) and /gradio_api/mcp/sse, behind --auth like "
                             "the rest. [env MINICPMV_MCP or GRADIO_MCP_SERVER]")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false", default=not _env_flag("MINICPMV_NO_WARMUP"),
                        help="Skip the warm-up generation at start. [env MINICPMV_NO_WARMUP]")
    return parser


def _mcp_named(argv: list[str] | None) -> str:
    """--mcp as a refusal names it: where the environment turned it on, which variables can."""
    given = "--mcp" in (sys.argv[1:] if argv is None else argv)
    return "--mcp" if given else "--mcp (on by MINICPMV_MCP or GRADIO_MCP_SERVER)"


def parse_config(argv: list[str] | None = None) -> AppConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.backend not in ("transformers", "openai"):
        parser.error("--backend is 'transformers' or 'openai'")
    if args.auth is not None and (":" not in args.auth or not all(args.auth.partition(":")[::2])):
        parser.error("--auth takes USER:PASSWORD, both non-empty")
    if args.api_key is not None and (not args.api_key.strip() or args.api_key != args.api_key.strip()):
        parser.error("--api-key takes a key without spaces at its ends")  # a Bearer token is read trimmed
    if args.web_processes < 1:
        parser.error("--web-processes is 1 or more")
    if not 1 <= args.max_new_tokens <= limits.MAX_NEW_TOKENS_LIMIT:
        parser.error(f"--max-new-tokens is 1 to {limits.MAX_NEW_TOKENS_LIMIT} (MINICPMV_MAX_NEW_TOKENS_LIMIT)")
    if args.max_batch_size < 1:
        parser.error("--max-batch-size is 1 or more")
    if args.queue_size < 0:
        parser.error("--queue-size is 0 or more")
    if args.front_processes < 0:
        parser.error("--front-processes is 0 (automatic) or more")
    if args.front_processes and args.web_processes == 1:  # one web process serves the address itself
        parser.error("--front-processes goes with --web-processes above 1")
    if args.mcp and importlib.util.find_spec("mcp") is None:
        parser.error("--mcp needs the mcp package: pip install -r requirements.txt")
    if args.web_processes > 1:
        # Login tokens and the model's cached defaults live in each web process; a share link reaches one port.
        clashes = [flag for flag, on in (("--share", args.share), ("--auth", args.auth), ("--allow-model-switch", args.allow_model_switch),
                                         (_mcp_named(argv), args.mcp),  # an MCP SSE session lives in one process
                                         ("--in-process-engine", not args.engine_process),
                                         ("--backend openai", args.backend == "openai")) if on]
        if clashes:
            parser.error(f"--web-processes above 1 does not go with {', '.join(clashes)}")
    return AppConfig(**vars(args), metrics_token=os.environ.get("MINICPMV_METRICS_TOKEN") or None)
