"""Guided (constrained) decoding: a grammar per request, compiled with xgrammar, and one
matcher per sequence that masks the tokens the grammar cannot take next."""

from engine.guided.compiler import GuidedCompiler, GuidedError
from engine.guided.formats import ModelFormats, infer_formats
from engine.guided.matcher import AfterReasoning, CompiledGuide, GrammarGuide, ReasoningTokens
from engine.guided.spec import GuideKind, GuidedSpec

__all__ = ["AfterReasoning", "ReasoningTokens", "CompiledGuide", "GrammarGuide", "GuideKind", "GuidedCompiler", "GuidedError", "GuidedSpec",
           "ModelFormats", "infer_formats"]
