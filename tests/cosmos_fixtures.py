"""Tiny reference folders for the Cosmos tests: a byte-level BPE tokenizer with Qwen's special tokens
and ChatML template, a tiny Qwen2.5-VL, CosmosTransformer3DModel and AutoencoderKLWan (every weight
perturbed), saved as a diffusers ``Cosmos2_5_PredictBasePipeline`` folder; and stand-ins for the
torchvision functions diffusers' Cosmos code calls (torchvision is not installed here)."""
from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import torch

from tests.refutil import perturb

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}{% if content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")
CORPUS = ["A red panda paddles a canoe across a misty lake at dawn.", "The video captures a robot arm welding.",
          "You are a helpful assistant who will provide prompts to an image generator.",
          "static with no motion, motion blur, over-saturation, shaky footage, low resolution, grainy texture"]


def install_torchvision_shims():
    """diffusers' Cosmos code uses torchvision for a NEAREST tensor resize (which torchvision does with
    ``torch.nn.functional.interpolate(mode="nearest")``) and ``to_tensor`` (HWC uint8 -> CHW / 255)."""
    import diffusers.models.transformers.transformer_cosmos as tc
    import diffusers.pipelines.cosmos.pipeline_cosmos2_5_predict as pc

    def resize(img, size, interpolation=None):
        return torch.nn.functional.interpolate(img, size=list(size), mode="nearest")

    def to_tensor(pic):
        a = np.asarray(pic.convert("RGB") if hasattr(pic, "convert") else pic)
        return torch.from_numpy(a.copy()).permute(2, 0, 1).float() / 255.0

    fn = types.SimpleNamespace(resize=resize, to_tensor=to_tensor)
    tc.transforms = types.SimpleNamespace(functional=fn, InterpolationMode=types.SimpleNamespace(NEAREST="nearest"))
    pc.torchvision = types.SimpleNamespace(transforms=types.SimpleNamespace(functional=fn))


def make_tokenizer(folder: Path, chat_template: str = CHATML, vocab: int = 400):
    """A byte-level BPE ``tokenizer.json`` + ``tokenizer_config.json`` (pad ``<|endoftext|>``, eos
    ``<|im_end|>``, the chat template), loadable by transformers and by vidax."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<|endoftext|>", "eos_token": "<|im_end|>",
        "chat_template": chat_template, "model_max_length": 4096}))
    return tok


class DummySafety:
    def to(self, *a, **k):
        return self

    def check_text_safety(self, prompt):
        return True


def qwen25vl(vocab: int, seed: int = 3):
    import transformers

    text = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
    cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32, fullatt_block_indexes=[0]))
    torch.manual_seed(seed)
    return perturb(transformers.Qwen2_5_VLForConditionalGeneration(cfg), seed=seed)


DIT = dict(in_channels=17, out_channels=16, num_attention_heads=2, attention_head_dim=12, num_layers=2, mlp_ratio=2.0,
           text_embed_dim=16, adaln_lora_dim=8, max_size=(16, 64, 64), patch_size=(1, 2, 2), rope_scale=(1.0, 3.0, 3.0),
           concat_padding_mask=True, extra_pos_embed_type=None, use_crossattn_projection=True,
           crossattn_proj_in_channels=3 * 32, encoder_hidden_states_channels=16)
VAE21 = dict(base_dim=16, z_dim=16, num_res_blocks=1, latents_mean=[0.03 * i - 0.2 for i in range(16)],
             latents_std=[0.7 + 0.04 * i for i in range(16)])
SCHED = dict(use_karras_sigmas=True, use_flow_sigmas=True, prediction_type="flow_prediction", sigma_max=200.0,
             sigma_min=0.01)


def predict25_folder(folder: Path):
    """A diffusers Cosmos2_5_PredictBasePipeline folder of tiny perturbed components; returns the
    reference pipeline built from the same modules."""
    from diffusers import (AutoencoderKLWan, Cosmos2_5_PredictBasePipeline, CosmosTransformer3DModel,
                           UniPCMultistepScheduler)
    from transformers import AutoTokenizer

    install_torchvision_shims()
    make_tokenizer(folder / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    text_encoder = qwen25vl(len(tokenizer))
    torch.manual_seed(0)
    transformer = perturb(CosmosTransformer3DModel(**DIT), seed=1)
    torch.manual_seed(1)
    vae = perturb(AutoencoderKLWan(**VAE21), seed=2)
    scheduler = UniPCMultistepScheduler(**SCHED)
    text_encoder.save_pretrained(folder / "text_encoder")
    transformer.save_pretrained(folder / "transformer")
    vae.save_pretrained(folder / "vae")
    scheduler.save_pretrained(folder / "scheduler")
    (folder / "model_index.json").write_text(json.dumps({
        "_class_name": "Cosmos2_5_PredictBasePipeline", "_diffusers_version": "0.42.1",
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"], "transformer": ["diffusers", "CosmosTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"], "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "safety_checker": [None, None]}))
    pipe = Cosmos2_5_PredictBasePipeline(text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
                                         vae=vae, scheduler=scheduler, safety_checker=DummySafety())
    pipe.set_progress_bar_config(disable=True)
    return pipe


MOT = dict(head_dim=12, hidden_act="silu", hidden_size=24, intermediate_size=40, latent_channel=8, latent_patch_size=2,
           num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2, patch_latent_dim=32, qk_norm_for_text=True,
           rms_norm_eps=1e-6, rope_axes_dim=[2, 2, 2], rope_theta=10000.0)
VAE22 = dict(base_dim=8, decoder_base_dim=16, z_dim=8, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
             temperal_downsample=[False, True, True], is_residual=True, patch_size=2, in_channels=12, out_channels=12,
             scale_factor_spatial=16, scale_factor_temporal=4, latents_mean=[0.05 * i - 0.1 for i in range(8)],
             latents_std=[0.8 + 0.05 * i for i in range(8)])
COSMOS3_SCHED = dict(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=10.0, use_karras_sigmas=False)


def cosmos3_folder(folder: Path, **mot_overrides):
    """A diffusers Cosmos3OmniPipeline folder of tiny perturbed components; returns the reference
    pipeline built from the same modules."""
    from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline, Cosmos3OmniTransformer, UniPCMultistepScheduler
    from transformers import AutoTokenizer

    make_tokenizer(folder / "text_tokenizer")
    tok = AutoTokenizer.from_pretrained(folder / "text_tokenizer")
    torch.manual_seed(0)
    transformer = perturb(Cosmos3OmniTransformer(**{**MOT, "vocab_size": len(tok), **mot_overrides}), seed=1)
    torch.manual_seed(1)
    vae = perturb(AutoencoderKLWan(**VAE22), seed=2)
    scheduler = UniPCMultistepScheduler(**COSMOS3_SCHED)
    transformer.save_pretrained(folder / "transformer")
    vae.save_pretrained(folder / "vae")
    scheduler.save_pretrained(folder / "scheduler")
    (folder / "model_index.json").write_text(json.dumps({
        "_class_name": "Cosmos3OmniPipeline", "_diffusers_version": "0.42.1",
        "transformer": ["diffusers", "Cosmos3OmniTransformer"], "text_tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "vae": ["diffusers", "AutoencoderKLWan"], "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "sound_tokenizer": [None, None], "safety_checker": [None, None], "enable_safety_checker": False,
        "default_use_system_prompt": True, "use_native_flow_schedule": False}))
    pipe = Cosmos3OmniPipeline(transformer=transformer, text_tokenizer=tok, vae=vae, scheduler=scheduler,
                               enable_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe
