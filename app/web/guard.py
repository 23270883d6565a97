"""The login in front of every route, /metrics' token, and the OpenAI-compatible API's key.

Gradio 6.31 checks the login route by route (a `login_check` dependency in gradio.routes.App.create_app)
and leaves many routes open even with auth: FastAPI's /openapi.json, /gradio_api/cancel and /reset, the
heartbeat, the stream routes, and any route added to the app (/metrics, the MCP server's). LoginRequired,
an ASGI middleware given to the app at launch, sits in front of all of them: a request passes only with a
login Gradio issued (its access-token cookie, found in `App.tokens`, as gradio.routes' `get_current_user`
looks it up), with the login itself as HTTP Basic (what an MCP client or a script can send: a header, not
a form), or when its path is one the login form needs before there is a login.

The OpenAI-compatible API (/v1/...) is a server's API, not the page's: it takes its own key
(`Authorization: Bearer`, --api-key) and never the page's login (its cookie, which a browser would send
along with a request that another site's page made it send, or HTTP Basic).
"""

import base64
import binascii
import hmac
import inspect

from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse

from app.messages import MSG_API_KEY_MISSING, MSG_API_KEY_NOT_SET, MSG_API_KEY_WRONG
from app.web.openai_errors import ApiError, is_api_path

# What the login form needs, and nothing else (found with Chromium on Gradio 6.31): the page itself
# (Gradio renders the form there until there is a login), its scripts, styles and fonts (/assets/,
# /static/), its theme, and the form's POST /login (gradio_client logs in there too). Both prefixes are
# Gradio's read-only routes for its own built files, which serve nothing else whatever follows the prefix.
# Also /gradio_api/startup-events, which Gradio's launch() calls without a login (it runs the app's
# start-up events the first time, and does nothing after that).
OPEN_PATHS = frozenset({"/", "/login", "/login/", "/theme.css", "/favicon.ico", "/robots.txt",
                        "/gradio_api/startup-events"})
OPEN_PREFIXES = ("/assets/", "/static/")
METRICS_PATH = "/metrics"


def route_path(scope) -> str:
    """The path the app's routes are matched against (without the root path it may be mounted under)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root + "/"):
        return path[len(root):]
    return path


def bearer_token(connection: HTTPConnection) -> str | None:
    scheme, _, token = connection.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def basic_login(connection: HTTPConnection, accounts) -> bool:
    """Whether the request sends one of `accounts` ({user: password}, as gradio.routes.App keeps launch's
    auth) as `Authorization: Basic base64(user:password)`. The app never asks for it (no Basic challenge),
    so a browser never keeps it to send unasked."""
    scheme, _, encoded = connection.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic" or not isinstance(accounts, dict):
        return False
    try:
        user, colon, password = base64.b64decode(encoded.strip(), validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return False
    expected = accounts.get(user)
    return bool(colon) and expected is not None and hmac.compare_digest(password.encode(), expected.encode())


class LoginRequired:
    """With auth on (launch(auth=...)), every request needs the login but those to OPEN_PATHS and
    OPEN_PREFIXES. With `metrics_token`, GET /metrics also takes `Authorization: Bearer <token>`, and
    without auth needs it. The API (/v1/...) needs `api_key` as its bearer token when `api_key_needed`
    (app.config.api_key_needed), and is closed then without one; else it is open."""

    def __init__(self, app, metrics_token: str | None = None, api_key: str | None = None, api_key_needed: bool = False):
        self.app = app
        self.metrics_token = metrics_token
        self.api_key, self.api_key_needed = api_key, api_key_needed

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and is_api_path(route_path(scope)):
            refusal = self.api_refusal(HTTPConnection(scope))
            await (self.app if refusal is None else refusal.response())(scope, receive, send)
        elif scope["type"] not in ("http", "websocket") or await self.allowed(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # before accepting: the client gets a 403
        else:
            headers = {"WWW-Authenticate": "Bearer"} if route_path(scope) == METRICS_PATH else None
            await JSONResponse({"detail": "Not authenticated"}, status_code=401, headers=headers)(scope, receive, send)

    async def allowed(self, scope) -> bool:
        served = scope["app"]  # the gradio.routes.App (Starlette puts itself there before its middleware runs)
        login_on = served.auth is not None or served.auth_dependency is not None
        path = route_path(scope)
        connection = HTTPConnection(scope)
        if path == METRICS_PATH and self.metrics_token is not None:
            token = bearer_token(connection)
            if token is not None and hmac.compare_digest(token.encode(), self.metrics_token.encode()):
                return True
            return login_on and await logged_in(served, scope, connection)
        if not login_on or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            return True
        return await logged_in(served, scope, connection)

    def api_refusal(self, connection: HTTPConnection) -> ApiError | None:
        """Why an API request may not pass (None: it may)."""
        if self.api_key is None:
            return ApiError(401, MSG_API_KEY_NOT_SET, code="invalid_api_key") if self.api_key_needed else None
        token = bearer_token(connection)
        if token is None:
            return ApiError(401, MSG_API_KEY_MISSING, code="invalid_api_key")
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            return ApiError(401, MSG_API_KEY_WRONG, code="invalid_api_key")
        return None


async def logged_in(served, scope, connection: HTTPConnection) -> bool:
    """Whether the request carries a login of `served` (as gradio.routes' get_current_user decides)."""
    if served.auth_dependency is not None:
        user = served.auth_dependency(Request(scope))
        if inspect.isawaitable(user):
            user = await user
        return user is not None
    if basic_login(connection, served.auth):
        return True
    token = (connection.cookies.get(f"access-token-{served.cookie_id}")
             or connection.cookies.get(f"access-token-unsecure-{served.cookie_id}"))
    return token is not None and served.tokens.get(token) is not None
