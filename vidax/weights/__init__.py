"""Checkpoint readers, key maps and host-side casting."""
from .io import Checkpoint, LazyTensor, open_checkpoint, save_safetensors
from .keymap import CheckpointMismatchError, KeyMap, Rule, load_checkpoint_params, load_params

__all__ = [
    "Checkpoint", "LazyTensor", "open_checkpoint", "save_safetensors",
    "CheckpointMismatchError", "KeyMap", "Rule", "load_checkpoint_params", "load_params",
]
