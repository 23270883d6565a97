"""Expiring uploads: Gradio keeps each upload as a new file and never deletes it, so a public demo's disk
would fill. A background thread deletes files older than limits.UPLOAD_MAX_AGE_S from the upload folder,
sparing the files that were there when the app started (its cached examples)."""

import logging
import os
import threading
import time

from app import limits

log = logging.getLogger(__name__)


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


def start_upload_cleaner(folder: str) -> threading.Thread:
    keep = _files(folder)

    def run():
        while True:
            time.sleep(limits.UPLOAD_CLEAN_EVERY_S)
            removed = clean_uploads(folder, limits.UPLOAD_MAX_AGE_S, keep)
            if removed:
                log.info("Deleted %d expired uploads", removed)

    thread = threading.Thread(target=run, name="upload-cleaner", daemon=True)
    thread.start()
    return thread
