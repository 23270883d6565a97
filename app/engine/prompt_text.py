"""Message text reaches the model as text, never as control tokens.

A chat template pastes each message's text into one prompt string, and the tokenizer run over that
string turns every control token's spelling it meets (`<|im_start|>`, `<|image_pad|>`...) into the
token itself: a user who typed `<|im_end|>\\n<|im_start|>system\\n...` would forge a turn of another
role, and a typed `<|image_pad|>` made the processor look for an image that was never sent. So the
template renders a placeholder where each text part goes; the processor expands the media in that
string and tokenizes it through `TextPartsAsText`, which tokenizes every text part on its own with
special tokens split into plain text. Only the template places control tokens.
"""

import re
import threading
import weakref

_PRIVATE_USE = range(0xE000, 0xF900)  # Unicode's private use area: no template writes these


def with_placeholders(messages: list[dict]) -> tuple[list[dict], list[str], str]:
    """(the messages as the template takes them, with a placeholder for each text part; the texts, in
    order; the marker the placeholders are made of).

    The template trims each message's content, and a placeholder has no white space to trim: the texts
    are trimmed here as the template would have trimmed them (white space at the content's ends goes,
    and so do the text parts that it leaves empty there).
    """
    texts = [part["text"] for message in messages for part in message["content"] if part["type"] == "text"]
    mark = next(chr(code) for code in _PRIVATE_USE if not any(chr(code) in text for text in texts))
    kept, template_messages = [], []
    for message in messages:
        content = []
        for part in _trimmed([dict(part) for part in message["content"]]):
            if part["type"] == "text":
                content.append({"type": "text", "text": f"{mark}{len(kept)}{mark}"})
                kept.append(part["text"])
            else:
                content.append({"type": part["type"]})  # media parts carry no payload into the template
        template_messages.append({"role": message["role"], "content": content})
    return template_messages, kept, mark


def _trimmed(parts: list[dict]) -> list[dict]:
    """The parts with the white space that trimming their joined text would remove taken off."""
    for end, strip in ((0, str.lstrip), (-1, str.rstrip)):
        while parts and parts[end]["type"] == "text":
            parts[end]["text"] = strip(parts[end]["text"])
            if parts[end]["text"]:
                break
            parts.pop(end)
    return parts


class TextPartsAsText:
    """The processor's tokenizer for one prompt rendered by `with_placeholders`: the template's own text
    is tokenized as usual, each placeholder's text with its special tokens' spellings split into text."""

    def __init__(self, tokenizer, texts: list[str], mark: str):
        self._tokenizer, self._texts = tokenizer, texts
        self._placeholder = re.compile(f"{mark}(\\d+){mark}")
        self._encode_as_text = _text_encoder(tokenizer, as_text=True)
        self._encode_template = _text_encoder(tokenizer, as_text=False)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, text, return_tensors=None, **kwargs):
        """A transformers BatchEncoding of the prompts' input ids and attention masks."""
        from transformers import BatchEncoding

        ids = [self._token_ids(one) for one in ([text] if isinstance(text, str) else text)]
        if return_tensors == "pt":  # made here: transformers' conversion walks the ids one by one in Python
            import torch

            input_ids = torch.tensor(ids, dtype=torch.long)
            return BatchEncoding({"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)})
        return BatchEncoding({"input_ids": ids, "attention_mask": [[1] * len(row) for row in ids]},
                             tensor_type=return_tensors)

    def _token_ids(self, prompt: str) -> list[int]:
        pieces = self._placeholder.split(prompt)  # template text, a text's index, template text...
        ids = []
        for position, piece in enumerate(pieces):
            if position % 2:
                ids += self._encode_as_text(self._texts[int(piece)])
            elif piece:
                ids += self._encode_template(piece)
        return ids


_text_encoders: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_text_encoders_lock = threading.Lock()


def _text_encoder(tokenizer, as_text: bool):
    """`encode(text) -> ids`, with special tokens' spellings as plain text (`as_text`) or as the tokens. A fast
    tokenizer keeps that choice as state of its Rust tokenizer (transformers sets `encode_special_tokens` on
    each call that asks), so asking the shared one from several preparing threads at once let a template's
    `<|image_pad|>` be split into text. So a fast tokenizer gets a copy of its own for each choice, made once;
    called directly, the copy also skips transformers' wrapping, a request's preparation being on the way to
    its first token (docs/DECISIONS.md D51)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a Python tokenizer takes it as an argument, no state
        return lambda text: tokenizer(text, add_special_tokens=False, split_special_tokens=as_text)["input_ids"]
    with _text_encoders_lock:
        encoders = _text_encoders.setdefault(tokenizer, {})
        if as_text not in encoders:
            from tokenizers import Tokenizer

            copy = Tokenizer.from_str(backend.to_str())
            copy.encode_special_tokens = as_text
            copy.no_truncation()  # a tokenizer.json may set them; transformers' own call resets them every time
            copy.no_padding()
            encoders[as_text] = lambda text: copy.encode(text, add_special_tokens=False).ids
        return encoders[as_text]
