"""The login in front of every route, and /metrics' token.

Gradio 6.31 checks the login route by route (a `login_check` dependency in gradio.routes.App.create_app)
and leaves many routes open even with auth: FastAPI's /openapi.json, /gradio_api/cancel and /reset, the
heartbeat, the stream routes, and any route added to the app (/metrics, the MCP server's). LoginRequired,
an ASGI middleware given to the app at launch, sits in front of all of them: a request passes only with a
login Gradio issued (its access-token cookie, found in `App.tokens`, as gradio.routes' `get_current_user`
looks it up), with the login itself as HTTP Basic (what an MCP client or a script can send: a header, not
a form), or when its path is one the login form needs before there is a login.
"""

import base64
import binascii
import hmac
import inspect

from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse

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
    without auth needs it."""

    def __init__(self, app, metrics_token: str | None = None):
        self.app = app
        self.metrics_token = metrics_token

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or await self.allowed(scope):
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
