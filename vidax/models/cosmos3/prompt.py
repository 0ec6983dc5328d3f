"""The prompt format Cosmos3 was trained on, and the short-prompt check for Edge.

Cosmos3's captions are long structured JSON documents (the release's prompt upsampler, "V4.2"
templates of ``cosmos_framework.model.generator.upsampler.prompts``, turns a sentence into one):
a timestamped ``temporal_caption`` (the playback timeline, the part the generator reads most),
the ``subjects`` with their appearance, pose and action, the ``background_setting``, ``lighting``,
``aesthetics``, ``cinematography``, the style, timed ``actions`` / ``segments``, and the output
parameters (``resolution``, ``aspect_ratio``, ``duration`` as ``M:SS``, ``fps``). The pipeline then
appends its duration / resolution sentences to the JSON string, as the reference does.

:func:`format_prompt` builds that document from fields you write (it does not invent content: an
LLM upsampler does that), with the output parameters computed from the request so they always
agree with what is generated. :func:`is_structured` recognises such a prompt (a JSON object, bare
or in a fenced ``json`` block); :func:`short_prompt_warning` says when a prompt is a short,
unstructured sentence -- the case the smaller Edge model turns into flat, oversaturated,
featureless video with nothing else to flag it.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass

#: below this many words an unstructured prompt is "short" (upsampled captions run to hundreds)
SHORT_PROMPT_WORDS = 60


class ShortPromptWarning(UserWarning):
    """A short, unstructured prompt going to a model that needs the structured format."""


@dataclass
class Subject:
    """One subject (or group of identical subjects) of the scene, as the release's template lists them."""

    description: str
    appearance_details: str = ""
    relationship: str = ""
    location: str = ""  # e.g. "center foreground"
    relative_size: str = ""  # e.g. "Medium within frame"
    orientation: str = ""
    pose: str = ""
    action: str = ""
    state_changes: str = "No significant change."
    clothing: str = ""
    expression: str = ""
    gender: str = ""  # "Male" | "Female" | "Unknown" | "" (non-human)
    age: str = ""
    skin_tone_and_texture: str = ""
    facial_features: str = ""
    number_of_subjects: int = 1
    number_of_arms: int = 0
    number_of_legs: int = 0


@dataclass
class Lighting:
    conditions: str = ""
    direction: str = ""
    shadows: str = ""
    illumination_effect: str = ""


@dataclass
class Aesthetics:
    composition: str = ""
    color_scheme: str = ""
    mood_atmosphere: str = ""
    patterns: str = ""


@dataclass
class Cinematography:
    camera_motion: str = ""  # e.g. "Static", "Slow pan left", "Tracking shot"
    framing: str = ""  # e.g. "wide", "medium", "close-up"
    camera_angle: str = ""
    depth_of_field: str = ""
    focus: str = ""
    lens_focal_length: str = ""


def mss(seconds: float) -> str:
    """``M:SS`` (the format of every time field)."""
    s = max(0, int(round(seconds)))
    return f"{s // 60}:{s % 60:02d}"


def aspect_ratio(height: int, width: int) -> str:
    """The nearest of the release's aspect-ratio labels ("16,9", "9,16", "4,3", "3,4", "1,1")."""
    r = width / height
    return min(("1,1", "4,3", "3,4", "16,9", "9,16"), key=lambda a: abs(int(a.split(",")[0]) / int(a.split(",")[1]) - r))


def format_prompt(temporal_caption: str, *, num_frames: int, fps: float, height: int, width: int,
                  subjects=(), background_setting: str = "", lighting: Lighting | dict | None = None,
                  aesthetics: Aesthetics | dict | None = None, cinematography: Cinematography | dict | None = None,
                  style_medium: str = "", artistic_style: str = "", context: str = "", actions=(), segments=(),
                  transitions=(), text_and_signage_elements=(), audio_description: str = "") -> str:
    """The structured Cosmos3 video prompt (a JSON string, key order as the release's template).

    ``temporal_caption``: the timestamped timeline, e.g. "At 0:00, a red bus waits at a snowy
    intersection... At 0:03, the light turns green and it pulls away...". ``subjects``: Subject
    objects or dicts; ``actions``: ``(time "M:SS-M:SS", description)`` pairs or dicts; ``segments``:
    dicts with ``time_range``, ``description``, ``key_changes``, ``camera``. The output parameters
    come from ``num_frames`` / ``fps`` / ``height`` / ``width``; timed fields must end within the
    duration (checked)."""
    if not temporal_caption or not temporal_caption.strip():
        raise ValueError("temporal_caption is the part of the prompt the model reads most: write the timeline")
    duration = num_frames / fps
    dur = mss(duration)

    def obj(x, cls):
        if x is None:
            return asdict(cls())
        return asdict(x) if not isinstance(x, dict) else {**asdict(cls()), **x}

    def ends(t: str) -> float:
        m = re.fullmatch(r"(\d+):(\d{2})-(\d+):(\d{2})", t.strip())
        if not m:
            raise ValueError(f"time ranges are 'M:SS-M:SS', got {t!r}")
        return 60 * int(m.group(3)) + int(m.group(4))

    acts = []
    for a in actions:
        t, d = (a["time"], a["description"]) if isinstance(a, dict) else a
        if ends(t) > math.ceil(duration):
            raise ValueError(f"action {t} ends after the clip ({dur})")
        acts.append({"time": t, "description": d})
    segs = []
    for i, sgm in enumerate(segments):
        sgm = dict(sgm)
        if ends(sgm["time_range"]) > math.ceil(duration):
            raise ValueError(f"segment {sgm['time_range']} ends after the clip ({dur})")
        segs.append({"segment_index": i, "time_range": sgm["time_range"], "description": sgm.get("description", ""),
                     "key_changes": sgm.get("key_changes", ""), "camera": sgm.get("camera", "")})
    doc = {
        "temporal_caption": temporal_caption.strip(),
        "audio_description": audio_description,
        "subjects": [asdict(s) if isinstance(s, Subject) else {**asdict(Subject("")), **s} for s in subjects],
        "background_setting": background_setting,
        "lighting": obj(lighting, Lighting),
        "aesthetics": obj(aesthetics, Aesthetics),
        "cinematography": obj(cinematography, Cinematography),
        "style_medium": style_medium,
        "artistic_style": artistic_style,
        "context": context,
        "actions": acts,
        "text_and_signage_elements": list(text_and_signage_elements),
        "segments": segs,
        "transitions": list(transitions),
        "resolution": {"W": int(width), "H": int(height)},
        "aspect_ratio": aspect_ratio(height, width),
        "duration": dur,
        "fps": fps if not float(fps).is_integer() else int(fps),
    }
    return json.dumps(doc, ensure_ascii=False)


def is_structured(prompt: str | None) -> bool:
    """A JSON object (bare, or a fenced ``json`` block): the format the model was trained on."""
    s = (prompt or "").strip()
    if s.startswith("```json") or s.startswith("```\n{"):
        return True
    if s.startswith("{"):
        try:
            return isinstance(json.loads(s), dict)
        except ValueError:
            return False
    return False


def short_prompt_warning(prompt: str, model: str = "Cosmos3-Edge") -> str | None:
    """The warning text for a short unstructured prompt (None when the prompt is fine)."""
    if is_structured(prompt):
        return None
    words = len((prompt or "").split())
    if words >= SHORT_PROMPT_WORDS:
        return None
    return (f"{model}: this prompt is a short, unstructured sentence ({words} words). The smaller Cosmos3 model "
            "turns such prompts into flat, oversaturated, featureless video (no error shows it). Give it the "
            "structured JSON caption it was trained on: vidax.models.cosmos3.prompt.format_prompt(...), or the "
            "release's upsampler (python -m cosmos_framework.inference.prompt_upsampling).")
