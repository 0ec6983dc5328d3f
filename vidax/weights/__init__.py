"""Checkpoint readers, checkpoint sources (local or any fsspec URL, cached), key maps and
host-side casting."""
from .io import (Checkpoint, CheckpointFormatError, CheckpointPickleError, HeadersChecked, LazyTensor, headers_only,
                 open_checkpoint, save_safetensors)
from .keymap import CheckpointMismatchError, KeyMap, Rule, load_checkpoint_params, load_params
from .source import FetchProgress, check_source, is_url, resolve_source

__all__ = [
    "Checkpoint", "CheckpointFormatError", "CheckpointPickleError", "HeadersChecked", "headers_only", "LazyTensor", "open_checkpoint", "save_safetensors",
    "CheckpointMismatchError", "KeyMap", "Rule", "load_checkpoint_params", "load_params",
    "FetchProgress", "check_source", "is_url", "resolve_source",
]
