"""Uploads: stored without debris, expired, and bounded in total.

Gradio 6.31 keeps each upload as a new file and never deletes it, so a public demo's disk would fill.
It also leaves debris: its multipart parser (gradio.route_utils.GradioMultiPartParser, called by
upload_fn from the POST /gradio_api/upload route) writes each file part to a NamedTemporaryFile in the
upload folder and deletes it only on a parse error, so an upload broken off (ClientDisconnect) keeps its
partial file, as does a file part not named "files"; and gr.File's preprocess with type="filepath"
(File._process_single_file) makes an empty NamedTemporaryFile there for every file of every event and
never uses it.

So the app serves the upload route itself (upload_route, matched before Gradio's): each upload is parsed
into a folder of its own, its files are moved into place when it completes, and the folder goes with
whatever is left, however the upload ended. An UploadJanitor thread deletes the empty temporary files,
uploads older than limits.UPLOAD_MAX_AGE_S, and the oldest uploads once the folder holds more than
limits.UPLOAD_MAX_TOTAL_MB, sparing the files that were there when it was made (the cached examples).
"""

import asyncio
import logging
import math
import os
import re
import shutil
import tempfile
import threading
import time
from typing import Callable

from app import limits

log = logging.getLogger(__name__)

STAGING_PREFIX = ".upload-"  # an upload's own folder while it comes in; the janitor neither counts nor evicts it
# tempfile.NamedTemporaryFile's names: "tmp" and 8 of its random characters. With uploads parsed in
# their own folders, such an empty file at the top of the upload folder is only ever gr.File's.
_STRAY_TEMP_FILE = re.compile(r"tmp[a-z0-9_]{8}")
SWEEP_EVERY_S = 1.0  # how often the janitor looks for gr.File's empty files (the top folder only: cheap)
# A dot-file this young is taken for Gradio's copy of a file on its way into place, and not evicted.
STAGING_GRACE_S = 60.0
CAP_CHECK_GAP_S = 0.5  # at least this long between two walks of the folder while uploads keep coming


def _files(folder: str) -> set[str]:
    return {os.path.join(root, name) for root, _, names in os.walk(folder) for name in names}


def clean_uploads(folder: str, max_age_s: float, keep: set[str]) -> int:
    """Delete files in `folder` older than `max_age_s` (except `keep`) and the folders they leave empty."""
    cutoff = time.time() - max_age_s
    removed = 0
    for path in _files(folder) - keep:
        try:
            if os.path.getmtime(path) < cutoff:
                os.remove(path)
                removed += 1
        except OSError:  # already gone, or in use elsewhere: the next round sees it again
            continue
    for root, dirs, names in os.walk(folder, topdown=False):
        if root != folder and not dirs and not names:
            try:
                # An empty folder made just now is an upload on its way in (Gradio makes the folder, then
                # moves the file there): removing it failed that upload.
                if os.path.getmtime(root) < cutoff:
                    os.rmdir(root)
            except OSError:
                pass
    return removed


def remove_stray_temp_files(folder: str) -> int:
    """Delete the empty temporary files at the top of `folder` (gr.File's, see the module's docstring)."""
    removed = 0
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    for entry in entries:
        try:
            if (_STRAY_TEMP_FILE.fullmatch(entry.name) and entry.is_file(follow_symlinks=False)
                    and entry.stat(follow_symlinks=False).st_size == 0):
                os.remove(entry.path)
                removed += 1
        except OSError:  # gone meanwhile
            continue
    return removed


def cap_total_size(folder: str, max_bytes: int, keep: set[str]) -> int:
    """Delete the oldest files in `folder` (by modification time; never `keep`, nor uploads still coming
    in) until all of them together take at most `max_bytes`; the number deleted."""
    total, candidates, now = 0, [], time.time()
    for root, dirs, names in os.walk(folder):
        dirs[:] = [name for name in dirs if not name.startswith(STAGING_PREFIX)]
        for name in names:
            path = os.path.join(root, name)
            try:
                status = os.stat(path, follow_symlinks=False)
            except OSError:
                continue
            total += status.st_size
            # A young dot-file is Gradio's copy on its way into place (processing_utils writes one, then
            # renames it); no upload is stored under such a name (_into_place).
            staging = name.startswith(".") and now - status.st_mtime < STAGING_GRACE_S
            if path not in keep and not staging:
                candidates.append((status.st_mtime_ns, path, status.st_size))
    removed = 0
    for _, path, size in sorted(candidates):
        if total <= max_bytes:
            break
        try:
            os.remove(path)
        except OSError:
            continue
        total -= size
        removed += 1
    return removed  # the folders they leave empty go with clean_uploads' age rule (one may be refilled now)


class UploadJanitor:
    """Keeps `folder` clean and bounded from a thread of its own (start); `uploaded()` has it check the
    total size at once rather than at its next round."""

    def __init__(self, folder: str, max_total_bytes: int | None = None, max_age_s: float | None = None,
                 clean_every_s: float | None = None):
        self.folder = folder
        self.keep = _files(folder)  # the examples cached at start
        self.max_total_bytes = limits.UPLOAD_MAX_TOTAL_MB * 2**20 if max_total_bytes is None else max_total_bytes
        self.max_age_s = limits.UPLOAD_MAX_AGE_S if max_age_s is None else max_age_s
        self.clean_every_s = limits.UPLOAD_CLEAN_EVERY_S if clean_every_s is None else clean_every_s
        self._uploaded = threading.Event()

    def uploaded(self) -> None:
        self._uploaded.set()

    def start(self, running: Callable[[], bool] = lambda: True) -> threading.Thread:
        """Work until `running()` is false (the server closed)."""
        thread = threading.Thread(target=self._run, args=(running,), name="upload-janitor", daemon=True)
        thread.start()
        return thread

    def _run(self, running: Callable[[], bool]) -> None:
        next_round = time.monotonic() + self.clean_every_s
        while running():
            check_size = self._uploaded.wait(SWEEP_EVERY_S)
            self._uploaded.clear()
            try:
                remove_stray_temp_files(self.folder)
                if time.monotonic() >= next_round:
                    next_round = time.monotonic() + self.clean_every_s
                    expired = clean_uploads(self.folder, self.max_age_s, self.keep)
                    if expired:
                        log.info("Deleted %d expired uploads", expired)
                    check_size = True  # also what other processes sharing the folder stored
                if check_size:
                    evicted = cap_total_size(self.folder, self.max_total_bytes, self.keep)
                    if evicted:
                        log.info("Deleted the %d oldest uploads: the upload folder was over %d MB", evicted,
                                 self.max_total_bytes // 2**20)
                    time.sleep(CAP_CHECK_GAP_S)  # a flood of uploads walks the folder twice a second, not back to back
            except Exception:  # a passing file-system error must not end the janitor
                log.exception("Cleaning the upload folder failed")


def upload_route(janitor: UploadJanitor):
    """POST /gradio_api/upload, as Gradio's own (gradio.routes: upload_file) but without debris: each upload
    is parsed by Gradio's upload_fn into a folder of its own inside the upload folder, its files are moved
    from there to where Gradio puts them (<upload folder>/<hash>/<name>), and the folder is deleted
    whether the upload completed, failed, broke off or stalled. Given to the app before Gradio's routes
    (launch's app_kwargs), it is the one matched."""
    from fastapi import Request
    from fastapi.responses import PlainTextResponse
    from fastapi.routing import APIRoute
    from gradio.route_utils import API_PREFIX
    from starlette.requests import ClientDisconnect

    async def upload(request: Request, upload_id: str | None = None):
        from gradio.route_utils import MultiPartException, upload_fn
        from gradio.routes import file_upload_statuses  # what Gradio's /upload_progress reports from

        served = request.app
        blocks = served.get_blocks()
        folder = served.uploaded_file_dir
        os.makedirs(folder, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=folder)
        try:
            staged, _, _ = await upload_fn(
                giving_up_on_stalls(request), staging,
                blocks.max_file_size if blocks.max_file_size is not None else math.inf, upload_id,
                force_move=True, upload_progress=file_upload_statuses if upload_id else None)
            stored = [_into_place(path, staging, folder) for path in staged]
        except MultiPartException as error:
            return PlainTextResponse(error.message, status_code=413 if "maximum allowed size" in error.message else 400)
        except ClientDisconnect:
            return PlainTextResponse("The upload broke off.", status_code=400)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # partial files, and parts not named "files"
        blocks.upload_file_set.update(stored)
        janitor.uploaded()
        return stored

    return APIRoute(f"{API_PREFIX}/upload", upload, methods=["POST"])


def giving_up_on_stalls(request):
    """`request` whose body reads as broken off (ClientDisconnect) once the client sends nothing for
    limits.UPLOAD_STALL_TIMEOUT_S."""
    from starlette.requests import Request

    receive = request.receive

    async def receive_or_give_up():
        try:
            return await asyncio.wait_for(receive(), limits.UPLOAD_STALL_TIMEOUT_S)
        except asyncio.TimeoutError:
            return {"type": "http.disconnect"}

    return Request(request.scope, receive_or_give_up)


def _into_place(path: str, staging: str, folder: str) -> str:
    """Move a file parsed into `staging` to the same place under `folder`, its name without leading dots: a
    dot-file there is Gradio's copy on its way into place, which cap_total_size spares while it is young."""
    relative = os.path.relpath(path, staging)
    name = os.path.basename(relative).lstrip(".") or "upload"
    destination = os.path.join(folder, os.path.dirname(relative), name)
    os.makedirs(os.path.dirname(destination), exist_ok=True)
    try:
        os.replace(path, destination)
    except FileNotFoundError:  # its folder, empty and old, was removed by the age rule meanwhile: again
        os.makedirs(os.path.dirname(destination), exist_ok=True)
        os.replace(path, destination)
    return destination
