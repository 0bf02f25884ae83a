"""What a request asks the output to match: one frozen, hashable record, the grammar cache's key."""

from __future__ import annotations

import enum
from dataclasses import dataclass

MAX_CHOICES = 1024  # entries of a choice list
MAX_SOURCE_CHARS = 1 << 20  # a schema, regex, grammar or structural tag


class GuideKind(enum.Enum):
    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # `source`: the schema as JSON text
    REGEX = "regex"  # `source`: the pattern
    CHOICE = "choice"  # `choices`: one of these strings exactly
    GRAMMAR = "grammar"  # `source`: EBNF (GBNF), root rule `root`
    STRUCTURAL_TAG = "structural_tag"  # `source`: an xgrammar structural tag as JSON text
    TOOL_CALLS = "tool_calls"  # `source`: the tools JSON, `tool_choice`, `tool_format`: the checkpoint's call syntax


@dataclass(frozen=True, slots=True)
class GuidedSpec:
    kind: GuideKind
    source: str = ""
    choices: tuple[str, ...] = ()
    tool_choice: str = ""  # "required" or a function name (TOOL_CALLS)
    tool_format: str = ""  # hermes | llama3_json | mistral | qwen3_coder (TOOL_CALLS)
    parallel_tool_calls: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(self.choices))
        if len(self.source) > MAX_SOURCE_CHARS:
            raise ValueError(f"the {self.kind.value} guide is longer than {MAX_SOURCE_CHARS} characters")
        if self.kind is GuideKind.CHOICE:
            if not self.choices:
                raise ValueError("a choice guide needs at least one choice")
            if len(self.choices) > MAX_CHOICES:
                raise ValueError(f"a choice guide takes at most {MAX_CHOICES} choices, got {len(self.choices)}")
        elif self.kind is not GuideKind.JSON_OBJECT and not self.source:
            raise ValueError(f"the {self.kind.value} guide is empty")
        if self.kind is GuideKind.TOOL_CALLS and not self.tool_choice:
            raise ValueError("a tool-call guide needs tool_choice ('required' or a function name)")
