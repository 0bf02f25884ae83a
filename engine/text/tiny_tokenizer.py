"""The tokenizer of the built-in model "ignis-tiny", trained deterministically.

A byte-level BPE trained on a corpus generated here, from fixed word lists and
a seeded RNG, so every run writes a byte-identical `tokenizer.json` without
downloading anything. The chat template is ChatML with tools in the Qwen3
style, so the tiny model exercises the same paths as a real Qwen checkpoint.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

TINY_VOCAB_SIZE = 4096
TINY_MODEL_MAX_LENGTH = 4096

# Specials come first so their ids are small and stable: 0..8.
# (content, special): like Qwen, the tool and think markers are added tokens
# that are *not* special, so `skip_special_tokens` keeps them in the text
# that the tool-call and reasoning parsers read.
TINY_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

# ChatML with tools, Qwen3 style. Why no default system prompt and no
# history-dependent think stripping: the render of [system] + tools must be a
# prefix of every conversation that starts with them, and each turn's prompt
# must extend the previous turn's, so retained state stays reusable.
TINY_CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is mapping and part.type == 'text' -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages|length > 0 and messages[0].role == 'system' %}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if has_system %}
        {{- render_content(messages[0].content) + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif has_system %}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- '<|im_start|>system\\n' + render_content(message.content) + '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\\n' + render_content(message.content) + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if message.reasoning_content is string and message.reasoning_content %}
            {{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- render_content(message.content) }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if (loop.first and render_content(message.content)) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unknown message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# --- the corpus -------------------------------------------------------------

_NAMES = """Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Niaj Olivia Peggy Rupert
Sybil Trent Victor Walter Zoe""".split()
_PLACES = """Paris London Tokyo Berlin Madrid Rome Lisbon Oslo Cairo Lima Sydney Toronto Seoul Mumbai
Dublin Vienna Prague Zurich Boston Chicago""".split()
_NOUNS = """time year people way day man thing woman life child world school state family
student group country problem hand part place case week company system program question work
government number night point home water room mother area money story fact month lot right study
book eye job word business issue side kind head house service friend father power hour game line
end member law car city community name president team minute idea kid body information back parent
face others level office door health person art war history party result change morning reason
research girl guy moment air teacher force education model server request token cache memory page
state engine request response function argument value weather temperature forecast file folder
database query table column index record message conversation assistant user system tool result
error warning status code test package module library version release update network address port
window button screen image picture music song movie train plane ticket hotel restaurant recipe
garden flower tree river mountain ocean island forest desert city village street road bridge""".split()
_VERBS = """is was are were be have has had do does did say says said go goes went get gets got
make makes made know knows knew think thinks thought take takes took see sees saw come comes came
want wants wanted look looks looked use uses used find finds found give gives gave tell tells told
work works worked call calls called try tries tried ask asks asked need needs needed feel feels felt
become becomes became leave leaves left put puts mean means meant keep keeps kept let lets begin
begins began seem seems seemed help helps helped show shows showed hear hears heard play plays
played run runs ran move moves moved live lives lived believe believes believed hold holds held
bring brings brought write writes wrote provide provides provided read reads returns returned
compute computes computed store stores stored load loads loaded send sends sent receive receives""".split()
_ADJECTIVES = """good new first last long great little own other old right big high different small
large next early young important few public bad same able fast slow quick simple easy hard warm
cold sunny cloudy rainy windy bright dark happy sad helpful careful correct wrong empty full
short tall free open closed local remote final current previous valid invalid""".split()
_FUNCTION_WORDS = """the a an of to in for on with at by from up about into over after
and but or because if when while although so than that this these those it its they them their
we our you your he him his she her I my me not no yes very also just only then there here
what which who how why where all some any each every more most much many such
hello Hello hi Hi thanks please sorry okay OK""".split()
_NON_ASCII = [
    "café", "naïve", "résumé", "façade", "jalapeño", "über", "Zürich", "São Paulo", "crème brûlée",
    "日本語", "日本", "東京", "中文", "你好", "世界", "こんにちは", "Привет", "мир", "Ελληνικά",
    "emoji 😀", "🚀", "🎉", "👍", "❤️", "🌧️", "☀️", "→", "…", "—", "€", "£", "°C", "±", "×",
]
_TOOLS = "get_weather search_web read_file write_file run_python send_email get_time calculator".split()
_ARG_KEYS = "city query path content code to subject timezone expression unit limit".split()
_CODE = [
    "def {f}(x: int, y: int) -> int:\n    return x + y\n",
    "for i in range({n}):\n    print(i, i * i)\n",
    "import json\ndata = json.loads(text)\nprint(data['{k}'])\n",
    "class {N}:\n    def __init__(self, value):\n        self.value = value\n",
    "if x is None:\n    raise ValueError(\"missing {k}\")\n",
    "const {k} = await fetch(`/api/{k}?limit={n}`);\n",
    "SELECT {k}, COUNT(*) FROM {k}s WHERE id > {n} GROUP BY {k};\n",
    "{{\"{k}\": {n}, \"ok\": true, \"items\": [1, 2, 3], \"name\": \"{N}\"}}\n",
    "$ curl -s http://localhost:{n}/v1/chat/completions -d @request.json\n",
    "x = [{n}, {n}, {n}]  # a list of numbers\n",
]
_SENTENCES = [
    "{N} went to {P} with {M} last {w}.",
    "The {a} {n} {v} the {n} in {P}.",
    "What is the weather in {P} today?",
    "It is {d} degrees and {a} in {P} right now.",
    "Please {v} the {n} for me, {N}.",
    "I think the {n} is {a} because the {n} {v} it.",
    "Can you tell me how to {v} a {n}?",
    "Sure! Here is how you {v} the {n}: first, open the {n}; then {v} it.",
    "{N} said: \"The {n} {v} {d} times.\"",
    "There are {d} {n}s in the {a} {n}.",
    "Thank you, {N}. The {n} is {a} now.",
    "The answer is {d}.",
    "You are a helpful assistant.",
    "Let me think step by step about the {n}.",
]


def _fill(template: str, rng: random.Random) -> str:
    return template.format(
        N=rng.choice(_NAMES), M=rng.choice(_NAMES), P=rng.choice(_PLACES),
        n=rng.choice(_NOUNS), a=rng.choice(_ADJECTIVES), v=rng.choice(_VERBS),
        w=rng.choice(["week", "year", "month", "night"]), d=rng.randint(0, 2025),
        f=rng.choice(_NOUNS) + "_" + rng.choice(_VERBS), k=rng.choice(_ARG_KEYS),
    )


def _tool_call_json(rng: random.Random) -> str:
    args = {k: rng.choice([rng.choice(_PLACES), rng.randint(0, 999), rng.choice(_NOUNS)])
            for k in rng.sample(_ARG_KEYS, rng.randint(1, 3))}
    return json.dumps({"name": rng.choice(_TOOLS), "arguments": args})


def tiny_corpus(lines: int = 9000) -> list[str]:
    """The training corpus: deterministic (fixed lists, seeded RNG), ~0.85 MB."""
    rng = random.Random(20240601)
    out: list[str] = []
    words = _NOUNS + _VERBS + _ADJECTIVES + _FUNCTION_WORDS
    for i in range(lines):
        kind = i % 10
        if kind < 5:
            out.append(" ".join(_fill(rng.choice(_SENTENCES), rng) for _ in range(3)))
        elif kind == 5:
            snippet = rng.choice(_CODE)
            out.append(snippet.format(f=rng.choice(_NOUNS) + "_" + rng.choice(_VERBS), n=rng.randint(0, 9999),
                                      k=rng.choice(_ARG_KEYS), N=rng.choice(_NAMES)))
        elif kind == 6:
            out.append(_tool_call_json(rng))
        elif kind == 7:
            out.append(" ".join(rng.choice(words) for _ in range(rng.randint(8, 24))).capitalize() + ".")
        elif kind == 8:
            out.append(" ".join(rng.choice(_NON_ASCII) + " " + rng.choice(words) for _ in range(4)))
        else:
            out.append(", ".join(str(rng.randint(0, 10 ** rng.randint(1, 6))) for _ in range(8)))
    return out


# --- training and writing ----------------------------------------------------

def train_tiny_tokenizer() -> HFTokenizer:
    """Train the tiny tokenizer from scratch (about a second; deterministic)."""
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[content for content, _ in TINY_ADDED_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(tiny_corpus(), trainer=trainer)
    return tk


def tiny_tokenizer_json() -> str:
    """Train and serialize: the exact text of ignis-tiny's tokenizer.json."""
    tk = train_tiny_tokenizer()
    # The trainer marks every added token special; flip the ones Qwen keeps
    # as plain text (tool and think markers) and make none of them normalized.
    data: dict[str, Any] = json.loads(tk.to_str())
    special = dict(TINY_ADDED_TOKENS)
    for entry in data["added_tokens"]:
        entry["special"] = special[entry["content"]]
        entry["normalized"] = False
    return json.dumps(data, ensure_ascii=False, indent=2) + "\n"


def _tokenizer_config() -> dict[str, Any]:
    decoder = {
        str(i): {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": special}
        for i, (content, special) in enumerate(TINY_ADDED_TOKENS)
    }
    return {
        # Why this class: transformers then loads tokenizer.json as-is, rather
        # than rebuilding a pipeline of its own from a model-specific class.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": TINY_MODEL_MAX_LENGTH,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "added_tokens_decoder": decoder,
        "chat_template": TINY_CHAT_TEMPLATE,
    }


def write_tiny_tokenizer(directory: Path) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` of ignis-tiny into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tiny_tokenizer_json(), encoding="utf-8")
    config = json.dumps(_tokenizer_config(), ensure_ascii=False, indent=2) + "\n"
    (directory / "tokenizer_config.json").write_text(config, encoding="utf-8")


# ignis-tiny with Qwen's vision tokens appended (ids 4096..4099) and its template rendering an image part
# as Qwen's templates do: the tokenizer of the tiny and bench checkpoints with a vision tower
# (tests/test_images_service.py, bench/media.py).
VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
VISION_TOKEN_IDS = tuple(range(TINY_VOCAB_SIZE, TINY_VOCAB_SIZE + 4))  # in VISION_TOKENS' order
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
_TEXT_PART = "{%- if part is mapping and part.type == 'text' -%}\n                {{- part.text -}}\n"
VISION_CHAT_TEMPLATE = TINY_CHAT_TEMPLATE.replace(
    _TEXT_PART, _TEXT_PART + "            {%- elif part is mapping and part.type == 'image' -%}\n"
                             f"                {{{{- '{IMAGE_PLACEHOLDER}' -}}}}\n")
assert VISION_CHAT_TEMPLATE != TINY_CHAT_TEMPLATE, "ignis-tiny's template changed: render image parts again"


def write_tiny_vision_tokenizer(directory: Path) -> None:
    """ignis-tiny's tokenizer files in `directory`, with the vision tokens and the image-rendering template."""
    write_tiny_tokenizer(directory)
    tokenizer = HFTokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    assert tuple(tokenizer.token_to_id(t) for t in VISION_TOKENS) == VISION_TOKEN_IDS
    tokenizer.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    for token, token_id in zip(VISION_TOKENS, VISION_TOKEN_IDS):
        config["added_tokens_decoder"][str(token_id)] = {"content": token, "lstrip": False, "normalized": False,
                                                          "rstrip": False, "single_word": False, "special": True}
    config["chat_template"] = VISION_CHAT_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
