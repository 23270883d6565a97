"""Builds random-weight MiniCPM-V 4.6 (and 4.7) checkpoints offline, complete enough to load like a real one.

`ensure_tiny_checkpoint` makes the tiny one behind `--model tiny-random` (tests, trying the UI);
`build_random_checkpoint` takes any config, such as the real 4.6 shape for benchmarks.
Each has what a real checkpoint has: a byte-level BPE tokenizer with the real tokenizer's added tokens
and roles, a chat template that renders what the real 4.6 one does (chat_template.jinja), a config of the real
architecture (SigLIP-style vision tower with the window merger, Qwen3.5 text with one linear-attention
and one full-attention layer), image and video processors at their real defaults, and a
generation_config. It is saved to disk and loaded back through the ordinary `from_pretrained` path.
"""

import os
import shutil
import tempfile
from pathlib import Path

# Bump when what the builder writes changes, so that stale checkpoints (the tiny one, the benchmarks') are rebuilt
# rather than reused.
RANDOM_CHECKPOINT_VERSION = "v7"

PROCESSOR_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "image_start_token": "<image>",
    "image_end_token": "</image>",
    "slice_start_token": "<slice>",
    "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>",
    "image_id_end_token": "</image_id>",
}
# The real tokenizer's added tokens, in its order (ids 248044-248093 there and in a vocabulary of the real size,
# just above the trained one in the tiny checkpoint's). As in Qwen3's, the tool and thinking tags and the
# fill-in-the-middle ones are not special: decoding with skip_special_tokens keeps them.
ADDED_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
    "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>",
    "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>", "<unk>", "<image>",
    "</image>", "<ref>", "</ref>", "<box>", "</box>", "<quad>", "</quad>", "<point>", "</point>", "<slice>",
    "</slice>", "<image_id>", "</image_id>", "<timestamp>", "</timestamp>",
]
NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
               "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
# Written by the builder as the checkpoint's chat_template.jinja.
CHAT_TEMPLATE_FILE = Path(__file__).with_name("chat_template.jinja")

_TRAINING_TEXT = [
    "The picture shows a red square and a blue circle on a white background.",
    "What is in this image? Describe the scene, the colours and the objects in detail.",
    "A small cat sits on a wooden table next to a cup of coffee in the morning light.",
    "The video shows a ball moving from the left side of the frame to the right.",
    "Compare the two images and tell me what changed between them.",
    "There are three people walking along a beach at sunset, and the sky is orange.",
    "The chart has numbers, labels and a title; the text reads: total sales by month.",
    # The chat template's role names and blank lines, a token each as in the real tokenizer (docs/DECISIONS.md D59).
    "system\nuser\nassistant\n\n",
]


def _build_tokenizer(vocab_size: int | None = None):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=1000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(_TRAINING_TEXT * 4, trainer)
    if vocab_size is not None and vocab_size > bpe.get_vocab_size() + len(ADDED_TOKENS):
        bpe = _filled(bpe, vocab_size - len(ADDED_TOKENS))
    bpe.decoder = decoders.ByteLevel()
    bpe.add_tokens([AddedToken(token, normalized=False, special=token not in NOT_SPECIAL) for token in ADDED_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        extra_special_tokens=PROCESSOR_TOKENS,
    )


def _filled(bpe, size: int):
    """The trained BPE with its vocabulary filled to `size` words, so that every id a large model can generate
    decodes to something, and the added tokens come after them, as the real tokenizer's do. The fillers are
    short lowercase words, which no merge reaches: a word found whole in the vocabulary is taken whole, so that
    a reply's text tokenizes again to about as many tokens as were generated, as a real model's does. As added
    tokens instead, 248,000 of them took transformers 7.5 s to load in each process (docs/DECISIONS.md D66)."""
    import itertools
    import json
    import string

    from tokenizers import Tokenizer, models

    trained = json.loads(bpe.to_str())["model"]
    vocab = dict(trained["vocab"])
    words = ("\u0120" + "".join(letters)
             for length in (3, 4, 5) for letters in itertools.product(string.ascii_lowercase, repeat=length))
    for word in words:
        if len(vocab) == size:
            break
        vocab.setdefault(word, len(vocab))
    merges = [tuple(merge) for merge in trained["merges"]]
    filled = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    filled.pre_tokenizer = bpe.pre_tokenizer
    return filled


TINY_TEXT_CONFIG = {
    "model_type": "qwen3_5_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    # Output sizes of every linear layer are multiples of 64, as GPT-QModel's CPU kernels and AWQ need.
    "head_dim": 64,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_conv_kernel_dim": 4,
    "attn_output_gate": True,
    "max_position_embeddings": 65536,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": True,
    # Larger than the usual 0.02 so that greedy replies depend on the prompt and image (at 0.02 a
    # random model repeats one token whatever it is shown), which isolation tests need.
    "initializer_range": 0.3,
}
# patch_size 14 must match the processor; 980 px gives the real 70x70 position table.
TINY_VISION_CONFIG = {
    "model_type": "minicpmv4_6_vision",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "patch_size": 14,
    "image_size": 980,
}
TINY_CONFIG = {"text_config": TINY_TEXT_CONFIG, "vision_config": TINY_VISION_CONFIG, "insert_layer_id": 1,
               "image_size": 1120, "tie_word_embeddings": True}
# MiniCPM-V 4.7: the same text model, positions laid out on each image's canvas (M-RoPE), 16-px patches.
# Rotary over the whole head at a low base, so that a wrong position changes the greedy reply of this
# tiny model (at the real base the few rotated dimensions barely notice).
TINY_CONFIG_4_7 = {"model_type": "minicpmv4_7",
                   "text_config": {**TINY_TEXT_CONFIG, "rope_parameters": {
                       "rope_type": "default", "rope_theta": 100, "partial_rotary_factor": 1.0,
                       "mrope_section": [11, 11, 10]}},
                   "vision_config": {**TINY_VISION_CONFIG, "model_type": "minicpmv4_7_vision", "patch_size": 16,
                                     "image_size": 1120},
                   "insert_layer_id": 1, "tie_word_embeddings": True}


def build_random_checkpoint(folder: str, config: dict, dtype=None, device: str | None = None) -> None:
    """Save a random-weight checkpoint with this config (a config.json's contents) and a matching processor.

    The vocabulary grows to the config's `vocab_size` (or the config takes the tokenizer's size if it has
    none), and the image/video token ids are the tokenizer's.
    """
    import torch
    import transformers
    from transformers import GenerationConfig
    from transformers.models.minicpmv4_6 import MiniCPMV4_6ImageProcessor, MiniCPMV4_6VideoProcessor

    version = "4_7" if config.get("model_type") == "minicpmv4_7" else "4_6"
    text_config = dict(config["text_config"])
    tokenizer = _build_tokenizer(text_config.get("vocab_size"))
    text_config["vocab_size"] = len(tokenizer)
    # 4.7 reuses 4.6's image and video processors; the patch size follows the vision tower's.
    patch_size = config["vision_config"].get("patch_size", 14)
    processor = getattr(transformers, f"MiniCPMV{version}Processor")(
        image_processor=MiniCPMV4_6ImageProcessor(patch_size=patch_size),
        video_processor=MiniCPMV4_6VideoProcessor(patch_size=patch_size),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE_FILE.read_text(encoding="utf-8"),
    )
    settings = {key: value for key, value in config.items()
                if key not in ("text_config", "architectures", "model_type", "transformers_version")}
    settings.update(text_config=text_config, image_token_id=tokenizer.image_token_id,
                    video_token_id=tokenizer.video_token_id)
    if version == "4_7":  # the markers its canvas positions are anchored on
        settings.update({f"{name}_id": tokenizer.convert_tokens_to_ids(PROCESSOR_TOKENS[f"{name}_token"])
                         for name in ("image_start", "image_end", "slice_start", "slice_end")},
                        newline_id=tokenizer.convert_tokens_to_ids(tokenizer.tokenize("\n"))[0])
    model_config = getattr(transformers, f"MiniCPMV{version}Config")(**settings)
    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        model = getattr(transformers, f"MiniCPMV{version}ForConditionalGeneration")._from_config(model_config, dtype=dtype)
    end_ids = [tokenizer.convert_tokens_to_ids(token) for token in ("<|im_end|>", "<|endoftext|>")]
    # Zero output rows make the end tokens' logits 0 among many random ones, so replies rarely end
    # early and run to max_new_tokens, as long answers do (tests of streaming and Stop need them).
    with torch.no_grad():
        model.get_output_embeddings().weight[end_ids] = 0
    model.generation_config = GenerationConfig(
        eos_token_id=end_ids, pad_token_id=end_ids[1], do_sample=True, temperature=0.7, top_p=1.0, top_k=0
    )
    model.save_pretrained(folder)
    processor.save_pretrained(folder)


def default_cache_dir() -> str:
    return os.environ.get("MINICPMV_DEMO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "minicpmv-demo")


def ensure_tiny_checkpoint(cache_dir: str | None = None) -> str:
    """Path of the tiny checkpoint, building it on first use. Safe when several processes race to build."""
    cache_dir = cache_dir or default_cache_dir()
    folder = os.path.join(cache_dir, f"tiny-random-minicpmv4_6-{RANDOM_CHECKPOINT_VERSION}")
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    os.makedirs(cache_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".building-", dir=cache_dir)
    try:
        build_random_checkpoint(staging, TINY_CONFIG)
        try:
            os.rename(staging, folder)
        except OSError:
            if not os.path.exists(os.path.join(folder, "config.json")):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
