"""The console's web app (Starlette, Jinja2): the hospital and coordinator views over the folders it was given.

Read-only by construction: its routes only GET pages, each page is read afresh from the files (so it follows a run
that is still going, and refreshes itself while one is), a name in a URL is only ever looked up among the folders
found inside the ones given (never joined onto a path), and nothing is written. Every page is self-contained (inline
CSS, charts as inline SVG) and says so to the browser: its Content-Security-Policy forbids loading anything from
anywhere. Bound beyond this machine it needs a token (``Authorization: Bearer``, or ``?token=`` once, which sets a
cookie).
"""

from __future__ import annotations

import hmac
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Receive, Scope, Send

from . import charts
from .coordinator_view import SHOWN_KEYS, list_run_rows, read_run, run_folders
from .hospital_view import HOSPITAL_FILES, hospital_folders, peer_words, read_hospital, stage_words, trainings_since

TOKEN_COOKIE = "fedmed-console-token"
#: nothing may be loaded from anywhere: styles and charts are inline, there is no script
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; form-action 'none'; frame-ancestors 'none'"
REFRESH_SECONDS = 5
MESSAGES_PER_PAGE = 500  #: a run's messages on one page
RUNS_PER_PAGE = 100  #: a hospital's runs on one page, the latest first
REFUSALS_SHOWN = 100  #: the latest refusals on a hospital's page (every one is on its run's page)


@dataclass(frozen=True)
class Sources:
    """The folders and files the console was given: all it reads."""

    state: Path | None = None
    results: Path | None = None
    policies: tuple[tuple[str, Path], ...] = ()  #: (hospital name, or "" for every hospital; its policy file)
    node_config: str = ""
    server_log: Path | None = None

    def policy(self, hospital: str) -> Path | None:
        named = dict(self.policies)
        return named.get(hospital, named.get(""))

    def hospitals(self) -> dict[str, Path]:
        return hospital_folders(self.state) if self.state is not None and self.state.is_dir() else {}

    def runs(self) -> dict[str, Path]:
        return run_folders(self.results) if self.results is not None and self.results.is_dir() else {}

    def server_logs(self) -> dict[str, Path]:
        """run name -> the server's audit log of that run (in the results folder); ``""``: the one given."""
        logs = {name: folder / "audit.jsonl" for name, folder in self.runs().items()
                if (folder / "audit.jsonl").is_file()}
        if self.server_log is not None:
            logs[""] = self.server_log
        return logs


# --- formatting ------------------------------------------------------------------------------------------------------
def human_bytes(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return ""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.1f} {unit}"
    return f"{int(value)} B"


def utc(stamp: Any) -> str:
    """``2026-12-06T21:42:21Z`` -> ``2026-12-06 21:42:21 UTC``; a time in seconds likewise."""
    if isinstance(stamp, (int, float)):
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(stamp)) if stamp else ""
    text = str(stamp or "")
    return text.replace("T", " ").replace("Z", " UTC") if text.endswith("Z") else text


def epsilon_text(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float) and math.isinf(value):
        return "infinite"
    return f"{value:.2f}"


def metric_text(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def templates() -> Jinja2Templates:
    env = Environment(loader=PackageLoader("console", "templates"), autoescape=select_autoescape(["html"]))
    env.filters.update(bytes=human_bytes, utc=utc, epsilon=epsilon_text, metric=metric_text, stage=stage_words,
                       short=lambda h: (h or "")[:16], peer=peer_words)
    return Jinja2Templates(env=env)


# --- the token -------------------------------------------------------------------------------------------------------
class TokenGate:
    """Every request needs the token, as ``Authorization: Bearer TOKEN``, ``?token=TOKEN`` (which sets a cookie, so
    links on the page work) or that cookie; compared in constant time."""

    def __init__(self, app: ASGIApp, token: str, secure: bool = False):
        self.app = app
        self.token = token.encode()
        self.secure = secure  #: the cookie only over HTTPS (served beyond this machine)

    def _given(self, request: Request) -> tuple[bool, bool]:
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer ") and hmac.compare_digest(header[7:].strip().encode(), self.token):
            return True, False
        query = request.query_params.get("token")
        if query is not None and hmac.compare_digest(query.encode(), self.token):
            return True, True
        cookie = request.cookies.get(TOKEN_COOKIE)
        return cookie is not None and hmac.compare_digest(cookie.encode(), self.token), False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        allowed, from_query = self._given(request)
        if not allowed:
            response: Response = PlainTextResponse("fedmed console: this page needs its token (start it with --token, "
                                                   "open it with ?token=...)", status_code=401)
            await response(scope, receive, send)
            return
        if from_query:  # drop the token from the address bar, keep it in a cookie
            response = RedirectResponse(request.url.remove_query_params("token"), status_code=303)
            response.set_cookie(TOKEN_COOKIE, self.token.decode(), httponly=True, samesite="strict",
                                secure=self.secure)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class SecurityHeaders:
    """No page loads anything from anywhere (CSP), is framed, or is cached."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [(b"content-security-policy", CSP.encode()), (b"x-content-type-options", b"nosniff"),
                            (b"referrer-policy", b"no-referrer"), (b"cache-control", b"no-store")]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)


# --- the app ---------------------------------------------------------------------------------------------------------
def stamps(paths: list[Path | None]) -> tuple:
    """What changes when any of ``paths`` changes (size and modification time; absent: None)."""
    found = []
    for path in paths:
        try:
            status = path.stat() if path is not None else None
        except OSError:
            status = None
        found.append((str(path), status.st_size, status.st_mtime_ns, status.st_ino) if status else None)
    return tuple(found)


class Views:
    """Each hospital's view, read once per change of its files (its audit log read in the lines added since:
    ``hospital_view.LogReader``), its policy file and the server logs it is checked against; only what moves with
    the clock (the trainings of the last 24 hours) is counted at every page."""

    def __init__(self, sources: Sources):
        self.sources = sources
        self.known: dict[str, tuple[tuple, Any]] = {}
        self.seconds = 0.0  #: the longest read of a hospital's files lately (a live page refreshes slower)

    def hospital(self, name: str, folder: Path):
        sources = self.sources
        logs = sources.server_logs()
        key = stamps([folder / f for f in HOSPITAL_FILES] + [sources.policy(name)] + list(logs.values()))
        known = self.known.get(name)
        if known is None or known[0] != key:
            started = time.perf_counter()
            view = read_hospital(folder, policy_file=sources.policy(name), node_config=sources.node_config,
                                 server_logs=logs)
            known = self.known[name] = (key, view)
            self.seconds = max(0.8 * self.seconds, time.perf_counter() - started)
        view = known[1]
        view.privacy.last_24h = trainings_since(view.privacy.trainings, time.time() - 24 * 3600)
        return view

    def warm(self) -> None:
        """Read every hospital's files now (before the console serves its first page, which then comes from what
        is kept): a year of audit log is verified line by line once, at start-up."""
        for name, folder in self.sources.hospitals().items():
            self.hospital(name, folder)


def create_app(sources: Sources, token: str | None = None, refresh_seconds: int = REFRESH_SECONDS,
               allowed_hosts: list[str] | None = None, secure_cookie: bool = False) -> Starlette:
    """The console over ``sources``; ``token``: required on every request when given; ``allowed_hosts``: the
    ``Host`` names it answers (others get 400: a page is never served to a name rebound to this address);
    ``secure_cookie``: the token's cookie only over HTTPS."""
    pages = templates()
    views = Views(sources)
    rendering = {"seconds": 0.0}  #: the slowest page lately: a live page refreshes no faster than 3 times that

    def page(request: Request, name: str, live: bool = False, status_code: int = 200, **context: Any) -> Response:
        slowest = max(rendering["seconds"], views.seconds)  # a page's reading and rendering
        refresh = max(refresh_seconds, math.ceil(3 * slowest)) if live else 0
        context.update(sources=sources, live=live, refresh=refresh, hospitals=list(sources.hospitals()),
                       run_names=list(sources.runs()))
        started = time.perf_counter()
        response = pages.TemplateResponse(request, name, context, status_code=status_code)
        rendering["seconds"] = max(0.8 * rendering["seconds"], time.perf_counter() - started)
        return response

    def not_found(request: Request, what: str) -> Response:
        return page(request, "missing.html", what=what, status_code=404)

    async def index(request: Request) -> Response:
        hospitals = [views.hospital(name, folder) for name, folder in sources.hospitals().items()]
        runs = list_run_rows(sources.results) if sources.runs() else []
        live = any(h.live for h in hospitals) or any(r["status"] == "running" for r in runs)
        return page(request, "index.html", live=live, hospital_views=hospitals, runs=runs)

    async def hospital(request: Request) -> Response:
        folder = sources.hospitals().get(request.path_params["name"])
        if folder is None:
            return not_found(request, f"no hospital named {request.path_params['name']!r} in {sources.state}")
        view = views.hospital(request.path_params["name"], folder)
        numbered = list(enumerate(view.runs, start=1))[::-1]  # the latest first, each with its number
        number, pages_count = page_number(request, len(numbered), RUNS_PER_PAGE)
        shown = numbered[(number - 1) * RUNS_PER_PAGE:number * RUNS_PER_PAGE]
        return page(request, "hospital.html", live=view.live, view=view, chart=Markup(epsilon_chart(view)),
                    shown_runs=shown, page=number, pages=pages_count, refusals_shown=REFUSALS_SHOWN)

    async def hospital_run(request: Request) -> Response:
        name, index = request.path_params["name"], request.path_params["index"]
        folder = sources.hospitals().get(name)
        if folder is None:
            return not_found(request, f"no hospital named {name!r} in {sources.state}")
        view = views.hospital(name, folder)
        if not 1 <= index <= len(view.runs):
            return not_found(request, f"hospital {name} has no run number {index}")
        run = view.runs[index - 1]
        number, pages_count = page_number(request, len(run.messages), MESSAGES_PER_PAGE)
        first = (number - 1) * MESSAGES_PER_PAGE
        return page(request, "hospital_run.html", live=view.live, view=view, run=run, page=number,
                    pages=pages_count, first=first, shown=run.messages[first:first + MESSAGES_PER_PAGE])

    async def runs(request: Request) -> Response:
        if sources.results is None:
            return not_found(request, "no results folder was given (fedmed console --results FOLDER)")
        rows = list_run_rows(sources.results)
        return page(request, "runs.html", live=any(r["status"] == "running" for r in rows), runs=rows)

    async def run(request: Request) -> Response:
        folder = sources.runs().get(request.path_params["name"])
        if folder is None:
            return not_found(request, f"no run named {request.path_params['name']!r} in {sources.results}")
        view = read_run(folder)
        return page(request, "run.html", live=view.live, view=view, shown_keys=SHOWN_KEYS,
                    charts=[Markup(chart) for chart in run_charts(view)])

    async def failure(request: Request, error: Exception) -> Response:
        return HTMLResponse(f"<!doctype html><title>fedmed console</title><p>fedmed console: a file could not be read: "
                            f"{Markup.escape(str(error))}</p>", status_code=500)

    middleware = [Middleware(SecurityHeaders)]
    if allowed_hosts:
        middleware.append(Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts))
    if token:
        middleware.append(Middleware(TokenGate, token=token, secure=secure_cookie))
    app = Starlette(routes=[Route("/", index), Route("/hospital/{name}", hospital),
                            Route("/hospital/{name}/run/{index:int}", hospital_run), Route("/runs", runs),
                            Route("/runs/{name}", run)],
                    middleware=middleware, exception_handlers={OSError: failure})
    app.state.views = views
    return app


def page_number(request: Request, items: int, per_page: int) -> tuple[int, int]:
    """(the page asked for by ``?page=``, within range; how many pages)."""
    count = max(1, math.ceil(items / per_page))
    try:
        return min(max(1, int(request.query_params.get("page", "1"))), count), count
    except ValueError:
        return 1, count


def epsilon_chart(view) -> str:
    privacy = view.privacy
    points = [(t.number, t.epsilon_after) for t in privacy.trainings]
    return charts.line_chart([charts.Series("epsilon spent", points)], title="Epsilon spent after each training "
                             f"(delta={privacy.delta:g})" if privacy.delta else "Epsilon spent after each training",
                             x_label="training number (privacy ledger)", y_label="epsilon", from_zero=True,
                             limit=privacy.max_epsilon, limit_label=f"budget: max-epsilon {privacy.max_epsilon:g}"
                             if privacy.max_epsilon else "")


def run_charts(view) -> list[str]:
    drawn = []
    if view.curves:
        drawn.append(charts.line_chart([charts.Series(k, v) for k, v in view.curves.items()
                                        if "loss" not in k and "hd95" not in k] or
                                       [charts.Series(k, v) for k, v in view.curves.items()],
                                       title="Global model on the server's test set", x_label="round",
                                       y_label="score", width=520))
    if view.validation:
        drawn.append(charts.line_chart([charts.Series(k, v) for k, v in view.validation.items()],
                                       title="Hospitals' validation (mean), model after round", x_label="round",
                                       y_label="value", width=520))
    if view.rounds:
        drawn.append(charts.line_chart(
            [charts.Series("to the server (up)", [(r.round, r.bytes_up / 1e6) for r in view.rounds]),
             charts.Series("to the hospitals (down)", [(r.round, r.bytes_down / 1e6) for r in view.rounds])],
            title="Traffic per round", x_label="round", y_label="MB", width=520))
    return drawn
