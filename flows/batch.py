"""Prompt files for the batch flow: parsed and validated by :mod:`stages.prompts` (the same
rules as ``vidax batch``)."""
from stages.prompts import BatchLine, PromptFileError, parse_prompt_file, read_text

__all__ = ["BatchLine", "PromptFileError", "parse_prompt_file", "read_text"]
