"""What an event's values may be, checked before Gradio processes any of them: every file one names is one that
this app stored from an upload, a file input holds files, and the values are as many as the event's inputs and
of kinds their components take (else a message, where Gradio's own errors reached the client as {"error": null}).

An event's data comes from the client, and a client can name any string as a file's `path`: a URL
(Gradio itself downloads an `http(s)://` path into its cache, and OpenCV's FFmpeg reader opens URLs and
protocols such as `rtsp:`, `concat:` or `pipe:`), a device, or another file of the server. Gradio checks
local paths against its upload folder but lets URLs through, so the app checks every file object of
every event (chat history included) before Gradio touches any of them.
"""

import inspect
import logging
import os

import gradio as gr
from pydantic import ValidationError

from app.messages import MSG_NOT_AN_UPLOAD, MSG_NOT_FILES, MSG_NOT_TAKEN, MSG_TOO_FEW_VALUES
from app.media.files import shown_name
from app.ui.refusals import refusal

log = logging.getLogger(__name__)


def uploaded_files_only(inputs, upload_folder: str) -> None:
    """Raise gr.Error unless every file object in `inputs` (any dict with a "path") names a file in
    `upload_folder`."""
    folder = os.path.realpath(upload_folder)
    for path in _file_paths(inputs):
        if not (isinstance(path, str) and inside_folder(path, folder)):
            raise refusal(MSG_NOT_AN_UPLOAD.format(name=shown_name(path)))


def _file_paths(value):
    if isinstance(value, dict):
        if "path" in value:
            yield value["path"]
        for item in value.values():
            yield from _file_paths(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _file_paths(item)


_LONGEST_NAME = 255  # bytes of one file name, on Linux's file systems


def inside_folder(path: str, folder: str) -> bool:
    """Whether `path` lies inside `folder` (a real path) and is no folder, however it is spelled (`..`, links)."""
    if "\0" in path or not os.path.isabs(path):  # a relative path or "scheme:..." is never an upload's
        return False
    try:  # nor one the file system cannot name (a lone surrogate, a name past 255 bytes): Gradio failed on them
        if any(len(part.encode()) > _LONGEST_NAME for part in path.split(os.sep)):
            return False
    except UnicodeEncodeError:
        return False
    real = os.path.realpath(path)
    # A name inside the folder whose file has gone (an upload that expired: app.web.uploads) passes: it opens
    # nothing, and the reply says the image could not be read, as for any conversation older than the age.
    return real.startswith(folder + os.sep) and not os.path.isdir(real)


def files_where_files_go(blocks: list, inputs: list) -> None:
    """Raise gr.Error where a file input (the app's are lists: /ask's) holds something other than files, a bare
    string say: Gradio's own check of it failed with an error that said nothing (`{"error": null}`). Checked as
    Gradio checks it."""
    for block, value in zip(blocks, inputs):
        if isinstance(block, gr.File) and value is not None:
            try:
                block.data_model.model_validate(value, context={"validate_meta": True})
            except ValidationError:
                raise refusal(MSG_NOT_FILES.format(label=block.label or "files", what=_what_is_wrong(value))) from None


def _what_is_wrong(value) -> str:
    """What of a file list's `value` is not an uploaded file, as a client can put it right."""
    if not isinstance(value, list):
        return f"it was {_kind(value)}"
    from gradio.data_classes import FileData

    for index, item in enumerate(value):
        if not isinstance(item, dict):
            return f"its item {index} was {_kind(item)}"
        try:
            FileData.model_validate(item, context={"validate_meta": True})
        except ValidationError:
            return (f'its item {index} is no file as handle_file makes one (a "path", and "meta": '
                    '{"_type": "gradio.FileData"})')
    return "its items are not files"


def _kind(value) -> str:
    kinds = {str: "a string", bool: "true or false", int: "a number", float: "a number", dict: "an object",
             list: "a list"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


class UploadsOnlyBlocks(gr.Blocks):
    """gr.Blocks whose events refuse files that were not uploaded to this app, before Gradio moves,
    downloads or reads any of them (Blocks.validate_inputs runs first in preprocess_data), file inputs
    that hold no files, calls sent too few values, and values that their components cannot take."""

    def validate_inputs(self, block_fn, inputs):
        missing = block_fn.inputs[len(inputs):]
        if missing and all(block.stateful for block in missing):
            # Only its State inputs' values are missing, which Gradio fills from the session, as /call/<name> does.
            inputs.extend([None] * len(missing))
        try:
            super().validate_inputs(block_fn, inputs)
        except ValueError:  # too few values: Gradio's message (which echoes them) reached the client as {"error": null}
            log.warning("Event %s got %d values for its %d inputs", block_fn.name, len(inputs), len(block_fn.inputs))
            names = input_names(block_fn)
            raise refusal(MSG_TOO_FEW_VALUES.format(count=len(names), names=", ".join(names))) from None
        from gradio.utils import get_upload_folder

        uploaded_files_only(inputs, get_upload_folder())
        files_where_files_go(block_fn.inputs, inputs)

    async def preprocess_data(self, block_fn, inputs, state, explicit_call: bool = False):
        """A value that its input component cannot take (a word for a number, a string for a chat history) is
        refused with a message that names the input: Gradio's own error reached the client as {"error": null}.
        A component's own refusal (a choice not among a radio's) is logged as one line, not a traceback."""
        from gradio.exceptions import ComponentProcessingError, Error

        try:
            return await super().preprocess_data(block_fn, inputs, state, explicit_call)
        except ComponentProcessingError as error:
            raise refusal(str(error)) from None
        except ValidationError as error:  # a component's data model, checked before its preprocessing
            for index, block in enumerate(block_fn.inputs):
                if getattr(getattr(block, "data_model", None), "__name__", None) == error.title:
                    raise refusal(self._format_processing_error(block_fn, index, block, inputs[index], True, error)) from None
            raise
        except Error as error:
            if error.print_exception:
                raise refusal(error.message) from None
            raise

    @staticmethod
    def _format_processing_error(block_fn, index, block, value, is_input, original_error) -> str:
        if not is_input:  # the app's own fault, kept as Gradio words it
            return gr.Blocks._format_processing_error(block_fn, index, block, value, is_input, original_error)
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:60] + "…"
        return MSG_NOT_TAKEN.format(value=shown, label=getattr(block, "label", None) or type(block).__name__)


def input_names(block_fn) -> list[str]:
    """The names a client sends an event's values by (its State inputs are Gradio's to fill): the components'
    labels, or for gr.api's events (app.ui.mcp_tools), whose inputs are labelled "1st", "2nd"..., the function's
    parameters."""
    from gradio.components.api_component import Api

    taken = [block for block in block_fn.inputs if not block.stateful]
    if taken and all(isinstance(block, Api) for block in taken):
        parameters = list(inspect.signature(block_fn.fn).parameters)
        if len(parameters) == len(taken):
            return parameters
    return [block.label or type(block).__name__ for block in taken]
