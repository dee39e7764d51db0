"""The checkpoint's own tokenizer and chat template, through transformers.

Chat templates are Jinja programs shipped inside checkpoints; transformers renders them in
jinja2's immutable sandbox, so a template cannot reach Python internals or change its inputs.
"""

from __future__ import annotations

import warnings
from functools import partial
from pathlib import Path

from candelabra.core.engine.gguf_tokenizer_cache import cached_gguf_tokenizer
from candelabra.core.weights import Checkpoint, CheckpointError


class ChatTemplateError(ValueError):
    pass


def _gguf_tokenizer(files: dict):
    """transformers' tokenizer of a GGUF file. AutoTokenizer picks the tokenizer's class by the model
    transformers would load from the file, and refuses a file of an architecture whose models it does
    not load from GGUF (deepseek2, glm4, phi2, gemma); the tokenizer itself is made from the file's
    `tokenizer.*` metadata alone, so such a file gets transformers' generic fast tokenizer class."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(**files)
    except ValueError as exc:
        if "not supported" not in str(exc):
            raise
        return PreTrainedTokenizerFast.from_pretrained(**files)


class Tokenizer:
    def __init__(self, hf_tokenizer, eos_token_ids: tuple[int, ...] = ()) -> None:
        self._hf = hf_tokenizer
        # transformers' decode wraps the Rust tokenizer's in Python that converts and inspects the ids
        # (about 35 us a call, two calls a generated token); where it adds nothing to the Rust decode
        # (no clean-up of spaces) the Rust one is called directly.
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        cleans_up = getattr(hf_tokenizer, "clean_up_tokenization_spaces", False)
        self._rust_decode = backend.decode if backend is not None and not cleans_up else None
        # A token decoded alone, by (id, skip_special_tokens): the detokenizer asks for one a generated token.
        self._single: dict[tuple[int, bool], str] = {}
        ids = set(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            ids.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(ids)

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
        from transformers import AutoTokenizer
        from transformers.utils import logging

        logging.set_verbosity_error()
        files = checkpoint.tokenizer_files()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if "gguf_file" not in files:
                    return cls(AutoTokenizer.from_pretrained(**files), eos_token_ids)
                gguf = Path(files["pretrained_model_name_or_path"]) / files["gguf_file"]
                build = partial(_gguf_tokenizer, files)
                return cls(cached_gguf_tokenizer(gguf, build, AutoTokenizer.from_pretrained), eos_token_ids)
        except (OSError, ValueError, KeyError) as exc:
            problem = " ".join(str(exc).split())
            raise CheckpointError(checkpoint.path, f"its tokenizer cannot be loaded: {problem}") from exc

    @property
    def hf_tokenizer(self):
        """transformers' tokenizer underneath (for libraries that read one, such as llguidance)."""
        return self._hf

    @property
    def vocab_size(self) -> int:
        return len(self._hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        if len(token_ids) == 1:
            key = (int(token_ids[0]), skip_special_tokens)
            text = self._single.get(key)
            if text is None:
                text = self._single[key] = self._decode(token_ids, skip_special_tokens)
            return text
        return self._decode(token_ids, skip_special_tokens)

    def _decode(self, token_ids, skip_special_tokens: bool) -> str:
        if self._rust_decode is not None:
            return self._rust_decode([int(token) for token in token_ids], skip_special_tokens=skip_special_tokens)
        return self._hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    @property
    def chat_template_text(self) -> str:
        """The chat template's source (all of them, where a checkpoint names several)."""
        template = getattr(self._hf, "chat_template", None) or ""
        return "\n".join(template.values()) if isinstance(template, dict) else template

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    **template_kwargs) -> str:
        """The prompt text for `messages`, with the functions in `tools` offered to the model;
        `template_kwargs` reach the template (for example Qwen3's enable_thinking)."""
        if not self.has_chat_template:
            raise ChatTemplateError("this model has no chat template; send it plain text as a completion instead")
        from jinja2.exceptions import SecurityError, TemplateError

        try:
            return self._hf.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                add_generation_prompt=add_generation_prompt, **template_kwargs)
        except SecurityError as exc:
            raise ChatTemplateError(f"the chat template tried something unsafe and was stopped: {exc}") from exc
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from exc

    def chat_token_ids(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt, **template_kwargs)
        # The template writes the special tokens itself (BOS included), so none are added here.
        return self.encode(text, add_special_tokens=False)
