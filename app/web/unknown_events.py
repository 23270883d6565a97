"""Gradio's event routes, asked for an event the app does not have, answer 404 with a message: `POST
/gradio_api/call/<name>` for a name no event has (Gradio's FnIndexInferError) and `POST /gradio_api/queue/join` for
an event index none has (a KeyError in gradio.route_utils.get_fn) had answered 500 and logged a traceback each.
Given to the app at launch (app.web.server) as FastAPI exception handlers."""

import logging

from starlette.responses import JSONResponse, PlainTextResponse

from app.messages import MSG_UNKNOWN_EVENT
from app.web.guard import route_path

log = logging.getLogger(__name__)

QUEUE_JOIN_PATH = "/gradio_api/queue/join"


def unknown_event_handlers() -> dict:
    from gradio.route_utils import FnIndexInferError

    return {FnIndexInferError: _unknown_name, KeyError: _unknown_index}


async def _unknown_name(request, error) -> JSONResponse:
    return JSONResponse({"detail": MSG_UNKNOWN_EVENT}, status_code=404)


async def _unknown_index(request, error) -> JSONResponse | PlainTextResponse:
    """A KeyError of the queue's join is its event index; one of any other route is a fault, answered and
    logged as Starlette would have."""
    if route_path(request.scope) == QUEUE_JOIN_PATH:
        return JSONResponse({"detail": MSG_UNKNOWN_EVENT}, status_code=404)
    log.error("Exception in %s", route_path(request.scope), exc_info=error)
    return PlainTextResponse("Internal Server Error", status_code=500)
