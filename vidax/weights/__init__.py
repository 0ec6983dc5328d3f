"""Checkpoint readers, checkpoint sources (local or any fsspec URL, cached), key maps and
host-side casting."""
from .io import (Checkpoint, CheckpointFormatError, CheckpointPickleError, HeadersChecked, LazyTensor, headers_only,
                 open_checkpoint, save_safetensors)
from .keymap import (CheckpointMismatchError, KeyMap, Rule, int_keys, linear_rules, load_checkpoint_params, load_params,
                     str_keys)
from .source import FetchProgress, check_source, is_url, resolve_source
from .views import Derived, View, view_of

__all__ = [
    "Checkpoint", "CheckpointFormatError", "CheckpointPickleError", "HeadersChecked", "headers_only", "LazyTensor",
    "open_checkpoint", "save_safetensors",
    "CheckpointMismatchError", "KeyMap", "Rule", "int_keys", "linear_rules", "load_checkpoint_params", "load_params",
    "str_keys", "Derived", "View", "view_of",
    "FetchProgress", "check_source", "is_url", "resolve_source",
]
