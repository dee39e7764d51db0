"""A byte-level stand-in tokenizer for a config.json that comes without the model's tokenizer.

Text becomes one token per UTF-8 byte (after the BOS token, when the config names one); every
other id of the vocabulary decodes to a placeholder "<id>", the config's BOS and EOS ids to
"<|bos|>" and "<|eos|>". Its chat template writes "role: content" lines. Enough for load tests and
benchmarks of random weights: token counts are exact, text is meaningless, and prompts are about
five tokens per English word instead of one or two.

It is a transformers tokenizer written to a folder, so it loads like any checkpoint's own; the
folder is kept in candelabra's cache, one per vocabulary size and special ids.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from candelabra.core.weights import CheckpointError

CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
BYTES = 256
VERSION = 1  # bump when the folder's contents change, so old cached folders are not reused


def stand_in_tokenizer_folder(vocab_size: int, bos_token_id: int | None, eos_token_ids: tuple[int, ...],
                              cache_dir: Path) -> Path:
    """The folder holding the stand-in tokenizer for these ids, built on first use."""
    specials = _special_tokens(vocab_size, bos_token_id, eos_token_ids)
    if vocab_size < BYTES + len(specials):
        raise CheckpointError(
            f"vocab_size {vocab_size}", f"is too small for the byte-level stand-in tokenizer, which needs "
            f"{BYTES + len(specials)} ids; put the model's tokenizer files (tokenizer.json, tokenizer_config.json) "
            "beside config.json")
    eos = "_".join(str(token_id) for token_id in eos_token_ids)
    folder = cache_dir / "tokenizers" / f"stand-in-v{VERSION}-vocab{vocab_size}-bos{bos_token_id}-eos{eos}"
    if not (folder / "tokenizer_config.json").is_file():
        partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
        _build(vocab_size, bos_token_id, eos_token_ids, specials).save_pretrained(partial)
        if folder.exists():  # another process got there first
            shutil.rmtree(partial, ignore_errors=True)
        else:
            partial.replace(folder)
    return folder


def _special_tokens(vocab_size: int, bos_token_id: int | None, eos_token_ids: tuple[int, ...]) -> dict[int, str]:
    """Token text by id for the config's EOS and BOS ids inside the vocabulary (an id both BOS
    and EOS is the EOS token)."""
    names: dict[int, str] = {}
    for index, token_id in enumerate(eos_token_ids):
        names.setdefault(token_id, "<|eos|>" if index == 0 else f"<|eos{index}|>")
    if bos_token_id is not None:
        names.setdefault(bos_token_id, "<|bos|>")
    return {token_id: name for token_id, name in sorted(names.items()) if 0 <= token_id < vocab_size}


def _build(vocab_size: int, bos_token_id: int | None, eos_token_ids: tuple[int, ...], specials: dict[int, str]):
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    free = (token_id for token_id in range(vocab_size) if token_id not in specials)
    # With no merges and no characters in the vocabulary, byte fallback spells all text in bytes.
    vocabulary = {f"<0x{byte:02X}>": next(free) for byte in range(BYTES)}
    vocabulary |= {f"<{token_id}>": token_id for token_id in free}
    vocabulary |= {name: token_id for token_id, name in specials.items()}
    raw = Tokenizer(models.BPE(vocab=vocabulary, merges=[], byte_fallback=True))
    raw.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    bos = specials.get(bos_token_id) if bos_token_id is not None else None
    eos = specials.get(eos_token_ids[0]) if eos_token_ids else None
    if bos is not None:
        raw.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, bos_token_id)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=bos, eos_token=eos,
                                        additional_special_tokens=[n for n in specials.values() if n not in (bos, eos)])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
