"""The OpenAI-compatible API's errors, in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, with
the HTTP status of each kind (app.web.openai_api answers with them; app.web.guard with 401)."""

import json

from starlette.responses import Response

from app.errors import Busy, NotReady, ServingFailed, UserError

API_ROOT = "/v1"  # the API's routes are under it (OpenAI's and vLLM's base URL ends there)
RETRY_AFTER_S = 5  # what a busy or not-ready answer suggests waiting


class ApiError(Exception):
    """A request the API answers with an error: `status`, a message for the user, OpenAI's error `kind`
    ("invalid_request_error"...), a `code` and the request's field it is about (`param`), if any."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    @classmethod
    def of(cls, error: UserError) -> "ApiError":
        """The answer to an error of the engine or of the input, by its kind (app.errors)."""
        if isinstance(error, Busy):
            return cls(429, str(error), "rate_limit_error", "busy")
        if isinstance(error, NotReady):
            return cls(503, str(error), "service_unavailable_error", "model_not_ready")
        if isinstance(error, ServingFailed):
            return cls(500, str(error), "server_error", "generation_failed")
        return cls(400, str(error))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.status in (429, 503):
            return {"Retry-After": str(RETRY_AFTER_S)}
        return {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}

    def response(self) -> Response:
        return Response(json_bytes(self.body()), status_code=self.status, headers=self.headers(),
                        media_type="application/json")


def json_bytes(data, **dumps) -> bytes:
    """`data` as UTF-8 JSON. A lone surrogate, which a request's text may hold and an error may repeat, has no
    UTF-8 form: it is written as JSON's \\u escape (encoding it failed, and the answer was a bare 500)."""
    return json.dumps(data, ensure_ascii=False, **dumps).encode("utf-8", "backslashreplace")


def is_api_path(path: str) -> bool:
    return path == API_ROOT or path.startswith(API_ROOT + "/")
