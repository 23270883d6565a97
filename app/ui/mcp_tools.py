"""The model as MCP tools (python app.py --mcp): describe_image, ask_about_images and ask_about_video.

Gradio's own MCP server (launch(mcp_server=True), the gradio[mcp] extra) serves them at /gradio_api/mcp/
(streamable HTTP) and /gradio_api/mcp/sse (SSE), making a tool of each public API endpoint from its
function's type hints and docstring. For a file component's input it would take an http(s) URL and have
the server download it, so these tools take their files as plain strings instead (app.ui.inline_files:
base64 or the path of an upload, never a link), and Gradio's server is kept to them (serve_mcp_tools):
/ask, whose files are components, stays gradio_client's.

The tools are endpoints outside Gradio's queue (queue=False): Gradio's MCP server then calls them in this
process with the MCP request, where a queued one would go through a gradio_client of its own over HTTP,
which cannot log in; the engine's line is the only one, as for every event (app.ui.layout). A tool answers
as the chat does, through manager.stream with the server's default settings, and returns the answer's
text. Its files, their checks and the reply are handled in a thread of Gradio's pool; a call cancelled
(its client gone, or MCP's notifications/cancelled over SSE) sets the reply's StopSignal, which takes the
request out of the batch.
"""

import contextlib
import logging
import warnings
from contextlib import closing

import anyio
import gradio as gr

from app import limits
from app.chat import reply_text, strip_reasoning, user_content
from app.engine.stop_signal import StopSignal
from app.errors import UserError
from app.media.files import media_kind, shown_name
from app.media.images import check_image
from app.media.video import probe_video
from app.messages import MSG_EMPTY_QUESTION, MSG_INLINE_NO_IMAGES, MSG_INLINE_WRONG_KIND, MSG_TOO_MANY_IMAGES
from app.ui.inline_files import InlineFiles
from app.ui.refusals import log_refusal
from app.zerogpu import on_zero_gpu, zero_gpu_enabled

log = logging.getLogger(__name__)

TOOLS = ("describe_image", "ask_about_images", "ask_about_video")
DEFAULT_QUESTION = "Describe this image in detail."
# What each tool takes, and the tool to use for the other kind of file.
_WANTED = {"describe_image": ("image", "ask_about_video"), "ask_about_images": ("image", "ask_about_video"),
           "ask_about_video": ("video", "describe_image or ask_about_images")}
_ONE = {"image": "an image", "video": "a video"}


class ToolRefusal(gr.Error):
    """A refusal as a tool's error, whose text is the message itself (gr.Error's str() is its repr)."""

    def __str__(self) -> str:
        return self.message


def tool_refusal(message: str) -> ToolRefusal:
    """The tool's error to raise for `message`, logged as one line (as app.ui.refusals does for the UI)."""
    log_refusal(message)
    return ToolRefusal(message, print_exception=False)


class McpTools:
    """The tools, answering through `manager`; decoded files go into `janitor`'s upload folder (app.web.uploads)."""

    def __init__(self, manager, blocks: gr.Blocks, janitor):
        self.manager = manager
        self.blocks = blocks
        self.janitor = janitor
        self._streamed_reply = on_zero_gpu(self._reply)  # as the UI's handlers run there

    async def describe_image(self, image: str, question: str = DEFAULT_QUESTION) -> str:
        """Ask MiniCPM-V about one image.

        Args:
            image: The image (JPEG, PNG, WebP, GIF, BMP or TIFF): its bytes in base64, bare or as a data: URL (data:image/png;base64,...), or the path POST /gradio_api/upload returned for it. Never a link.
            question: What to ask about the image; by default, a detailed description.
        Returns:
            The model's answer, as text.
        """
        return await self._answer("describe_image", [(image, "image")], question)

    async def ask_about_images(self, images: list[str], question: str) -> str:
        """Ask MiniCPM-V about several images together.

        Args:
            images: The images, in the order the model sees them, each as describe_image takes its image: base64 (bare or a data: URL) or the path of an upload. Never links.
            question: What to ask about the images, e.g. what changed between them.
        Returns:
            The model's answer, as text.
        """
        if not isinstance(images, list) or not images:
            raise tool_refusal(MSG_INLINE_NO_IMAGES)
        if len(images) > limits.MAX_IMAGES_PER_REQUEST:  # refused before any of them is decoded
            raise tool_refusal(MSG_TOO_MANY_IMAGES.format(count=len(images), limit=limits.MAX_IMAGES_PER_REQUEST))
        named = [(image, f"image {number}") for number, image in enumerate(images, 1)]
        return await self._answer("ask_about_images", named, question)

    async def ask_about_video(self, video: str, question: str) -> str:
        """Ask MiniCPM-V about a video.

        Args:
            video: The video (mp4, webm, mov, avi or mkv): its bytes in base64, bare or as a data: URL (data:video/mp4;base64,...), or the path POST /gradio_api/upload returned for it. Never a link.
            question: What to ask about the video.
        Returns:
            The model's answer, as text.
        """
        return await self._answer("ask_about_video", [(video, "video")], question)

    async def _answer(self, tool: str, files: list[tuple], question: str) -> str:
        """The answer to `question` about `files` ((argument, name) pairs), or the tool's error for bad input."""
        stop = None if zero_gpu_enabled() else StopSignal()  # ZeroGPU's handlers take none (app.ui.cancellable)
        try:
            return await anyio.to_thread.run_sync(self._answer_in_thread, tool, files, question, stop,
                                                  abandon_on_cancel=True, limiter=self.blocks.limiter)
        except UserError as error:
            raise tool_refusal(str(error)) from None
        finally:
            if stop is not None:
                stop.set()

    def _answer_in_thread(self, tool: str, files: list[tuple], question: str, stop: StopSignal | None) -> str:
        if not isinstance(question, str) or not question.strip():
            raise UserError(MSG_EMPTY_QUESTION)
        inline = InlineFiles(self.janitor.folder)
        try:
            paths = [self._checked(tool, inline.path_of(value, name)) for value, name in files]
            if inline.decoded_folders:
                self.janitor.uploaded()  # the folder's size cap, checked at once
            return self._streamed_reply([{"role": "user", "content": user_content(question, paths)}], stop)
        finally:
            inline.remove()

    @staticmethod
    def _checked(tool: str, path: str) -> str:
        """`path`, once it is the kind of file `tool` takes and its header passes (as the UI checks a file)."""
        wanted, other = _WANTED[tool]
        found = media_kind(path)
        if found != wanted:
            raise UserError(MSG_INLINE_WRONG_KIND.format(name=shown_name(path), found=_ONE[found], tool=tool,
                                                         wanted=f"{wanted}s", other=other))
        if found == "image":
            check_image(path)
        else:
            probe_video(path)
        return path

    def _reply(self, messages: list[dict], stop: StopSignal | None = None) -> str:
        update = None
        with closing(self.manager.stream(messages, self.manager.default_settings(), stop)) as updates:
            for update in updates:
                pass
        if update is None:  # stopped before it began
            return ""
        answer = strip_reasoning(reply_text(update.text, update.opens_thinking))
        return "\n\n".join([answer, *(f"Note: {notice}" for notice in update.notices)])


def tool_descriptions(defaults) -> dict[str, str]:
    """Each tool's description, for MCP clients and the API page, with this server's limits and defaults."""
    files = ("Files go as base64, bare or as a data: URL (an MCP request holds at most 4 MiB: about 3 MB of file), "
             f"or as the path that POST /gradio_api/upload returned for a file uploaded to this app (up to "
             f"{limits.MAX_UPLOAD_MB:,} MB). Links are refused: this server fetches nothing.")
    frames = "1 frame" if defaults.video_fps == 1 else f"{defaults.video_fps:g} frames"
    return {
        "describe_image": "Ask MiniCPM-V, a vision-language model, about one image and get its answer as text; without "
                          f"a question it describes the image in detail. {files}",
        "ask_about_images": f"Ask MiniCPM-V about up to {limits.MAX_IMAGES_PER_REQUEST} images together, in the order "
                            f"given (compare them, say what changed), and get its answer as text. {files}",
        "ask_about_video": f"Ask MiniCPM-V about one video, up to {limits.MAX_VIDEO_SECONDS:,} s long, and get its answer "
                           f"as text: it sees {frames} a second, at most {defaults.video_max_frames} "
                           f"spread over the whole video. {files}",
    }


def serve_mcp_tools(demo: gr.Blocks, manager, janitor) -> dict:
    """Add the tools to `demo` as API endpoints; returns the app_kwargs of launch that keep Gradio's MCP
    server to them."""
    tools = McpTools(manager, demo, janitor)
    # Gradio warns, as it makes its tools, that /ask's gr.State input is not kept between calls; /ask is no
    # tool here (only_these_tools).
    warnings.filterwarnings("ignore", message="This MCP server includes a tool that has a gr.State input")
    descriptions = tool_descriptions(manager.default_settings())
    with demo:
        for name in TOOLS:
            gr.api(getattr(tools, name), api_name=name, api_description=descriptions[name], queue=False)

    @contextlib.asynccontextmanager
    async def only_these_tools(app):
        """At the server's start, before its first request: Gradio's MCP server made a tool of every public
        endpoint, /ask included."""
        server = demo.mcp_server_obj
        if server is None:
            log.error("The MCP server did not start: %s", demo.mcp_error)
        else:
            server.tool_to_endpoint = {tool: endpoint for tool, endpoint in server.tool_to_endpoint.items()
                                       if endpoint.lstrip("/") in TOOLS}
        yield

    return {"lifespan": only_these_tools}


def mcp_addresses(url: str) -> str:
    """Where MCP clients connect, for the start-up line."""
    base = url.rstrip("/")
    return f"{base}/gradio_api/mcp/ (streamable HTTP), {base}/gradio_api/mcp/sse (SSE)"

