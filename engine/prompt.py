"""From the API's input forms (chat, text, token ids) to prompt token ids."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from common.stable_head import stable_head_length
from common.template_kwargs import RESERVED_TEMPLATE_KWARGS
from engine.request import context_length_message
from engine.text.tokenizer import Tokenizer
from ignis.v1 import engine_pb2

if TYPE_CHECKING:
    from engine.vision.media import PromptMedia, VisionInput


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    token_ids: tuple[int, ...]
    text: str | None  # the rendered prompt, when there was text
    head_tokens: int = 0  # length of the stable head (common/stable_head.py), when it is a token prefix of the prompt
    media: PromptMedia | None = None  # its images: their spans in token_ids hold key ids (engine/vision/media.py)


IMAGE_INDEX = "ignis_image"  # an image part's index among the request's images (the template ignores it)


def _json_field(raw: str, name: str, expect: type) -> Any:
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{name} is nested too deeply") from None
    if not isinstance(value, expect):
        raise ValueError(f"{name} must be a JSON {expect.__name__}")
    return value


def chat_messages(chat: engine_pb2.ChatInput, images: list[bytes] | None = None) -> list[dict[str, Any]]:
    """The messages as the chat template takes them. An image part becomes {"type": "image"} (the form
    Qwen's templates render as the image placeholder) and its bytes go to `images`; without `images`
    (a model that takes none) an image part is a ValueError."""
    messages: list[dict[str, Any]] = []
    for i, msg in enumerate(chat.messages):
        if msg.role not in ("system", "developer", "user", "assistant", "tool"):
            raise ValueError(f"messages[{i}].role {msg.role!r} is not one of system, developer, user, assistant, tool")
        item: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role}
        if msg.content_parts:
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(msg.content_parts):
                if part.type == "text":
                    parts.append({"type": "text", "text": part.text})
                elif part.type == "image" and images is not None:
                    parts.append({"type": "image", IMAGE_INDEX: len(images)})
                    images.append(part.image_data)
                elif part.type == "image":
                    raise ValueError(f"messages[{i}].content[{j}]: this model does not take images (its checkpoint "
                                     "has no vision tower)")
                else:
                    raise ValueError(f"messages[{i}].content[{j}]: content part type {part.type!r} is not supported")
            item["content"] = parts
        elif msg.HasField("content"):
            item["content"] = msg.content
        else:
            item["content"] = None
        if msg.HasField("name"):
            item["name"] = msg.name
        if msg.HasField("tool_call_id"):
            item["tool_call_id"] = msg.tool_call_id
        if msg.HasField("reasoning_content"):
            item["reasoning_content"] = msg.reasoning_content
        if msg.tool_calls:
            item["tool_calls"] = [
                {"id": c.id, "type": c.type or "function",
                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in msg.tool_calls
            ]
        messages.append(item)
    return messages


def render_chat(tokenizer: Tokenizer, chat: engine_pb2.ChatInput, budget: int | None = None,
                vision: VisionInput | None = None, cache_salt: str = "") -> RenderedPrompt:
    """The chat's prompt. With `chat.truncate` and a `budget` (the most prompt tokens the context
    leaves), the oldest turns after the system head are dropped until the prompt fits. With `vision`
    (a model that takes images), each image's placeholder is widened to its span (engine/vision/media.py)."""
    if not chat.messages:
        raise ValueError("messages must not be empty")
    if chat.continue_final_message:
        raise ValueError("continue_final_message is not supported")
    tools = _json_field(chat.tools_json, "tools", list)
    kwargs = _json_field(chat.chat_template_kwargs_json, "chat_template_kwargs", dict) or {}
    reserved = sorted(set(RESERVED_TEMPLATE_KWARGS) & kwargs.keys())
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: the request's own fields do")
    add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    images: list[bytes] | None = [] if vision is not None else None
    messages = chat_messages(chat, images)

    def render(kept: list[dict[str, Any]]) -> tuple[str, tuple[int, ...]]:
        text, ids = tokenizer.render_chat(kept, tools, add_generation_prompt, kwargs)
        return text, tuple(ids)

    text, ids = render(messages)
    if chat.truncate and budget is not None and len(ids) > budget:
        messages, text, ids = _drop_oldest_turns(messages, budget, render)
    head = _head_tokens(tokenizer, messages, tools, kwargs, ids)
    if not images:
        return RenderedPrompt(ids, text, head)
    assert vision is not None
    from engine.vision.media import prepare_prompt  # the image processor: only for a model that takes images
    kept = [images[part[IMAGE_INDEX]] for m in messages if isinstance(m["content"], list)
            for part in m["content"] if part["type"] == "image"]
    widened, media = prepare_prompt(ids, kept, vision, cache_salt)
    return RenderedPrompt(widened, text, media.widened_index(head), media)


def _drop_oldest_turns(messages: list[dict[str, Any]], budget: int,
                       render: Callable[[list[dict[str, Any]]], tuple[str, tuple[int, ...]]]
                       ) -> tuple[list[dict[str, Any]], str, tuple[int, ...]]:
    """Truncation "auto" (the Responses API): keep the system head and the latest turns.

    A cut falls only before a user message, so an assistant's tool calls are never parted
    from their outputs and the kept conversation starts as a conversation does. The length
    shrinks as the cut moves later, so the latest cut that fits is found by bisection: a few
    renders, not one per turn. The last user message and what follows it are always kept."""
    head = messages[:stable_head_length(m["role"] for m in messages)]
    cuts = [i for i in range(len(head) + 1, len(messages)) if messages[i]["role"] == "user"]
    lo, hi = 0, len(cuts) - 1  # cuts[hi] keeps the least; search the earliest cut that fits
    best: tuple[list[dict[str, Any]], str, tuple[int, ...]] | None = None
    while lo <= hi:
        mid = (lo + hi) // 2
        kept = head + messages[cuts[mid]:]
        text, ids = render(kept)
        if len(ids) <= budget:
            best, hi = (kept, text, ids), mid - 1
        else:
            lo = mid + 1
    if best is None:
        raise PromptTooLong(len(render(head + messages[cuts[-1]:] if cuts else messages)[1]), budget)
    return best


class PromptTooLong(ValueError):
    """What truncation keeps (the system messages and the latest turn) is still over the budget."""

    def __init__(self, kept_tokens: int, budget: int) -> None:
        super().__init__(f"the input does not fit this model's context even with truncation: the system messages "
                         f"and the latest turn alone are {kept_tokens} tokens, more than the {budget} it allows")
        self.kept_tokens, self.budget = kept_tokens, budget


def _head_tokens(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[Any] | None,
                 kwargs: dict[str, Any], ids: tuple[int, ...]) -> int:
    """The stable head's length: render its messages and the tools alone; if those tokens
    prefix the full prompt, the state there is shared by every subagent of a burst."""
    head = messages[:stable_head_length(m["role"] for m in messages)]
    if not head and not tools:
        return 0
    try:
        head_text = tokenizer.apply_chat_template(head, tools=tools, add_generation_prompt=False, template_kwargs=kwargs)
    except ValueError:
        return 0  # a template that cannot render the head alone has no publish point
    head_ids = tokenizer.encode(head_text, add_special_tokens=False)
    return len(head_ids) if tuple(head_ids) == ids[: len(head_ids)] else 0


# No tokenizer makes fewer tokens than one per this many characters: text longer than
# max_model_len * MAX_CHARS_PER_TOKEN cannot fit the context, whatever it says, and is
# refused before anything renders or tokenizes it.
MAX_CHARS_PER_TOKEN = 256


def input_chars(request: engine_pb2.GenerateRequest | engine_pb2.TokenizeRequest) -> int:
    """Characters of text the request would render (messages, tools, raw text)."""
    which = request.WhichOneof("input")
    if which == "text":
        return len(request.text)
    if which != "chat":
        return 0
    chat = request.chat
    n = len(chat.tools_json) + len(chat.chat_template_kwargs_json)
    for msg in chat.messages:
        n += len(msg.content) + sum(len(p.text) for p in msg.content_parts) + len(msg.reasoning_content)
        n += sum(len(c.function.arguments) + len(c.function.name) for c in msg.tool_calls)
    return n


def check_input_size(request: engine_pb2.GenerateRequest | engine_pb2.TokenizeRequest, max_model_len: int) -> None:
    chars, limit = input_chars(request), max_model_len * MAX_CHARS_PER_TOKEN
    if chars > limit:  # OpenAI's opening words: clients tell a context error by them
        raise ValueError(f"This model's maximum context length is {max_model_len} tokens. However, the input has "
                         f"{chars} characters, more than that many tokens can hold (no tokenizer makes fewer than "
                         f"one token per {MAX_CHARS_PER_TOKEN} characters). Please reduce the length of the messages.")


def prompt_budget(request: engine_pb2.GenerateRequest | engine_pb2.TokenizeRequest, max_model_len: int) -> int:
    """The most prompt tokens the context leaves the request: room for its max_tokens, or one token."""
    sampling = getattr(request, "sampling", None)
    wanted = sampling.max_tokens if sampling is not None and sampling.HasField("max_tokens") else 0
    return max_model_len - max(wanted, 1)


def render_input(tokenizer: Tokenizer, request: engine_pb2.GenerateRequest | engine_pb2.TokenizeRequest,
                 max_model_len: int | None = None, vision: VisionInput | None = None) -> RenderedPrompt:
    which = request.WhichOneof("input")
    add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
    if which == "chat":
        budget = prompt_budget(request, max_model_len) if max_model_len is not None else None
        try:
            return render_chat(tokenizer, request.chat, budget, vision, getattr(request, "cache_salt", ""))
        except PromptTooLong as exc:
            assert max_model_len is not None  # only a budget truncates
            why = ", even with truncation keeping only the system messages and the latest turn"
            raise ValueError(context_length_message(max_model_len, exc.kept_tokens, max_model_len - exc.budget,
                                                    why)) from None
    if which == "text":
        if not request.text:
            raise ValueError("the prompt text is empty")
        return RenderedPrompt(tuple(tokenizer.encode(request.text, add_special_tokens=add_special)), request.text)
    if which == "token_ids" and isinstance(request, engine_pb2.GenerateRequest):
        if not request.token_ids.ids:
            raise ValueError("token_ids is empty")
        return RenderedPrompt(tuple(request.token_ids.ids), None)
    raise ValueError("the request has no input: set chat, text or token_ids")
