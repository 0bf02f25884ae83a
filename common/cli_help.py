"""`--help` of every service shows each flag's default (unless its help already says it)."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        quiet = action.default in (None, False, argparse.SUPPRESS) or action.default == []
        if quiet or not action.option_strings or "%(default)" in text or "default" in text.lower():
            return action.help
        return f"{text} (default: %(default)s)"
