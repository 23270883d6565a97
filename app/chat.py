"""Conversation state: Gradio chat history in, model messages out; reasoning tags in replies.

Model messages are plain dicts: {"role": "user" | "assistant", "content": [part, ...]} where a part is
{"type": "text", "text": str}, {"type": "image", "path": str} or {"type": "video", "path": str}; the first
may also be {"role": "system", "content": [text parts]} (the OpenAI-compatible API's, app.web.openai_request).
"""

import os
import re

from app.media.files import media_kind, source_of

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_REASONING = re.compile(re.escape(THINK_OPEN) + r".*?(" + re.escape(THINK_CLOSE) + r"|$)", re.DOTALL)


def strip_reasoning(text: str) -> str:
    """The answer without its reasoning block: past reasoning is not fed back to the model."""
    return _REASONING.sub("", text).strip()


_CODE = re.compile(r"(```.*?(?:```|$)|`[^`\n]*`)", re.DOTALL)


def _markup_as_text(text: str) -> str:
    """HTML in a reply shows as the characters it is made of: every "<" outside code becomes "&lt;".

    Code spans and blocks are left alone (Markdown shows them literally already), and so are the
    reasoning tags, which the chat display turns into a collapsible block.
    """
    parts = _CODE.split(text)
    for i in range(0, len(parts), 2):  # even parts lie outside code
        parts[i] = (parts[i].replace("<", "&lt;")
                    .replace("&lt;" + THINK_OPEN[1:], THINK_OPEN).replace("&lt;" + THINK_CLOSE[1:], THINK_CLOSE))
    return "".join(parts)


def reply_text(generated: str, prompt_opens_thinking: bool) -> str:
    """The reply with its reasoning block made explicit when the chat template already opened it in the prompt."""
    if prompt_opens_thinking and not generated.lstrip().startswith(THINK_OPEN):
        return THINK_OPEN + generated
    return generated


def reply_for_display(generated: str, prompt_opens_thinking: bool, finished: bool = False) -> str:
    """The reply as the chat page shows it: markup as text (`reply_text` is what the API returns).

    A finished reply that ended inside its reasoning (the token limit came first) gets the block closed,
    or the page would show it as still thinking forever.
    """
    shown = _markup_as_text(reply_text(generated, prompt_opens_thinking))
    return close_reasoning(shown) if finished else shown


def close_reasoning(text: str) -> str:
    """`text` with a reasoning block left open at its end closed."""
    if text.rfind(THINK_OPEN) > text.rfind(THINK_CLOSE):
        return text + THINK_CLOSE
    return text


def _file_path(part) -> str | None:
    if isinstance(part, str):
        return None
    if isinstance(part, dict):
        if part.get("type") == "file":
            return part["file"]["path"]
        return part.get("path")
    return getattr(part, "path", None)


def _parts_of(content) -> list:
    return content if isinstance(content, (list, tuple)) else [content]


def _text_of(part) -> str | None:
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and part.get("type") == "text":
        return part["text"]
    return None


def user_content(text: str, paths: list[str]) -> list[dict]:
    """A user turn: media first, then the question, as MiniCPM-V is prompted."""
    parts = [{"type": media_kind(path), "path": source_of(path)} for path in paths]
    if text.strip():
        parts.append({"type": "text", "text": text})
    return parts


def plain_file(path: str) -> dict:
    """A file the chat shows by its name, never drawn as a picture or played: a refused upload may be none
    (a broken-image icon was all the chat showed of one)."""
    return {"type": "file", "file": {"path": path, "mime_type": "application/octet-stream",
                                     "orig_name": os.path.basename(path)}}


ERROR_TITLE = "⚠️ "  # starts the title of error_message, and of nothing else in a chat


def error_message(text: str) -> dict:
    """A failed turn's reply: the reason, shown where the answer would have been."""
    return {"role": "assistant", "content": text, "metadata": {"title": ERROR_TITLE + text, "status": "done"}}


def is_error(entry: dict) -> bool:
    return (entry.get("metadata") or {}).get("title", "").startswith(ERROR_TITLE)


def ends_in_error(history: list) -> bool:
    """Whether the last turn failed."""
    return bool(history) and is_error(history[-1])


def _answered_by_an_error(history: list[dict]) -> set[int]:
    """The indexes of the user messages whose turn failed: they stay on the page, under their error, and
    never reach the model (its next question is asked as if they had not been sent)."""
    failed, turn = set(), []
    for index, entry in enumerate(history):
        if entry["role"] == "user":
            turn.append(index)
        elif is_error(entry):
            failed.update(turn)
            turn = []
        else:  # answered (its reasoning alone counts: Gradio hands it over as a message of its own)
            turn = []
    return failed


def box_value(turn: list[dict]) -> dict:
    """A turn's user messages as the chat box holds them: its text, and its files (a video's original)."""
    parts = [part for entry in turn for part in _parts_of(entry["content"])]
    texts = [text for text in map(_text_of, parts) if text is not None]
    files = [source_of(path) for path in map(_file_path, parts) if path is not None]
    return {"text": "\n".join(texts), "files": files}


def history_to_messages(history: list[dict]) -> list[dict]:
    """Gradio messages (text and file parts, several per turn) to model messages, one per turn.

    Messages carrying metadata (stats, notices, errors) are for the reader only and are skipped, and so are
    the turns an error answered.
    """
    messages: list[dict] = []
    failed = _answered_by_an_error(history)
    for index, entry in enumerate(history):
        if entry.get("metadata") or index in failed:
            continue
        role = entry["role"]
        parts = []
        for part in _parts_of(entry["content"]):
            path = _file_path(part)
            if path is not None:
                if role == "user":  # a video's browser copy is shown; the model reads the original
                    parts.append({"type": media_kind(path), "path": source_of(path)})
                continue
            text = _text_of(part)
            if text is None:
                continue
            if role == "assistant":
                text = strip_reasoning(text.replace("&lt;", "<"))  # undo _markup_as_text
            if text:
                parts.append({"type": "text", "text": text})
        if not parts:
            continue
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"].extend(parts)
        else:
            messages.append({"role": role, "content": parts})
    for message in messages:
        if message["role"] == "user":
            # Keep media ahead of text inside a merged turn, in upload order.
            message["content"].sort(key=lambda part: part["type"] == "text")
    return messages
