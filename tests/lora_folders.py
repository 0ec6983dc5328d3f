"""Complete tiny diffusers checkpoint folders (tokenizers, text encoders, DiT, VAE, scheduler, all
saved by ``save_pretrained``) that ``vidax generate`` runs end to end, one per family with a
diffusers LoRA loader (and HunyuanVideo-I2V's, whose text encoder is a LLaVA), and the request each
runs (a few steps, the smallest size). Built from the parity tests' tiny configs; used by
``tests/test_lora_generate.py`` and ``tests/test_bad_inputs_checkpoints.py``."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tests.refutil import perturb


def _index(folder: Path, **components):
    p = folder / "model_index.json"
    index = json.loads(p.read_text()) if p.exists() else {}
    index.update(components)
    p.write_text(json.dumps(index))


def _t5(folder: Path, d_model: int, seed: int):
    import transformers

    from tests.test_t5 import _train_tokenizer_json

    _train_tokenizer_json(folder / "tokenizer")
    torch.manual_seed(0)
    enc = perturb(transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=150, d_model=d_model, d_kv=8, d_ff=40, num_layers=2, num_heads=3, feed_forward_proj="gated-gelu")),
        seed=seed)
    enc.save_pretrained(folder / "text_encoder")
    _index(folder, text_encoder=["transformers", "T5EncoderModel"], tokenizer=["transformers", "T5TokenizerFast"])


def cogvideox(folder: Path) -> list[str]:
    from tests.test_cogvideox_pipeline import _ref_pipeline

    _ref_pipeline("2b-ddim", folder)
    _t5(folder, 20, seed=3)
    return ["--prompt", "a fox", "--model", "cogvideox-2b", "--height", "32", "--width", "48", "--frames", "9", "--guidance", "6",
            "--vae-tiling", "false"]


def ltx(folder: Path) -> list[str]:
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXVideoTransformer3DModel

    from tests.test_ltx_pipeline import DIT, SCHED, VAE

    torch.manual_seed(0)
    perturb(LTXVideoTransformer3DModel(**DIT), seed=1).save_pretrained(folder / "transformer")
    vae = perturb(AutoencoderKLLTXVideo(**VAE), seed=2)
    with torch.no_grad():
        vae.latents_mean.add_(0.1 * torch.randn(8))
        vae.latents_std.add_(0.1 * torch.rand(8))
    vae.save_pretrained(folder / "vae")
    FlowMatchEulerDiscreteScheduler(**SCHED).save_pretrained(folder / "scheduler")
    _index(folder, _class_name="LTXPipeline", transformer=["diffusers", "LTXVideoTransformer3DModel"],
           vae=["diffusers", "AutoencoderKLLTXVideo"], scheduler=["diffusers", "FlowMatchEulerDiscreteScheduler"])
    _t5(folder, DIT["caption_channels"], seed=4)
    return ["--prompt", "a fox in snow", "--model", "ltx-video-0.9", "--height", "32", "--width", "32", "--frames", "9",
            "--guidance", "3"]


BUILDERS = {"cogvideox": cogvideox, "ltx": ltx}


def ltx2(folder: Path) -> list[str]:
    import transformers
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    from tests.test_ltx2_pipeline import AVAE, CONN, DIT, SCHED, VAE, VOC
    from tests.test_t5 import _train_tokenizer_json

    torch.manual_seed(0)
    parts = dict(transformer=perturb(LTX2VideoTransformer3DModel(**DIT), seed=1),
                 connectors=perturb(LTX2TextConnectors(**CONN), seed=2), vae=perturb(AutoencoderKLLTX2Video(**VAE), seed=3),
                 audio_vae=perturb(AutoencoderKLLTX2Audio(**AVAE), seed=4), vocoder=perturb(LTX2Vocoder(**VOC), seed=5),
                 scheduler=FlowMatchEulerDiscreteScheduler(**SCHED))
    # Gemma 3: every layer's hidden states (num_hidden_layers + 1 = text_proj_in_factor) of caption_channels
    gemma = transformers.Gemma3TextConfig(vocab_size=150, hidden_size=CONN["caption_channels"], intermediate_size=32,
                                          num_hidden_layers=CONN["text_proj_in_factor"] - 1, num_attention_heads=2,
                                          num_key_value_heads=1, head_dim=8, sliding_window=4, query_pre_attn_scalar=8,
                                          sliding_window_pattern=2)
    parts["text_encoder"] = perturb(transformers.Gemma3TextModel(gemma), seed=6)
    for name, mod in parts.items():
        mod.save_pretrained(folder / name)
    _train_tokenizer_json(folder / "tokenizer")
    _index(folder, _class_name="LTX2Pipeline")
    return ["--prompt", "a fox in snow", "--model", "ltx2-t2v", "--height", "32", "--width", "32", "--frames", "9",
            "--guidance", "3"]


BUILDERS["ltx2"] = ltx2


def hunyuanvideo(folder: Path) -> list[str]:
    from diffusers import (AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline,
                           HunyuanVideoTransformer3DModel)
    from transformers import LlamaConfig, LlamaModel

    from tests.test_hunyuanvideo_pipeline import DIT, PROMPTS, VAE, _clip, _tokenizer
    from vidax.models.hunyuanvideo import text as htext

    torch.manual_seed(0)
    llama = perturb(LlamaModel(LlamaConfig(vocab_size=440, hidden_size=DIT["text_embed_dim"], intermediate_size=40,
                                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=6)), seed=4)
    corpus = [htext.T2V_TEMPLATE, htext.I2V_TEMPLATE] + PROMPTS * 3
    tok = _tokenizer(folder / "t1", corpus)
    tok2 = _tokenizer(folder / "t2", corpus, end_token="<|endoftext|>")
    clip = _clip(tok2)
    assert clip.config.hidden_size == DIT["pooled_projection_dim"]
    pipe = HunyuanVideoPipeline(text_encoder=llama, tokenizer=tok, text_encoder_2=clip, tokenizer_2=tok2,
                                transformer=perturb(HunyuanVideoTransformer3DModel(**DIT), seed=1),
                                vae=perturb(AutoencoderKLHunyuanVideo(**VAE), seed=2),
                                scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0))
    pipe.save_pretrained(folder)
    shutil.rmtree(folder / "t1")
    shutil.rmtree(folder / "t2")
    return ["--prompt", PROMPTS[0], "--model", "hunyuanvideo-t2v", "--height", "32", "--width", "32", "--frames", "5",
            "--guidance", "6"]


def hunyuanvideo_i2v(folder: Path) -> list[str]:
    """HunyuanVideo-I2V (token replace): the text encoder a LLaVA (CLIP vision tower, projector, Llama)."""
    from diffusers import (AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler,
                           HunyuanVideoImageToVideoPipeline, HunyuanVideoTransformer3DModel)
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlamaModel, LlavaConfig,
                              LlavaForConditionalGeneration)

    from tests.test_hunyuanvideo_pipeline import DIT, PROMPTS, VAE, _clip, _tokenizer
    from vidax.models.hunyuanvideo import text as htext

    torch.manual_seed(0)
    llama = perturb(LlamaModel(LlamaConfig(vocab_size=440, hidden_size=DIT["text_embed_dim"], intermediate_size=40,
                                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=6)), seed=4)
    corpus = [htext.T2V_TEMPLATE, htext.I2V_TEMPLATE] + PROMPTS * 3
    tok = _tokenizer(folder / "t1", corpus)
    tok2 = _tokenizer(folder / "t2", corpus, end_token="<|endoftext|>")
    vc = CLIPVisionConfig(image_size=336, patch_size=14, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                          num_attention_heads=2)
    cfg = LlavaConfig(vision_config=vc, text_config=llama.config, image_token_index=tok.convert_tokens_to_ids("<image>"),
                      pad_token_id=tok.pad_token_id, vision_feature_layer=-2, projector_hidden_act="gelu")
    llava = LlavaForConditionalGeneration(cfg)
    llava.model.language_model.load_state_dict(llama.state_dict())
    perturb(llava.model.vision_tower, seed=6)
    perturb(llava.model.multi_modal_projector, seed=7)
    proc = CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    pipe = HunyuanVideoImageToVideoPipeline(
        text_encoder=llava.eval(), tokenizer=tok, text_encoder_2=_clip(tok2), tokenizer_2=tok2, image_processor=proc,
        transformer=perturb(HunyuanVideoTransformer3DModel(**DIT, image_condition_type="token_replace"), seed=1),
        vae=perturb(AutoencoderKLHunyuanVideo(**VAE), seed=2), scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0))
    pipe.save_pretrained(folder)
    shutil.rmtree(folder / "t1")
    shutil.rmtree(folder / "t2")
    return ["--prompt", PROMPTS[0], "--model", "hunyuanvideo-i2v", "--height", "32", "--width", "32", "--frames", "5",
            "--guidance", "6"]


def cosmos(folder: Path) -> list[str]:
    from tests.cosmos_fixtures import predict25_folder

    predict25_folder(folder)
    return ["--prompt", "a fox in snow", "--model", "cosmos2.5-2b", "--height", "32", "--width", "32", "--frames", "5",
            "--guidance", "3"]


BUILDERS.update(hunyuanvideo=hunyuanvideo, cosmos=cosmos)

#: the model id each folder is run as
MODELS = {"cogvideox": "cogvideox-2b", "ltx": "ltx-video-0.9", "ltx2": "ltx2-t2v", "hunyuanvideo": "hunyuanvideo-t2v",
          "cosmos": "cosmos2.5-2b"}
