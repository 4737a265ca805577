"""A byte-level BPE tokenizer trained offline on a few sentences (tiny-model builders).

The families' real tokenizers are large downloads; what vLLM and the processors need is
the family's *special tokens* (image placeholders, turn markers) as single tokens with
the right names, which a tiny tokenizer trained here provides. Deterministic.
"""

from __future__ import annotations

import os

CORPUS = [
    "What is shown in this image? A picture of a cat.",
    "Describe the image in detail. The quick brown fox jumps over the lazy dog.",
    "red green blue yellow square circle triangle color shape number one two three",
    "Here is the original image and here are some crops to help you see better",
    "You are a helpful assistant. Compare these pictures.\n\n",
] * 50


def train(specials: list[str], vocab_size: int = 400, *, style: str = "bytelevel",
          plain_tokens: list[str] = (), **named_tokens):
    """A ``PreTrainedTokenizerFast`` whose vocabulary starts with ``specials`` (in order).

    ``style``: ``"bytelevel"`` (GPT-2/Qwen-like byte-level BPE) or ``"metaspace"``
    (SentencePiece/Gemma-like: ``▁`` for spaces, characters such as ``"\n"`` appear
    literally in the vocabulary). ``plain_tokens`` are added as single, non-special tokens
    (Gemma's ``"\n\n"``...). ``named_tokens`` are passed to the tokenizer
    (``bos_token=...``, ``extra_special_tokens={...}``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=specials[0]))
    if style == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
        tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="never")
        alphabet = sorted({c for line in CORPUS for c in line} | set("\n.,?!:;'\"-0123456789"))
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=alphabet))
    if plain_tokens:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in plain_tokens])
    # The model's vocab_size is len(tokenizer) exactly: a padded vocabulary would let the
    # random model rank ids that have no token (vLLM's logprobs detokenizer fails on them).
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=specials[0], **named_tokens)


def hub_layout(out: str, tower: str = "vision_tower.", inner: str = "vision_model.") -> None:
    """Rename the saved tower weights to the hub layout real checkpoints use.

    transformers 5 saves the SigLIP/CLIP tower as ``vision_tower.<...>``; vLLM's loaders
    expect ``vision_tower.vision_model.<...>`` as on the hub."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(out, "model.safetensors")
    state = load_file(path)
    renamed = {}
    for key, value in state.items():
        if key.startswith(tower) and not key.startswith(tower + inner):
            key = tower + inner + key[len(tower):]
        renamed[key] = value
    save_file(renamed, path, metadata={"format": "pt"})


def text_width(hidden: int) -> tuple[int, int]:
    """``(heads, head_dim)`` of a tiny language model ``hidden`` wide (``--text-hidden``).

    The language model's hidden size is the width of every encoder output vLLM caches, so
    it sizes the entries: 2 heads of 32 for the default 64, heads of 128 for wider models
    (both supported by vLLM's CPU attention)."""
    head_dim = 32 if hidden <= 64 else 128
    if hidden % head_dim:
        raise ValueError(f"--text-hidden must be a multiple of {head_dim}")
    return hidden // head_dim, head_dim


def qwen2_text(tok, text_hidden: int, max_len: int, config_class=None, **fields):
    """The tiny Qwen2 language model, with Qwen's turn markers in ``tok`` as its BOS, EOS
    and padding: a ``Qwen2Config`` (InternVL, LLaVA-OneVision), or ``config_class`` with
    the family's own ``fields`` (the Qwen-VL text configs' M-RoPE)."""
    if config_class is None:
        from transformers import Qwen2Config as config_class

    heads, _ = text_width(text_hidden)
    token = tok.convert_tokens_to_ids
    return config_class(
        vocab_size=len(tok), hidden_size=text_hidden, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=1, max_position_embeddings=max_len,
        bos_token_id=token("<|endoftext|>"), eos_token_id=token("<|im_end|>"),
        pad_token_id=token("<|endoftext|>"), **fields)


def mrope_sections(sections: tuple[int, ...], head_dim: int) -> list[int]:
    """A family's mRoPE sections (t, h, w), given for the default head of 32, for a head of
    ``head_dim``: they split the rotary half of each head, so they scale with it."""
    return [n * head_dim // 32 for n in sections]
