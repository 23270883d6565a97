"""Start-up, in order: options, then one process serving everything (model load, warm-up, UI, server) or
several web processes in front of one engine process (app.web.processes)."""

import logging
import sys

from app.config import parse_config
from app.engine.backends import load_manager
from app.errors import ModelUnavailable

log = logging.getLogger("app")


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
