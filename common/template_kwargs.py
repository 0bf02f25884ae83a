"""Chat-template variables a client may not set through `chat_template_kwargs`: the template
call passes them itself. The gateway refuses them (400 naming the key), the engine too
(INVALID_ARGUMENT), from this one list."""

from __future__ import annotations

RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt")
