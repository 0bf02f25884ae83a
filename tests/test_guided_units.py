"""engine/guided and the sampler's guide step, in-process: the cache, the batch mask, forks,
the checkpoint's formats, and a grammar that survives preemption (recompute)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import pytest
import torch

from engine.guided import GuideKind, GuidedCompiler, GuidedError, GuidedSpec, infer_formats
from engine.model.loader import LoadedModel, load_model
from engine.request import EngineRequest
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import RequestSampler, sample
from engine.text.tokenizer import Tokenizer
from engine.facts import ReuseTier
from services import RunningService
from test_engine_core import make_core, make_prompt, run_all
from test_live_moves import Driver, move_at, same, store  # noqa: F401 (store: the tierstore fixture)

REGEX = GuidedSpec(GuideKind.REGEX, source=r"[a-d]{4}[0-9]{2}")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[LoadedModel, Tokenizer]:
    return load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def compiler(tiny: tuple[LoadedModel, Tokenizer]) -> GuidedCompiler:
    loaded, tokenizer = tiny
    return GuidedCompiler(tokenizer, loaded.config.vocab_size, tokenizer.eos_token_ids)


def test_compiled_grammars_are_cached_by_content_and_bounded(tiny: tuple[LoadedModel, Tokenizer]) -> None:
    loaded, tokenizer = tiny
    compiler = GuidedCompiler(tokenizer, loaded.config.vocab_size, tokenizer.eos_token_ids, cache_entries=2)
    a, b, c = (GuidedSpec(GuideKind.REGEX, source=s) for s in ("a+", "b+", "c+"))
    first = compiler.compile(a)
    assert compiler.compile(GuidedSpec(GuideKind.REGEX, source="a+")).grammar is first.grammar  # equal content
    assert (compiler.hits, compiler.misses) == (1, 1)
    compiler.compile(b)
    compiler.compile(c)  # evicts a, the least recently used
    compiler.compile(a)
    assert (compiler.hits, compiler.misses) == (1, 4)


def test_request_stop_token_ids_may_end_a_complete_grammar(compiler: GuidedCompiler) -> None:
    assert compiler.compile(REGEX, stop_token_ids=(7,)).stop_token_ids == tuple(sorted({*compiler.eos_token_ids, 7}))


def test_errors_name_the_problem(compiler: GuidedCompiler) -> None:
    with pytest.raises(GuidedError, match=r"invalid regex: .*parenthesis"):
        compiler.compile(GuidedSpec(GuideKind.REGEX, source="(a"))
    with pytest.raises(GuidedError, match="invalid choice"):
        compiler.compile(GuidedSpec(GuideKind.CHOICE, choices=("a", "")))
    with pytest.raises(ValueError, match="at least one choice"):
        GuidedSpec(GuideKind.CHOICE)


def test_the_batch_mask_touches_guided_rows_only(compiler: GuidedCompiler, tiny: tuple[LoadedModel, Tokenizer]) -> None:
    tokenizer = tiny[1]
    vocab = tiny[0].config.vocab_size
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0.0, logprobs=True)
    plain = [RequestSampler(greedy), RequestSampler(greedy)]
    guided = RequestSampler(greedy, guide=compiler.compile(REGEX).new_guide())
    out = sample(logits, [plain[0], guided, plain[1]], frozenset(tokenizer.eos_token_ids), [0, 0, 0])
    alone = sample(logits[[0, 2]], plain, frozenset(tokenizer.eos_token_ids), [0, 0])
    assert [out.token_ids[0], out.token_ids[2]] == alone.token_ids and out.logprobs[0] == alone.logprobs[0]
    assert re.fullmatch(r"[a-d]{1,4}", tokenizer.decode([out.token_ids[1]]))
    assert out.logprobs[1] is not None and out.logprobs[1] > alone.logprobs[0]  # type: ignore[operator]


def test_forks_walk_their_own_grammar(compiler: GuidedCompiler, tiny: tuple[LoadedModel, Tokenizer]) -> None:
    tokenizer = tiny[1]
    parent = RequestSampler(SamplingParams(temperature=1.0, seed=1), guide=compiler.compile(REGEX).new_guide())
    child = parent.fork(1)
    for t in tokenizer.encode("abcd"):
        parent.observe(t)
    for t in tokenizer.encode("cd"):
        child.observe(t)
    letter = tokenizer.encode("a")
    assert len(letter) == 1
    child.observe(letter[0])  # two letters in: a third is fine
    with pytest.raises(RuntimeError, match="outside its grammar"):
        parent.observe(letter[0])  # four letters in: a fifth is not


def test_a_grammar_survives_preemption(tiny: tuple[LoadedModel, Tokenizer], compiler: GuidedCompiler) -> None:
    tokenizer = tiny[1]
    schema = {"type": "array", "minItems": 30, "maxItems": 30, "items": {"type": "integer", "minimum": 0, "maximum": 9}}
    guide = compiler.compile(GuidedSpec(GuideKind.JSON_SCHEMA, source=json.dumps(schema)))
    core = make_core(tiny, pages=20)
    requests = [EngineRequest(f"r{i}", make_prompt(40, seed=i), SamplingParams(temperature=1.0, seed=i, max_tokens=120),
                              guided=guide) for i in range(4)]
    out = run_all(core, requests)
    assert core.totals.preempted > 0  # 4 x 7 pages do not fit in 20: sequences were recomputed mid-grammar
    for i in range(4):
        value = json.loads(tokenizer.decode(out.tokens(f"r{i}")))
        assert len(value) == 30 and all(0 <= v <= 9 for v in value)
    core.check_integrity()


def test_the_tiny_template_writes_hermes_calls_and_qwen3_reasoning(tiny: tuple[LoadedModel, Tokenizer]) -> None:
    formats = infer_formats(tiny[1])
    assert (formats.tool_call, formats.reasoning) == ("hermes", "qwen3")


def test_a_grammar_survives_a_move_down_a_tier(tiny: tuple[LoadedModel, Tokenizer], compiler: GuidedCompiler,
                                               store: RunningService) -> None:
    """Moved to KV-RAM mid-answer and restored: the matcher is the sequence's own Python state, so the
    resumed sequence writes what the unmoved one did, still inside its grammar."""
    loaded, tokenizer = tiny
    schema = {"type": "array", "minItems": 12, "maxItems": 12, "items": {"type": "integer", "minimum": 0, "maximum": 99}}
    guide = compiler.compile(GuidedSpec(GuideKind.JSON_SCHEMA, source=json.dumps(schema)))
    prompt = make_prompt(40, seed=2)

    def request(rid: str) -> EngineRequest:
        return EngineRequest(rid, prompt, SamplingParams(temperature=0.9, seed=5, max_tokens=80, logprobs=True),
                             guided=guide)

    driver = Driver(("hybrid", loaded, tokenizer), store.address, reuse_prompt=False)
    try:
        want = driver.run(request("alone"))
        driver.submit(request("moved"))
        move_at(driver, "moved", lambda s: s.num_output == 7)
        driver.step_until(lambda: driver.done("moved"))
        got = driver.result("moved")
        same(got, want)
        assert driver.core.stats().sequences_moved[ReuseTier.RAM] == 1
        assert got.finish == "stop" and len(json.loads(got.text)) == 12
    finally:
        driver.close()


@pytest.mark.parametrize("fmt, opener", [("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "'),
                                         ("llama3_json", '{"name": "get_weather", "parameters": {"city": "')])
def test_a_tool_call_argument_string_takes_no_control_character(compiler: GuidedCompiler, fmt: str,
                                                                 opener: str) -> None:
    """xgrammar writes a length-limited string's character as [^"\\\r\n] inside tool-call tags too
    (a raw control character: invalid JSON arguments, seen once from the random tiny model): the
    compiler mends the tag's grammar as it does a json_schema's."""
    import xgrammar as xgr

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "additionalProperties": False,
        "properties": {"city": {"type": "string", "maxLength": 8}}}}}]
    spec = GuidedSpec(GuideKind.TOOL_CALLS, source=json.dumps(tools), tool_choice="required", tool_format=fmt,
                      parallel_tool_calls=False)
    grammar = compiler.compile(spec).grammar

    def accepts(text: str) -> bool:
        return bool(xgr.GrammarMatcher(grammar).accept_string(text))
    assert accepts(opener + "Paris")
    assert not accepts(opener + "Pa\x15ris")
    assert not accepts(opener + "\x00")


@pytest.mark.parametrize("bound", [None, 5])
def test_a_json_string_takes_no_surrogate(compiler: GuidedCompiler, bound: int | None) -> None:
    """xgrammar's string characters take U+D800-DFFF, whose 3-byte forms are not UTF-8 (a seeded
    request wrote "}}th" + ED B7 BA into a maxLength 5 string: seven characters once decoded). The
    compiler mends both its string rules (with and without a length) to refuse them."""
    import xgrammar as xgr

    string = {"type": "string"} if bound is None else {"type": "string", "maxLength": bound}
    schema = {"type": "object", "properties": {"s": string}, "required": ["s"], "additionalProperties": False}
    grammar = compiler.compile(GuidedSpec(GuideKind.JSON_SCHEMA, source=json.dumps(schema))).grammar

    def accepts(value: bytes) -> bool:
        return bool(xgr.GrammarMatcher(grammar).accept_string(b'{"s": "' + value + b'"}'))
    assert not accepts(b"}}th\xed\xb7\xba")  # U+DDFA
    assert not accepts(b"\xed\xa0\x80")  # U+D800
    assert accepts(b"\xed\x9f\xbf")  # U+D7FF, the last before the surrogates
    assert accepts(b"\xee\x80\x80")  # U+E000, the first after
    assert accepts("\u65e5\U0001F600".encode())
    if bound is None:  # (xgrammar's length-limited string takes no escapes at all)
        assert accepts(b"\\ud800")  # an escaped surrogate is JSON's business, and valid UTF-8


# One call to f({"a": 1}) in each family's syntax, and what joins two calls.
CALLS = {"hermes": ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "\n"),
         "qwen3_coder": ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>", "\n"),
         "llama3_json": ('{"name": "f", "parameters": {"a": 1}}', "; "),
         "mistral": ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]', "")}


def _tool_grammar(choice: str, fmt: str, parallel: bool) -> Callable[[str], bool]:
    """Whether the tool-call grammar takes `text` as a whole output (f and g, each with an integer `a`)."""
    import xgrammar as xgr

    from engine.guided.tool_grammar import tool_call_tag

    tools = json.dumps([{"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}} for name in ("f", "g")])
    grammar = xgr.Grammar.from_structural_tag(tool_call_tag(tools, choice, fmt, parallel))
    return lambda text: bool(xgr.testing._is_grammar_accept_string(grammar, text))


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "one-call"])
@pytest.mark.parametrize("fmt", sorted(CALLS))
def test_required_is_one_or_more_calls_then_the_end(fmt: str, parallel: bool) -> None:
    """tool_choice "required": one call or more (one only with `parallel_tool_calls: false`), joined as
    the family writes them, and nothing else: no text before, between or after, so the output always
    ends at its last call (xgrammar's own "required" let free text follow a call, and a random model
    ran on to max_tokens: chat finished `length`, /v1/responses `incomplete`)."""
    accepts = _tool_grammar("required", fmt, parallel)
    call, separator = CALLS[fmt]
    two = (call + separator + call) if fmt != "mistral" else call.replace("}]", "}, " + call[13:-1] + "]")
    assert accepts(call)
    assert accepts(two) is parallel
    assert not accepts(call + "Sure.") and not accepts(call + " ")
    assert not separator or not accepts(call + separator)  # a separator is no end
    assert not accepts("Sure." + call) and not accepts("")
    assert not accepts(call.replace("1", '"one"'))  # arguments keep to their schema
    if fmt == "mistral":
        assert not accepts("[TOOL_CALLS][]")


@pytest.mark.parametrize("fmt", sorted(CALLS))
def test_a_named_function_is_one_call_then_the_end(fmt: str) -> None:
    accepts = _tool_grammar("f", fmt, True)
    call, separator = CALLS[fmt]
    assert accepts(call)
    assert not accepts(call + "Sure.") and not accepts(call + separator + call)
    assert not accepts(call.replace('"f"', '"g"').replace("=f>", "=g>"))  # only the named one


def test_a_json_schema_holds_as_written(compiler: GuidedCompiler) -> None:
    """Extra properties and items only where the schema allows them, whatever the request's `strict`
    (vLLM's rule): xgrammar's loose mode took any key after the declared ones, and instructor's
    non-strict JSON_SCHEMA ran on in an extra key to max_tokens."""
    import xgrammar as xgr

    def accepts(schema: dict[str, object], value: object) -> bool:
        grammar = compiler.compile(GuidedSpec(GuideKind.JSON_SCHEMA, source=json.dumps(schema))).grammar
        return bool(xgr.GrammarMatcher(grammar).accept_string(json.dumps(value)))
    declared: dict[str, object] = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert accepts(declared, {"a": 1})
    assert not accepts(declared, {"a": 1, "b": 2})
    assert not accepts({"type": "array", "prefixItems": [{"type": "integer"}]}, [1, 2])
    assert accepts({**declared, "additionalProperties": True}, {"a": 1, "b": "x"})
    assert accepts({**declared, "additionalProperties": {"type": "integer"}}, {"a": 1, "b": 2})
    assert not accepts({**declared, "additionalProperties": {"type": "integer"}}, {"a": 1, "b": "x"})
    assert accepts({"type": "object"}, {"b": {"c": [1]}})  # a bare object is any object
    assert accepts({"type": "object", "properties": {"o": {"type": "object"}}}, {"o": {"z": 1}})
