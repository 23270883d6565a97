"""Start-up, in order: options, then one process serving everything (model load, warm-up, UI, server) or
several web processes in front of one engine process (app.web.processes)."""

import logging
import sys

from app.config import parse_config
from app.engine.backends import load_manager
from app.errors import ModelUnavailable, UserError
from app.startup import start_process

log = logging.getLogger("app")


def main(argv: list[str] | None = None) -> None:
    try:
        start_process()
    except UserError as error:  # a limit's variable that is not a number
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    config = parse_config(argv)
    try:
        if config.web_processes > 1:
            from app.web.processes import serve_with_web_processes

            serve_with_web_processes(config)
            return
        manager = load_manager(config)
    except ModelUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    from app.web.server import launch

    launch(config, manager)
