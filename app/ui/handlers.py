"""Plain functions behind every UI event and the /ask API, testable without a server.

They reach the model only through the manager's small interface: `default_settings()` and `stream()`
(app.ui.previews has the previews before a question is sent, and `plan_images()`).
"""

import time
from contextlib import closing

import gradio as gr

from app import tuning
from app.messages import (
    MSG_EMPTY_CHAT,
    MSG_EMPTY_QUESTION,
    MSG_EMPTY_REQUEST,
    MSG_MULTI_IMAGE_NEEDS_IMAGES,
    MSG_NOTHING_TO_FOLLOW_UP,
    MSG_RANDOM_WEIGHTS,
    MSG_SETTINGS_NOT_OBJECT,
    MSG_STOPPED,
    MSG_SWITCH_OFF,
    MSG_VIDEO_NEEDS_VIDEO,
    MSG_WAITING,
)
from app.chat import (box_value, error_message, history_to_messages, plain_file, reply_for_display, reply_text,
                      strip_reasoning, user_content)
from app.engine.settings import parse_flag
from app.errors import UserError
from app.media.files import media_kind
from app.media.images import check_image
from app.media.video import probe_video
from app.ui.load_charts import chart_values
from app.ui.refusals import log_refusal, refusal

# The settings components, in the order every generating event passes them after its own inputs
# (app.ui.layout); handlers take them as one dict (settings_dict).
SETTING_KEYS = ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "repetition_penalty",
                "enable_thinking", "max_slice_nums", "downsample_mode", "visual_token_budget",
                "video_fps", "video_max_frames", "video_slices_per_frame")


def settings_dict(values) -> dict:
    """The settings components' values, in SETTING_KEYS order, as one dict by setting name."""
    return dict(zip(SETTING_KEYS, values))


def upload_path(file) -> str:
    if isinstance(file, str):
        return file
    if isinstance(file, dict):
        return file["path"]
    if isinstance(file, (list, tuple)):  # gallery items are (path, caption)
        return file[0]
    return file.path


def _check_upload(path: str) -> None:
    """Refuse a bad file before it enters the chat, from what can be read quickly. Decoding a whole image
    here, in the web process, put a second decoding on the way to every first token (35 ms for a
    1344x1344 PNG on the H200 box's core); an image broken past its header fails in the engine, whose
    error the reply shows."""
    if media_kind(path) == "image":
        check_image(path)
    else:
        probe_video(path)


def model_header(info) -> str:
    """The page's title line: the model, where it runs, its size; and a warning if its weights are random."""
    if info.parameters is None:
        return f"# MiniCPM-V\n**{info.name}**, served by the OpenAI-compatible server at `{info.path}`"
    memory = f"{info.weight_bytes / 2**30:.2f} GiB" if info.weight_bytes >= 2**30 else f"{info.weight_bytes / 2**20:.1f} MiB"
    warmup = f" · warm-up {info.warmup_s:.2f} s" if info.warmup_s is not None else ""
    gpu = f" · {info.gpu_memory_bytes / 2**30:.2f} GiB of GPU memory in use" if info.gpu_memory_bytes is not None else ""
    warning = f"\n\n> {MSG_RANDOM_WEIGHTS}" if info.random_weights else ""
    return (f"# MiniCPM-V\n**{info.name}** (`{info.model_type}`) on **{info.device}** · {info.dtype} · "
            f"{info.parameters / 1e6:,.2f} M parameters · {memory} of weights{gpu}{warmup}{warning}")


def _duration(ms: float) -> str:
    return f"{ms:.0f} ms" if ms < 1000 else f"{ms / 1000:.2f} s"


def stats_message(stats: dict, notices: list[str]) -> dict:
    """A line under the reply, opening on a small table: the reader sees it, the model never does (it has
    metadata). The empty span ending its title tells the page's style (assets/style.css) the line from a
    reasoning block, which looks the same to Gradio."""
    new = f"{stats['new_tokens']:,} new token{'s' if stats['new_tokens'] != 1 else ''}"
    speed = f" at {stats['tokens_per_s']:,.0f} tokens/s" if stats["tokens_per_s"] else ""
    # An external server counts visual and prompt tokens itself (None here).
    visual = f"{stats['visual_tokens']:,} visual tokens · " if stats["visual_tokens"] is not None else ""
    line = f"{visual}first token after {_duration(stats['ttft_ms'])} · {new}{speed}"
    rows = [("Prompt", f"{stats['prompt_tokens']:,} tokens")] if stats["prompt_tokens"] is not None else []
    if stats.get("reused_prompt_tokens"):  # what the engine kept of the conversation (an external server: none)
        rows.append(("Kept from the conversation", f"{stats['reused_prompt_tokens']:,} tokens, not read again"))
    if stats.get("reused_image_tokens"):  # earlier turns' images kept encoded
        rows.append(("Images kept encoded", f"{stats['reused_image_tokens']:,} tokens, not encoded again"))
    if stats["image_tokens"]:
        rows.append(("Images", ", ".join(f"#{i + 1} {n:,}" for i, n in enumerate(stats["image_tokens"])) + " tokens"))
    if stats["video_frames"]:
        tokens = f", {stats['video_tokens']:,} tokens" if stats["video_tokens"] is not None else ""
        rows.append(("Video", f"{stats['video_frames']} frames{tokens}"))
    stages = stats.get("preparation_ms") or {}  # an external server's replies have none
    waited = stages.get("to_preparer", 0) + stages.get("for_a_worker", 0)
    busy = f" ({_duration(waited)} of it waiting for a free preparer)" if waited >= tuning.PREPARATION_WAIT_SHOWN_MS else ""
    rows.append(("Preprocessing", _duration(stats["preprocess_ms"]) + busy))
    if stats["queue_ms"] is not None:  # a stopped reply's is not known
        rows.append(("Waiting for the model", _duration(stats["queue_ms"])))
    rows += [
             ("First token", _duration(stats["ttft_ms"])),
             ("Total", _duration(stats["total_ms"]))]
    # A table without a header (an empty one, which the style hides): each row names itself.
    table = "\n".join(["| | |", "|:--|:--|", *(f"| {name} | {value} |" for name, value in rows)])
    return {"role": "assistant", "content": "\n\n".join([table, *notices]),
            "metadata": {"title": f'{line}<span class="reply-stats"></span>', "status": "done"}}


def load_panel(snapshot: dict) -> str:
    """The live server panel: the same figures as /metrics, for people rather than scrapers."""
    def seconds(value):
        return "–" if value is None else f"≤ {value * 1000:.0f} ms"

    requests = snapshot["requests"]
    lines = [f"**{snapshot.get('batch_size', snapshot.get('requests_in_flight', 0))}** answering now · "
             f"**{snapshot.get('queue_depth', 0)}** waiting · **{snapshot['tokens_per_s']:,.0f}** tokens/s (last 10 s)",
             f"First token p50 {seconds(snapshot['ttft_p50_s'])}, p95 {seconds(snapshot['ttft_p95_s'])} · "
             f"per token p50 {seconds(snapshot['token_latency_p50_s'])}",
             f"{requests['finished']:,} answered · {requests['stopped']:,} stopped · {requests['error']:,} errors · "
             f"{requests['busy']:,} turned away busy · {snapshot['decode_steps']:,} decode steps"]
    if snapshot.get("gpu_memory_bytes") is not None:
        lines.append(f"GPU memory in use {snapshot['gpu_memory_bytes'] / 2**30:.2f} GiB")
    return "  \n".join(lines)


def page_update_interval(text: str) -> float:
    """How long a reply of `text` goes without an update to the page: longer as it grows (each update
    renders the whole reply again in the browser: app.tuning.CHAT_UPDATE_CHARS_PER_S)."""
    return min(len(text) / tuning.CHAT_UPDATE_CHARS_PER_S, tuning.CHAT_UPDATE_MAX_INTERVAL_S)


def waiting_message(ahead: int) -> dict:
    """Shown in place of the reply while the request waits in line; never part of the conversation."""
    text = MSG_WAITING.format(ahead=ahead)
    return {"role": "assistant", "content": "", "metadata": {"title": text, "status": "pending"}}


def stopped_stats_message(stats: dict, notices: list[str]) -> dict:
    """A stopped reply's stats line: what it had done when Stop came, marked as stopped."""
    message = stats_message(stats, notices)
    return {**message, "metadata": {**message["metadata"], "title": f"{MSG_STOPPED} · {message['metadata']['title']}"}}


def _stopped_early(text: str) -> list[dict]:
    """What stays of a reply stopped with no stats: its text (as reply_for_display finished it), if any,
    and the mark."""
    said = [{"role": "assistant", "content": text}] if text else []
    return said + [{"role": "assistant", "content": "", "metadata": {"title": MSG_STOPPED, "status": "done"}}]


def _error_reply(message: str) -> dict:
    log_refusal(message)
    return error_message(message)


def _checked_turn(paths: list[str]) -> tuple[list[dict], str | None, dict | None]:
    """The user messages of `paths`, the first of them that is refused (from what can be read quickly) and the
    error reply for it, or None and None. The refused file is shown by its name (app.chat.plain_file)."""
    refused, reply = None, None
    for path in paths:
        try:
            _check_upload(path)
        except UserError as error:
            refused, reply = path, _error_reply(str(error))
            break
    turn = [{"role": "user", "content": plain_file(path) if path == refused else {"path": path}} for path in paths]
    return turn, refused, reply


class Handlers:
    def __init__(self, manager, clock=time.monotonic):
        self.manager = manager
        self.clock = clock  # what paces a reply's updates to the page (page_update_interval)

    def settings_from(self, overrides: dict, also_known: tuple[str, ...] = ()):
        return self.manager.default_settings().with_overrides(overrides, also_known)

    # Shared: stream a reply into a chat history -----------------------------------------------------

    def respond(self, history: list, settings: dict, stop=None):
        """Stream the assistant's reply to the last user turn of `history` (Chat, Multi-image and Video
        tabs) under the UI's `settings` (by name); `stop` (app.engine.stop_signal) ends it at once, with
        what it had said and its stats marked as stopped. A failure is the turn's reply (error_message):
        the turn stays on the page, and out of the conversation the model is given (app.chat)."""
        history = list(history or [])
        asked = len(history)
        try:
            settings = self.settings_from(settings)
            messages = history_to_messages(history)
            history.append({"role": "assistant", "content": ""})
            ended, shown_at, latest = False, 0.0, None
            # closing(): when Gradio cancels this handler (a client gone), the stream's cleanup takes the
            # request out of the batch.
            with closing(self.manager.stream(messages, settings, stop)) as updates:
                for update in updates:
                    if update.waiting_ahead is not None:
                        history[-1] = waiting_message(update.waiting_ahead)
                        yield history
                        continue
                    ended, latest = update.stats is not None, update
                    if not ended and self.clock() - shown_at < page_update_interval(update.text):
                        continue  # the next update, or the last, shows it
                    shown_at = self.clock()
                    history[-1] = {"role": "assistant", "content": reply_for_display(
                        update.text, update.opens_thinking, finished=ended)}
                    if ended:
                        lines = stopped_stats_message if update.stopped else stats_message
                        history.append(lines(update.stats, update.notices))
                    yield history
            if not ended:  # stopped with no stats: before its first word, or by a server that gives none
                said = "" if latest is None else reply_for_display(latest.text, latest.opens_thinking, finished=True)
                yield history[:asked] + _stopped_early(said)
        except UserError as error:
            log_refusal(str(error))
            yield history[:asked] + [error_message(str(error))]

    @staticmethod
    def end_stopped_reply(history: list) -> list:
        """After Stop: reasoning cut off mid-way is marked done, or the page would show it as still
        thinking forever (Gradio hands reasoning over as a message of its own, status "pending")."""
        history = list(history or [])
        for index in reversed(range(len(history))):
            if history[index]["role"] != "assistant":
                break
            metadata = history[index].get("metadata") or {}
            if metadata.get("status") == "pending":
                history[index] = {**history[index], "metadata": {**metadata, "status": "done"}}
        return history

    # Chat tab ---------------------------------------------------------------------------------------

    def add_chat_message(self, message: dict | None, camera_image: str | None, history: list):
        """Put the user's text and attachments into the history, then (history, box, camera) as they are to
        be. A bad file is refused here, before the model: the turn stays, the reason is its reply, and the
        box and camera keep what was sent. An empty message is refused as gr.Error (nothing was asked)."""
        message = message or {}
        text = message.get("text") or ""
        paths = [upload_path(file) for file in message.get("files") or []]
        if camera_image:
            paths.append(camera_image)
        if not text.strip() and not paths:
            raise refusal(MSG_EMPTY_CHAT)
        turn, refused, reply = _checked_turn(paths)
        if text.strip():
            turn.append({"role": "user", "content": text})
        history = list(history or []) + turn
        if reply is not None:  # the box gets the refused file back by its name too
            files = [plain_file(path)["file"] if path == refused else file
                     for file, path in zip(message.get("files") or [], paths)]
            return history + [reply], {**message, "files": files}, camera_image
        return history, None, None

    def retry(self, history: list, retry_data: gr.RetryData):
        """Keep history up to the retried turn's user message; `respond` then answers it again (a turn that
        failed is sent again: every failure is the reply to a turn of its own, app.chat.error_message)."""
        kept = list(history[: retry_data.index + 1])
        while kept and kept[-1]["role"] != "user":
            kept.pop()
        return kept

    def undo(self, history: list, undo_data: gr.UndoData):
        """Drop the undone turn and hand its text and files back to the input box."""
        kept = list(history[: undo_data.index + 1])
        while kept and kept[-1]["role"] != "user":
            kept.pop()
        removed = []
        while kept and kept[-1]["role"] == "user":
            removed.insert(0, kept.pop())
        return kept, box_value(removed)

    def undo_question(self, history: list, undo_data: gr.UndoData):
        """Undo where the media stay in their own place (Multi-image, Video): the question goes back to the box."""
        kept, message = self.undo(history, undo_data)
        return kept, message["text"]

    # Multi-image tab --------------------------------------------------------------------------------

    @staticmethod
    def selected_index(event: gr.SelectData) -> int:
        return event.index

    @staticmethod
    def move_image(gallery: list | None, index: int | None, offset: int):
        paths = [upload_path(item) for item in gallery or []]
        if index is None or not 0 <= index < len(paths):
            return paths, index
        target = min(max(index + offset, 0), len(paths) - 1)
        paths.insert(target, paths.pop(index))
        return paths, target

    @staticmethod
    def remove_image(gallery: list | None, index: int | None):
        paths = [upload_path(item) for item in gallery or []]
        if index is not None and 0 <= index < len(paths):
            paths.pop(index)
        return paths, None

    def add_multi_image_question(self, question: str, gallery: list | None, history: list):
        """The first question carries every gallery image, in gallery order; follow-ups are text only."""
        paths = [upload_path(item) for item in gallery or []]
        return self._add_question(question, paths, history, MSG_MULTI_IMAGE_NEEDS_IMAGES)

    # Video tab --------------------------------------------------------------------------------------

    def add_video_question(self, question: str, video: str | None, history: list):
        return self._add_question(question, [video] if video else [], history, MSG_VIDEO_NEEDS_VIDEO)

    def _add_question(self, question: str, paths: list[str], history: list, no_media: str):
        """(history, box) as add_chat_message gives them, for a tab whose media are already there (`paths`,
        or `no_media` is the reply)."""
        if not (question or "").strip():
            raise refusal(MSG_EMPTY_QUESTION if paths else no_media)
        history = list(history or [])
        first = not any(entry["role"] == "user" for entry in history)
        turn, _, reply = _checked_turn(paths if first else [])
        turn.append({"role": "user", "content": question})
        reply = reply if paths else _error_reply(no_media)
        if reply is not None:
            return history + turn + [reply], question
        return history + turn, ""

    def server_load(self) -> list:
        """The Server load panel's text, then its charts' values (app.ui.load_charts)."""
        return [load_panel(self.manager.metrics.snapshot()), *chart_values(self.manager.metrics.history())]

    # Model picker -----------------------------------------------------------------------------------

    def switch_model(self, model: str, progress=gr.Progress()):
        """Load another checkpoint for everyone (only wired with --allow-model-switch)."""
        if not self.manager.config.allow_model_switch:
            raise refusal(MSG_SWITCH_OFF)
        model = (model or "").strip()
        progress(0.1, desc=f"Waiting for replies in progress, then loading {model}…")
        try:
            result = self.manager.switch(model)
        except UserError as error:
            raise refusal(str(error)) from None
        freed = result["freed_gpu_bytes"] / 2**30
        gr.Info(f"Now serving {model}" + (f" ({freed:.2f} GiB of GPU memory released)" if freed > 0 else "") + ".")
        info = self.manager.info()
        return model_header(info), info.thinking_by_default

    # API --------------------------------------------------------------------------------------------

    def ask(self, text: str, files: list | None, settings: dict | None, conversation: list | None, stop=None):
        """/ask: stream (reply_text, stats). settings["follow_up"] = true continues this client's last
        conversation; `stop` ends the reply at once."""
        if settings is not None and not isinstance(settings, dict):
            raise refusal(MSG_SETTINGS_NOT_OBJECT)
        started_at = time.time()
        overrides = dict(settings or {})
        text = text or ""
        paths = [upload_path(file) for file in files or []]
        try:
            follow_up = parse_flag("follow_up", overrides.pop("follow_up", False))
            generation_settings = self.settings_from(overrides, also_known=("follow_up",))
            if not text.strip() and not paths:
                raise UserError(MSG_EMPTY_REQUEST)
            messages = list(conversation or []) if follow_up else []
            messages.append({"role": "user", "content": user_content(text, paths)})
            reply, update = "", None
            with closing(self.manager.stream(messages, generation_settings, stop)) as updates:
                for update in updates:
                    reply = reply_text(update.text, update.opens_thinking)
                    if update.waiting_ahead is not None:
                        yield reply, {"done": False, "waiting_ahead": update.waiting_ahead}, gr.skip()
                    elif update.stats is None:
                        yield reply, {"done": False}, gr.skip()
            if update is None or update.stats is None:  # stopped before it began
                return
            answer = {"role": "assistant", "content": [{"type": "text", "text": strip_reasoning(reply)}]}
            notices = [MSG_NOTHING_TO_FOLLOW_UP] if follow_up and not conversation else []
            yield reply, {"done": True, "stopped": update.stopped, **update.stats, "handler_started_at": round(started_at, 3),
                          "notices": notices + update.notices}, messages + [answer]
        except UserError as error:
            raise refusal(str(error)) from None
