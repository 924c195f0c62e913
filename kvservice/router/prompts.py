"""A request's prompt as the engine will see it, in token ids, for the Lookup: completions' token prompts as
they are, their text with the model's tokenizer as vLLM tokenizes it (`add_special_tokens`, default true), and
chat messages through the model's chat template as vLLM 0.32 renders them (`apply_chat_template` with
`tokenize=True`, `add_generation_prompt` true unless the request says otherwise, the template's own special
tokens and no others). The tokens only steer the choice: the request itself goes to the engine unchanged, so
a prompt the router cannot tokenize is routed on load alone, never refused for it."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from kvservice.router import errors

logger = logging.getLogger(__name__)
INLINE_CHARS = 4096  # longer text is tokenized in a thread, off the event loop


def message_content(content):
    """A chat message's content as vLLM's "string" content format passes it to the template: text parts
    joined by newlines."""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "\n".join(str(p.get("text", "")) for p in content)
    return content


class Tokenizers:
    """Tokenizers by model: `--tokenizer` for every model, else the model dir an engine's /v1/models names
    (`root`), when it exists here. Loaded once, in a thread."""

    def __init__(self, default_dir: str | None = None) -> None:
        self.default_dir = default_dir
        self._loaded: dict[str, object] = {}
        self._failed: set[str] = set()

    async def get(self, root: str | None):
        path = self.default_dir or root
        if not path or path in self._failed:
            return None
        tokenizer = self._loaded.get(path)
        if tokenizer is None:
            if not self.default_dir and not os.path.isdir(path):
                self._failed.add(path)
                return None
            try:
                tokenizer = await asyncio.to_thread(self._load, path)
            except Exception as exc:  # noqa: BLE001 - text prompts are then routed on load alone
                logger.warning("kvservice route: no tokenizer from %s (%s); text prompts are routed on load alone",
                               path, exc)
                self._failed.add(path)
                return None
            self._loaded[path] = tokenizer
        return tokenizer

    @staticmethod
    def _load(path: str):
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(Path(path))


def _completion_ids(body: dict, tokenizer) -> list[int] | None:
    prompt = body.get("prompt")
    if prompt == []:
        raise errors.no_prompt()
    if isinstance(prompt, list) and prompt and all(isinstance(p, (list, str)) for p in prompt):
        prompt = prompt[0]  # a batch: routed by its first prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, str) and tokenizer is not None:
        return tokenizer.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", True)))
    return None


def _chat_ids(body: dict, tokenizer) -> list[int] | None:
    messages = body.get("messages")
    if tokenizer is None or not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return None
    conversation = [{**m, "content": message_content(m.get("content"))} for m in messages]
    kwargs = dict(body.get("chat_template_kwargs") or {})
    kwargs.update(add_generation_prompt=body.get("add_generation_prompt", True),
                  continue_final_message=body.get("continue_final_message", False))
    if body.get("documents") is not None:
        kwargs["documents"] = body["documents"]
    try:
        ids = tokenizer.apply_chat_template(conversation, tools=body.get("tools"), tokenize=True, return_dict=False,
                                            chat_template=body.get("chat_template"), **kwargs)
    except Exception as exc:  # noqa: BLE001 - the engine will say what is wrong with it
        logger.debug("kvservice route: chat template failed: %s", exc)
        return None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def _size(body: dict) -> int:
    prompt, messages = body.get("prompt"), body.get("messages")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(messages, list):
        return sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict))
    return 0


def needs_tokenizer(kind: str, body: dict) -> bool:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (list, str)) for p in prompt):
        prompt = prompt[0]
    return kind == "chat" or isinstance(prompt, str)


async def prompt_ids(kind: str, body: dict, get_tokenizer) -> list[int] | None:
    """The prompt's token ids (`kind`: "completions" or "chat"), None when the router cannot know them;
    `get_tokenizer()` (a coroutine) is awaited only for text. Raises RouterError for an empty prompt, as vLLM
    does."""
    convert = _chat_ids if kind == "chat" else _completion_ids
    tokenizer = await get_tokenizer() if needs_tokenizer(kind, body) else None
    if tokenizer is not None and _size(body) > INLINE_CHARS:
        ids = await asyncio.to_thread(convert, body, tokenizer)
    else:
        ids = convert(body, tokenizer)
    if ids is not None and not ids:
        raise errors.empty_prompt()
    return ids
