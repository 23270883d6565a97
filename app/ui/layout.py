"""The Blocks layout: components and event wiring only; the work is done by app.ui.handlers."""

import os
from types import SimpleNamespace

import gradio as gr

from app import limits, tuning
from app.messages import MSG_MULTI_IMAGE_HINT, MSG_VIDEO_HINT
from app.chat import THINK_CLOSE, THINK_OPEN
from app.config import handler_slots
from app.media.files import BROWSER_COPY_SUFFIX
from app.ui.cancellable import StopControl
from app.ui.event_inputs import UploadsOnlyBlocks
from app.ui.handlers import SETTING_KEYS, Handlers, model_header, settings_dict
from app.ui.panels import (CLOSED_SETTINGS_INERT, LABEL_SETTINGS_TOGGLE, OPEN_SERVER_LOAD_FROM_LINK, below_the_tabs,
                            reply_controls, settings_sidebar)
from app.ui.previews import Previews, ShownVideo
from app.ui.replying import (MODEL_EVENTS, OPENED_STATS_INTO_VIEW, streaming, wire_answer, wire_clear,
                             wire_question, wire_stop)

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "assets")
EXAMPLES = os.path.join(ASSETS, "examples")
CSS_PATH = os.path.join(ASSETS, "style.css")
SLICING_KEYS = ("max_slice_nums", "downsample_mode", "visual_token_budget")  # the settings an image's cut depends on


def _video_controls(defaults) -> dict:
    with gr.Row():
        return {
            "video_fps": gr.Slider(0.1, limits.MAX_VIDEO_FPS, value=defaults.video_fps, step=0.1, label="Frames per second"),
            "video_max_frames": gr.Slider(1, limits.MAX_VIDEO_FRAMES, value=defaults.video_max_frames, step=1, label="Max frames"),
            "video_slices_per_frame": gr.Slider(1, limits.MAX_VIDEO_SLICES_PER_FRAME, value=defaults.video_slices_per_frame, step=1,
                                                label="Slices per frame"),
        }


def _chatbot(label: str, placeholder: str, elem_id: str, examples: list[tuple[str, list[str]]]) -> gr.Chatbot:
    """A chat that fills the height it is given (assets/style.css), with `examples` (text, files) to click
    while it is empty."""
    return gr.Chatbot(label=label, height=None, placeholder=placeholder, reasoning_tags=[(THINK_OPEN, THINK_CLOSE)],
                      buttons=["copy", "copy_all"], feedback_options=None, elem_id=elem_id, elem_classes="chat",
                      examples=[{"text": text, "files": [os.path.join(EXAMPLES, name) for name in files]}
                                for text, files in examples])


def _fill_from_examples(chat: gr.Chatbot, outputs: list, fill):
    """A click on one of `chat`'s examples puts it into `outputs`: `fill(text, paths)` gives their values.
    Returns the event (a gallery filled by it fires no change of its own: its previews follow with .then).
    Only the example's index is taken from the page, never a path: the paths are the examples' own
    copies in Gradio's cache (made when the chat was built)."""
    skipped = gr.skip() if len(outputs) == 1 else tuple(gr.skip() for _ in outputs)

    def chosen(event: gr.SelectData):
        if not (isinstance(event.index, int) and 0 <= event.index < len(chat.examples)):
            return skipped
        example = chat.examples[event.index]
        return fill(example["text"], [file["path"] for file in example["files"]])

    return chat.example_select(chosen, None, outputs, api_visibility="private", queue=False)


def build_demo(manager) -> gr.Blocks:
    """The whole page: the header, the tabs and the reply controls under them filling the window, the
    panels below; then each tab's events."""
    handlers, previews = Handlers(manager), Previews(manager)
    defaults, info = manager.default_settings(), manager.info()
    # Every generating request reaches the engine at once (its batch and wait line, and far more beyond:
    # handler_slots), so that the engine's line is the only one: it orders them, reports their places,
    # and answers "busy" at once past its end.
    concurrency = handler_slots(manager.config)

    with UploadsOnlyBlocks(title="MiniCPM-V demo") as demo:
        sidebar = settings_sidebar(defaults)
        with gr.Column(elem_id="workspace"):
            header = gr.Markdown(model_header(info), elem_id="model-header")
            with gr.Tabs(elem_id="tabs"):
                chat = _chat_tab()
                multi = _multi_image_tab()
                video = _video_tab(defaults)
            replies = reply_controls(defaults, info.thinking_by_default)
        below_the_tabs(manager, handlers, header, replies["enable_thinking"])
        api = _api_components()
        settings = [{**sidebar, **replies, **video.settings}[key] for key in SETTING_KEYS]
        wiring = SimpleNamespace(blocks=demo, handlers=handlers, previews=previews, settings=settings,
                                 concurrency=concurrency, slicing=[sidebar[key] for key in SLICING_KEYS],
                                 previewing={"concurrency_id": "image-previews", "concurrency_limit": tuning.PREVIEWS_AT_ONCE})
        _wire_chat(wiring, chat)
        _wire_multi_image(wiring, multi)
        _wire_video(wiring, video)
        demo.load(lambda: model_header(manager.info()), None, [header], api_visibility="private")
        demo.load(None, js=LABEL_SETTINGS_TOGGLE, api_visibility="private")
        demo.load(None, js=OPEN_SERVER_LOAD_FROM_LINK, api_visibility="private")
        demo.load(None, js=CLOSED_SETTINGS_INERT, api_visibility="private")
        demo.load(None, js=OPENED_STATS_INTO_VIEW, api_visibility="private")
        _wire_api(wiring, api)
    return demo


def _chat_tab() -> SimpleNamespace:
    with gr.Tab("Chat", id="chat", elem_classes="chat-tab"):
        chat = _chatbot("Chat", "Ask anything, or attach photos: upload or paste them into the box, or take one with "
                        "the Camera.", "chat", [("What is in this picture?", ["shapes.jpg"]),
                                                ("Read the text in this image.", ["sign.jpg"])])
        with gr.Column(scale=0, elem_id="chat-attachments"):  # shares the height with the chat (assets/style.css)
            pictures, costs = _image_previews("chat")
        with gr.Accordion("Camera", open=False, elem_id="camera"):
            camera = gr.Image(sources=["webcam", "clipboard"], type="filepath", label="Photo for the next message")
        box = gr.MultimodalTextbox(
            file_count="multiple", file_types=list(limits.IMAGE_EXTENSIONS), sources=["upload"],
            placeholder="Message MiniCPM-V… (attach or paste images)", autofocus=True,
            show_label=False, elem_id="chat-input",
        )
        attached = gr.Textbox(visible="hidden")  # what the previews show (ATTACHMENTS_KEY)
    _fill_from_examples(chat, [box], lambda text, paths: {"text": text, "files": paths})
    return SimpleNamespace(chat=chat, box=box, camera=camera, pictures=pictures, costs=costs, attached=attached)


def _image_previews(tab: str, hint: str | None = None) -> tuple[gr.Gallery, gr.Markdown]:
    """Each image as the model will see it (its source view and slices), and what the images cost (or `hint`)."""
    pictures = gr.Gallery(label="What the model will see", visible=False, columns=3, height="auto", object_fit="contain",
                          interactive=False, buttons=["fullscreen"], elem_id=f"{tab}-previews", elem_classes="seen-by-model")
    return pictures, gr.Markdown(hint, visible=hint is not None, elem_id=f"{tab}-costs")


def _multi_image_tab() -> SimpleNamespace:
    """The images and their previews beside the conversation (above it on a phone)."""
    with gr.Tab("Multi-image", id="multi"), gr.Row(elem_classes="media-and-chat"):
        with gr.Column(elem_classes="media-pane"):
            gallery = gr.Gallery(type="filepath", interactive=True, file_types=list(limits.IMAGE_EXTENSIONS),
                                 columns=4, height=220, object_fit="contain",
                                 label="Images, in the order the model sees them", buttons=["download", "fullscreen"],
                                 elem_id="multi-gallery")  # no Share (style.css)
            selected = gr.State(None)
            with gr.Row(elem_classes="gallery-moves"):
                earlier = gr.Button("◀ Move earlier", size="sm")
                later = gr.Button("Move later ▶", size="sm")
                remove = gr.Button("✕ Remove", size="sm")
            pictures, costs = _image_previews("multi", MSG_MULTI_IMAGE_HINT)
        with gr.Column(elem_classes="chat-pane"):
            chat = _chatbot("Conversation about these images", "Compare them, find the differences, ask what changed.",
                            "multi-chat", [("What changed between the two images?", ["shapes.jpg", "shapes-moved.jpg"])])
            box = gr.Textbox(placeholder="Ask about all the images together…", submit_btn=True,
                             show_label=False, elem_id="multi-input")
    filled = _fill_from_examples(chat, [gallery, box], lambda text, paths: (paths, text))
    return SimpleNamespace(gallery=gallery, selected=selected, earlier=earlier, later=later, remove=remove,
                           pictures=pictures, costs=costs, chat=chat, box=box, filled=filled)


def _video_tab(defaults) -> SimpleNamespace:
    """The video, its sampling and frames beside the conversation (above it on a phone)."""
    with gr.Tab("Video", id="video"), gr.Row(elem_classes="media-and-chat"):
        with gr.Column(elem_classes="media-pane"):
            video = gr.Video(sources=["upload"], label="Video", height=280, elem_id="video-player")
            note = gr.Markdown(visible=False, elem_id="video-player-note")
            settings = _video_controls(defaults)
            info = gr.Markdown(MSG_VIDEO_HINT, elem_id="video-sampling")
            shown = gr.State(ShownVideo())
            frames = gr.Gallery(label="The frames the model will see", visible=False, columns=8, height="auto",
                                object_fit="contain", interactive=False, buttons=["fullscreen"], elem_id="video-frames",
                                elem_classes="seen-by-model")
        with gr.Column(elem_classes="chat-pane"):
            chat = _chatbot("Conversation about the video", "Ask what happens in the video.", "video-chat",
                            [("Describe what happens in this video.", ["ball.webm"])])
            box = gr.Textbox(placeholder="Ask about the video…", submit_btn=True,
                             show_label=False, elem_id="video-input")
    _fill_from_examples(chat, [video, box], lambda text, paths: (paths[0], text))
    return SimpleNamespace(video=video, note=note, settings=settings, info=info, frames=frames, chat=chat, box=box,
                           shown=shown)


def _api_components() -> SimpleNamespace:
    """/ask's inputs and outputs: hidden components, since an API event needs components."""
    with gr.Row(visible=False):
        text = gr.Textbox(label="text")
        files = gr.File(file_count="multiple", type="filepath", label="files")
        settings = gr.JSON(label="settings")
        reply = gr.Textbox(label="reply_text")
        stats = gr.JSON(label="stats")
        button = gr.Button()
    conversation = gr.State([])
    return SimpleNamespace(text=text, files=files, settings=settings, reply=reply, stats=stats, button=button,
                           conversation=conversation)


# What the Chat tab's previews show, as one string made in the page: the attachments and the slicing settings.
ATTACHMENTS_KEY = ("(message, camera, ...slicing) => "
                   "JSON.stringify([(message?.files ?? []).map(file => file.path), camera?.path ?? null, slicing])")


def _wire_conversation(wiring: SimpleNamespace, chat: gr.Chatbot, box, add_question, question_inputs: list,
                       question_outputs: list, undo, new_conversation: tuple = ()) -> None:
    """A tab's question, its reply, and the chat's Stop, Retry, Undo (`undo` gives the chat and the box) and
    Clear, which the events in `new_conversation` (their listeners) do too (wire_clear)."""
    control = StopControl()
    asked = wire_question(wiring, box, add_question, question_inputs, question_outputs, control)
    retried = chat.retry(wiring.handlers.retry, [chat], [chat], api_visibility="undocumented")
    answers = [asked, wire_answer(wiring, retried, chat, box, control)]
    wire_stop(box, chat, control, answers)
    chat.undo(undo, [chat], [chat, box], api_visibility="undocumented")
    wire_clear(box, chat, control, answers, also=new_conversation)


def _wire_chat(wiring: SimpleNamespace, tab: SimpleNamespace) -> None:
    handlers, chat = wiring.handlers, tab.chat
    _wire_conversation(wiring, chat, tab.box, handlers.add_chat_message, [tab.box, tab.camera, chat],
                       [chat, tab.box, tab.camera], handlers.undo)

    def chat_images(message, camera, history, *values):
        return wiring.previews.chat_images(message, camera, history, settings_dict(values))

    # The box changes at every key typed: the page itself tells when what the previews show has changed.
    for trigger in (tab.box, tab.camera, *wiring.slicing):
        trigger.change(None, [tab.box, tab.camera, *wiring.slicing], [tab.attached], js=ATTACHMENTS_KEY)
    tab.attached.change(chat_images, [tab.box, tab.camera, chat, *wiring.settings], [tab.pictures, tab.costs],
                        api_visibility="private", show_progress="hidden", **wiring.previewing)


def _gallery_at(paths: list[str], index: int | None):
    """The gallery holding `paths` with image `index` highlighted and previewed, and the index kept: the
    page's own highlight stays on its slot, which after a move holds another image."""
    return gr.Gallery(value=paths, selected_index=index), index


def _wire_multi_image(wiring: SimpleNamespace, tab: SimpleNamespace) -> None:
    """A changed set of images starts a new conversation."""
    handlers = wiring.handlers
    cost_inputs = [tab.gallery, *wiring.settings]

    def gallery_images(gallery, *values):
        return wiring.previews.gallery_images(gallery, settings_dict(values))

    for trigger in (tab.gallery, *wiring.slicing):
        trigger.change(gallery_images, cost_inputs, [tab.pictures, tab.costs], api_visibility="undocumented",
                       **wiring.previewing)
    tab.filled.then(gallery_images, cost_inputs, [tab.pictures, tab.costs], api_visibility="undocumented",
                    **wiring.previewing)
    # The x on a thumbnail (the gallery's own) removes an image as the Remove button does.
    tab.gallery.delete(lambda: None, None, [tab.selected], api_visibility="undocumented")
    tab.gallery.select(Handlers.selected_index, None, [tab.selected], api_visibility="undocumented")
    changed = [tab.gallery.upload, tab.gallery.delete]  # each starts a new conversation
    for button, offset in ((tab.earlier, -1), (tab.later, 1)):
        changed.append(button.click(lambda g, i, o=offset: _gallery_at(*Handlers.move_image(g, i, o)),
                                    [tab.gallery, tab.selected], [tab.gallery, tab.selected],
                                    api_visibility="undocumented").then)
    changed.append(tab.remove.click(lambda g, i: _gallery_at(*Handlers.remove_image(g, i)), [tab.gallery, tab.selected],
                                    [tab.gallery, tab.selected], api_visibility="undocumented").then)
    _wire_conversation(wiring, tab.chat, tab.box, handlers.add_multi_image_question, [tab.box, tab.gallery, tab.chat],
                       [tab.chat, tab.box], handlers.undo_question, new_conversation=tuple(changed))


# Gradio's player says "Video not playable" of a video the browser cannot play; once its copy is in the player,
# that message is about a file no longer shown.
DISMISS_UNPLAYABLE_ERROR = f"""(video) => {{
    if (!video?.path?.endsWith({BROWSER_COPY_SUFFIX!r})) return;
    for (const toast of document.querySelectorAll("[data-testid=toast-body]"))
        if (toast.textContent.includes("Video not playable")) toast.querySelector("[data-testid=toast-close]")?.click();
}}"""


def _wire_video(wiring: SimpleNamespace, tab: SimpleNamespace) -> None:
    """A new video starts a new conversation and shows the frames the model will see; one the browser cannot
    play is then replaced in the player by a copy it can (the model still reads the original: app.chat)."""
    handlers, previews = wiring.handlers, wiring.previews
    sampling = [tab.video, tab.settings["video_fps"], tab.settings["video_max_frames"]]
    # A group of its own: a video's browser copy takes seconds, and the images' previews need not wait for it.
    previewing = {"concurrency_id": "video-previews", "concurrency_limit": tuning.PREVIEWS_AT_ONCE}
    # First, and not queued: a copy made meanwhile for the video this one replaces must see it at once.
    tab.video.change(previews.video_put, [tab.video, tab.shown], None, queue=False, api_visibility="private")
    tab.video.change(previews.video_chosen, [*sampling, tab.shown], [tab.info, tab.frames, tab.chat, tab.note, tab.video],
                     api_visibility="undocumented", trigger_mode="multiple", **previewing)
    tab.video.change(None, [tab.video], None, js=DISMISS_UNPLAYABLE_ERROR)
    for control in (tab.settings["video_fps"], tab.settings["video_max_frames"]):
        control.change(previews.video_frames, sampling, [tab.info, tab.frames], api_visibility="undocumented", **previewing)
    # A video put in or taken out by the user (not its browser copy arriving: a change) starts a new conversation.
    _wire_conversation(wiring, tab.chat, tab.box, handlers.add_video_question, [tab.box, tab.video, tab.chat],
                       [tab.chat, tab.box], handlers.undo_question, new_conversation=(tab.video.upload, tab.video.clear))


def _wire_api(wiring: SimpleNamespace, api: SimpleNamespace) -> None:
    """The scripting API: gradio_client.Client(url).submit(text, files, settings, api_name="/ask")."""
    api.button.click(streaming(wiring.handlers.ask, wiring.blocks), [api.text, api.files, api.settings, api.conversation],
                     [api.reply, api.stats, api.conversation], api_name="ask", concurrency_id=MODEL_EVENTS,
                     concurrency_limit=wiring.concurrency,
                     api_description="Ask about images or one video; streams (reply_text, stats).")
