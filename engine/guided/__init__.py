"""Guided (constrained) decoding: a grammar per request, compiled with xgrammar, and one
matcher per sequence that masks the tokens the grammar cannot take next."""

from engine.guided.compiler import GuidedCompiler, GuidedError
from engine.guided.formats import ModelFormats, infer_formats
from engine.guided.matcher import CompiledGuide, GrammarGuide
from engine.guided.spec import GuideKind, GuidedSpec

__all__ = ["CompiledGuide", "GrammarGuide", "GuideKind", "GuidedCompiler", "GuidedError", "GuidedSpec",
           "ModelFormats", "infer_formats"]
