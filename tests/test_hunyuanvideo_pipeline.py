"""HunyuanVideo pipelines against diffusers: sampling + decode given the same embeddings and noise
(HunyuanVideoPipeline; HunyuanVideoImageToVideoPipeline with token_replace and latent_concat), the
prompt conditioning end to end (template, crop, Llama hidden layer, CLIP pooled; LLaVA with the
image's tokens), and sampling on a mesh with two offload pools."""
import numpy as np
import pytest
import torch

from tests.refutil import assert_parity, perturb, to_numpy

DIT = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1, num_single_layers=2,
           num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=24, pooled_projection_dim=20,
           rope_axes_dim=(4, 6, 6))
VAE = dict(latent_channels=4, block_out_channels=(8, 16, 16), layers_per_block=1, norm_num_groups=4,
           spatial_compression_ratio=4, down_block_types=("HunyuanVideoDownBlock3D",) * 3,
           up_block_types=("HunyuanVideoUpBlock3D",) * 3)  # 4x spatial: shorter compiles
CASES = {"t2v": {}, "token_replace": dict(image_condition_type="token_replace"),
         "latent_concat": dict(image_condition_type="latent_concat", in_channels=9, guidance_embeds=False)}


def _conditioning(seed=0):
    rng = np.random.default_rng(seed)
    return dict(embeds=rng.standard_normal((1, 7, 24)).astype(np.float32),
                mask=np.array([[1] * 5 + [0] * 2], np.float32), pooled=rng.standard_normal((1, 20)).astype(np.float32))


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_parity(tmp_path, case):
    """3 steps of the reference pipeline (same embeddings, mask, pooled vector, initial noise and
    image), final latents and decoded frames."""
    import PIL.Image
    from diffusers import (AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoImageToVideoPipeline,
                           HunyuanVideoPipeline, HunyuanVideoTransformer3DModel)

    from vidax.models.hunyuanvideo.pipeline import HunyuanVideoI2V, HunyuanVideoT2V

    torch.manual_seed(0)
    tr = perturb(HunyuanVideoTransformer3DModel(**{**DIT, **CASES[case]}), seed=1)
    vae = perturb(AutoencoderKLHunyuanVideo(**VAE), seed=2)
    common = dict(text_encoder=None, tokenizer=None, transformer=tr, vae=vae, text_encoder_2=None, tokenizer_2=None,
                  scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0))
    i2v = case != "t2v"
    pipe = HunyuanVideoImageToVideoPipeline(**common, image_processor=None) if i2v else HunyuanVideoPipeline(**common)
    pipe.save_pretrained(tmp_path)
    c = _conditioning()
    rng = np.random.default_rng(1)
    lat = rng.standard_normal((1, 4, 3, 4, 8)).astype(np.float32)
    img = (rng.random((40, 50, 3)) * 255).astype(np.uint8)
    kw = dict(prompt_embeds=torch.from_numpy(c["embeds"]), prompt_attention_mask=torch.from_numpy(c["mask"]),
              pooled_prompt_embeds=torch.from_numpy(c["pooled"]), latents=torch.from_numpy(lat), num_inference_steps=3,
              guidance_scale=6.0, height=16, width=32, num_frames=9)
    if i2v:
        kw["image"] = PIL.Image.fromarray(img)
    seen = {}

    def grab(pipe_, i, t, tensors):  # the final latents, before the reference decodes them
        seen["latents"] = tensors["latents"].numpy().copy()
        return tensors

    with torch.no_grad():
        ref = pipe(**kw, output_type="np", callback_on_step_end=grab).frames
    ref_lat = seen["latents"]
    vx = (HunyuanVideoI2V if i2v else HunyuanVideoT2V)(tmp_path)
    image_latents = vx.encode_image(img, 16, 32, tiling=False) if i2v else None
    z = vx.sample_latents(c, latents=lat, steps=3, guidance=6.0, height=16, width=32, num_frames=9,
                          image_latents=image_latents)
    assert_parity(z, ref_lat, what=f"{type(pipe).__name__} {case} latents")
    video = vx.decode_video(z, tiling=False)
    assert video.shape == ref.shape == (1, 5 if case == "latent_concat" else 9, 16, 32, 3)
    assert_parity(video, ref, what=f"{type(pipe).__name__} {case} frames")
    # the persisted decode stages: tile ranges with the tail carried, the dropped frames included
    frames, tail = vx.decode_frames(z, 0, 1, tiling=False)
    assert tail is None and frames.shape[1] == video.shape[1]


# ----------------------------------------------------------------------------------- prompts
def _tokenizer(folder, corpus, end_token=None):
    """A tiny Llama-3-style byte-level BPE tokenizer (BOS prepended; the template's special tokens
    whole; ``system`` and blank lines single tokens so ``<image>`` sits at index 5 as in the release)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<pad>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<image>",
                "<|endoftext|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=420, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens(["system", "\n\n"])
    bos = tok.token_to_id("<|begin_of_text|>")
    single = "<|begin_of_text|> $A" + (f" {end_token}" if end_token else "")
    sp = [("<|begin_of_text|>", bos)] + ([(end_token, tok.token_to_id(end_token))] if end_token else [])
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=sp)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", pad_token="<pad>",
                                   eos_token=end_token or "<|eot_id|>", padding_side="right")
    fast.save_pretrained(folder)
    return fast


PROMPTS = ["a red fox jumps over a frozen creek at dawn", "rain"]


@pytest.fixture(scope="module")
def text_models():
    from transformers import LlamaConfig, LlamaModel

    from vidax.models.hunyuanvideo import text as htext

    torch.manual_seed(0)
    llama = perturb(LlamaModel(LlamaConfig(vocab_size=440, hidden_size=24, intermediate_size=40, num_hidden_layers=4,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=6)), seed=4)
    corpus = [htext.T2V_TEMPLATE, htext.I2V_TEMPLATE] + PROMPTS * 3
    return llama, corpus


def _clip(tok2):
    from transformers import CLIPTextConfig, CLIPTextModel

    return perturb(CLIPTextModel(CLIPTextConfig(vocab_size=440, hidden_size=20, intermediate_size=32, num_hidden_layers=2,
                                                num_attention_heads=2, max_position_embeddings=77,
                                                eos_token_id=tok2.convert_tokens_to_ids("<|endoftext|>"))), seed=5)


def test_t2v_prompt_conditioning(tmp_path, text_models):
    """HunyuanVideoPipeline.encode_prompt: template, 256 + crop_start tokens, hidden_states[-3],
    crop, mask; CLIP pooled; vs vidax from the saved pipeline folder."""
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline

    from vidax.models.hunyuanvideo.pipeline import HunyuanVideoT2V

    llama, corpus = text_models
    tok = _tokenizer(tmp_path / "t1", corpus)
    tok2 = _tokenizer(tmp_path / "t2", corpus, end_token="<|endoftext|>")
    pipe = HunyuanVideoPipeline(text_encoder=llama, tokenizer=tok, transformer=None, vae=None, text_encoder_2=_clip(tok2),
                                tokenizer_2=tok2, scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0))
    with torch.no_grad():
        emb, pooled, mask = pipe.encode_prompt(prompt=PROMPTS, device="cpu")
    assert emb.shape == (2, 256, 24) and int(mask.sum()) > 2
    pipe.save_pretrained(tmp_path / "pipe")
    vx = HunyuanVideoT2V.__new__(HunyuanVideoT2V)  # only the text components are in this folder
    vx.preset, vx._folder, vx.image_to_video, vx.pipeline_class = None, tmp_path / "pipe", False, "HunyuanVideoPipeline"
    out = vx.encode_prompts(PROMPTS)
    assert_parity(out["embeds"], to_numpy(emb), what="HunyuanVideo prompt embeds (Llama hidden_states[-3], cropped)")
    np.testing.assert_array_equal(out["mask"], mask.numpy())
    assert_parity(out["pooled"], to_numpy(pooled), what="HunyuanVideo pooled CLIP-L text")


def test_i2v_prompt_conditioning(tmp_path, text_models):
    """HunyuanVideoImageToVideoPipeline.encode_prompt: the <image> token expanded to the image's
    576 LLaVA tokens (CLIP ViT/336 penultimate, projector), hidden_states[-3], the image's states
    (every 4th, token_replace) then the prompt's with the template prefix and the assistant header
    cut out."""
    import PIL.Image
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    from vidax.models.hunyuanvideo.pipeline import HunyuanVideoI2V

    llama, corpus = text_models
    tok = _tokenizer(tmp_path / "t1", corpus)
    tok2 = _tokenizer(tmp_path / "t2", corpus, end_token="<|endoftext|>")
    vc = CLIPVisionConfig(image_size=336, patch_size=14, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                          num_attention_heads=2)
    cfg = LlavaConfig(vision_config=vc, text_config=llama.config, image_token_index=tok.convert_tokens_to_ids("<image>"),
                      pad_token_id=tok.pad_token_id, vision_feature_layer=-2, projector_hidden_act="gelu")
    torch.manual_seed(0)
    llava = LlavaForConditionalGeneration(cfg)
    llava.model.language_model.load_state_dict(llama.state_dict())
    perturb(llava.model.vision_tower, seed=6)
    perturb(llava.model.multi_modal_projector, seed=7)
    proc = CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    pipe = HunyuanVideoImageToVideoPipeline(text_encoder=llava.eval(), tokenizer=tok, transformer=None, vae=None,
                                            text_encoder_2=_clip(tok2), tokenizer_2=tok2, image_processor=proc,
                                            scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0))
    img = (np.random.default_rng(3).random((90, 120, 3)) * 255).astype(np.uint8)
    with torch.no_grad():
        emb, pooled, mask = pipe.encode_prompt(image=PIL.Image.fromarray(img), prompt=PROMPTS[:1], device="cpu",
                                               image_embed_interleave=4)
    pipe.save_pretrained(tmp_path / "pipe")
    import json

    (tmp_path / "pipe" / "transformer").mkdir(exist_ok=True)  # the condition type decides the interleave
    (tmp_path / "pipe" / "transformer" / "config.json").write_text(json.dumps({"image_condition_type": "token_replace"}))
    vx = HunyuanVideoI2V.__new__(HunyuanVideoI2V)
    vx.preset, vx._folder, vx.image_to_video = None, tmp_path / "pipe", True
    vx.config_folder, vx.pipeline_class = tmp_path / "pipe", "HunyuanVideoImageToVideoPipeline"
    out = vx.encode_prompts(PROMPTS[:1], pixel_values=vx.llava_pixels(img))
    assert out["embeds"].shape == tuple(emb.shape) and emb.shape[1] == 576 // 4 + 252
    assert_parity(out["embeds"], to_numpy(emb), what="HunyuanVideo I2V prompt embeds (LLaVA with the image)")
    np.testing.assert_array_equal(out["mask"], mask.numpy())
    assert_parity(out["pooled"], to_numpy(pooled), what="HunyuanVideo I2V pooled CLIP-L text")


# ----------------------------------------------------------------------------------- scale
def test_sampling_on_a_mesh_with_two_pools():
    """The tiny preset's sampling on tp=2 x sp=2 with both block stacks offloaded (chunk sizes of
    their own) equals one device; true CFG (a batch of two) on the way."""
    from vidax.models.hunyuanvideo.pipeline import HunyuanVideoT2V

    rng = np.random.default_rng(0)
    c = dict(embeds=rng.standard_normal((1, 6, 32)).astype(np.float32), mask=np.array([[1, 1, 1, 1, 0, 0]]),
             pooled=rng.standard_normal((1, 24)).astype(np.float32))
    u = dict(c, embeds=c["embeds"][:, ::-1].copy(), mask=np.array([[1, 1, 0, 0, 0, 0]]))
    kw = dict(seed=3, height=32, width=32, num_frames=5, steps=2, guidance=4.0, true_cfg=2.5)
    ref = HunyuanVideoT2V("tiny").sample_latents(c, u, **kw)
    out = HunyuanVideoT2V("tiny", mesh="tp=2,sp=2", offload_chunk_size="double=1,single=2").sample_latents(c, u, **kw)
    err = float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
    print(f"tiny sampling tp=2,sp=2 + two pools vs one device: {err:.2e}")
    assert err < 1e-5


def test_schedule_matches_the_pipelines_scheduler():
    """``sigmas = linspace(1, 0, N + 1)[:-1]`` through FlowMatchEulerDiscreteScheduler(shift=7):
    every timestep, sigma and Euler step of a whole 50-step schedule."""
    import jax.numpy as jnp
    from diffusers import FlowMatchEulerDiscreteScheduler

    from vidax.models.hunyuanvideo.pipeline import HunyuanVideoT2V

    ref = FlowMatchEulerDiscreteScheduler(shift=7.0)
    ref.set_timesteps(sigmas=np.linspace(1.0, 0.0, 51)[:-1])
    ours = HunyuanVideoT2V("tiny").scheduler(50, 7.0)
    np.testing.assert_allclose(ours.timesteps, ref.timesteps.numpy(), rtol=1e-6)
    np.testing.assert_allclose(ours.sigmas, ref.sigmas.numpy(), rtol=1e-6, atol=1e-7)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 4, 2, 3, 3)).astype(np.float32)
    xr, xo = torch.from_numpy(x), jnp.asarray(x)
    for i, t in enumerate(ref.timesteps):
        v = rng.standard_normal(x.shape).astype(np.float32)
        xr = ref.step(torch.from_numpy(v), t, xr).prev_sample
        xo, _ = ours.step({}, jnp.asarray(v), jnp.int32(i), xo)
    assert_parity(np.asarray(xo), xr.numpy(), what="flow-match Euler, 50 steps, shift 7")


def test_a_second_run_compiles_nothing():
    """One step program per settings for the process: a batch of prompts compiles it once."""
    from vidax.core.jit import CompileCounter
    from vidax.models.hunyuanvideo.pipeline import HunyuanVideoT2V

    pipe = HunyuanVideoT2V("tiny")
    rng = np.random.default_rng(0)
    c = dict(embeds=rng.standard_normal((1, 6, 32)).astype(np.float32), mask=np.array([[1, 1, 1, 1, 0, 0]]),
             pooled=rng.standard_normal((1, 24)).astype(np.float32))
    dit = pipe.load_dit()
    kw = dict(height=32, width=32, num_frames=5, steps=3, dit=dit)
    a = pipe.sample_latents(c, seed=1, **kw)
    with CompileCounter() as cc:
        b = pipe.sample_latents(c, seed=2, **kw)
    assert cc.count == 0 and np.abs(a - b).mean() > 1e-3


def test_offload_spec_per_pool_is_validated_early():
    from stages.request import Request, RequestError, validate

    r = validate(Request(model="hunyuanvideo-t2v", preset="tiny", prompt="a fox", offload_chunk_size="double=1,single=2"))
    assert r.offload_chunk_size == "double=1,single=2"
    with pytest.raises(RequestError, match="offload_chunk_size: double blocks: offload_chunk_size=3 does not divide"):
        validate(Request(model="hunyuanvideo-t2v", preset="tiny", prompt="a fox", offload_chunk_size="double=3"))
    with pytest.raises(RequestError, match="or give each pool its own"):
        validate(Request(model="hunyuanvideo-t2v", preset="tiny", prompt="a fox", offload_chunk_size=3))


def test_decode_stages_concatenate_to_the_whole_decode():
    """latent_concat I2V over 3 temporal tiles: the stages (tile ranges, tail carried, the first 4
    frames dropped in the first) give bitwise the frames of one decode."""
    from vidax.models.hunyuanvideo.pipeline import HunyuanVideoI2V
    from vidax.pipeline import to_uint8

    p = HunyuanVideoI2V("tiny-i2v-33ch")
    z = np.random.default_rng(0).standard_normal((1, 16, 9, 2, 2)).astype(np.float32)
    vae = p.load_vae()
    whole = to_uint8(p.decode_video(z, vae))
    assert p._tiles(9, True) == [(0, 5), (3, 8), (6, 9)] and whole.shape[1] == 33 - 4
    parts, tail = [], None
    for k in range(3):
        f, tail = p.decode_frames(z, k, k + 1, tail, vae)
        parts.append(f)
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), whole)


def test_true_cfg_without_a_negative_prompt_follows_the_pipeline():
    """``HunyuanVideoPipeline`` runs true CFG only when ``true_cfg_scale > 1`` and a negative prompt
    is given (``do_true_cfg = true_cfg_scale > 1 and has_neg_prompt``): without one, vidax warns at
    validation and runs embedded guidance alone (no negative encode, no batch of two, the stage keys
    of true_cfg 1); with one (even ``""``), true CFG runs."""
    import inspect

    from diffusers import HunyuanVideoPipeline

    from stages import run as R
    from stages.request import Request, validate
    from vidax.models.hunyuanvideo.pipeline import TrueCfgWarning

    src = inspect.getsource(HunyuanVideoPipeline.__call__)
    assert "do_true_cfg = true_cfg_scale > 1 and has_neg_prompt" in src  # the rule followed
    base = dict(model="hunyuanvideo-t2v", prompt="a red kite", height=32, width=32, num_frames=5, steps=1)
    with pytest.warns(TrueCfgWarning, match="no effect without a negative prompt"):
        asked = validate(Request(**base, options={"true_cfg": 4.0}))
    plain = validate(Request(**base))
    pipe = R.make_pipeline(asked)
    keys = R.stage_keys(asked, pipe)
    assert keys == R.stage_keys(plain, R.make_pipeline(plain))
    enc = pipe.encode(asked)
    assert "negative_embeds" not in enc
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", TrueCfgWarning)
        neg = validate(Request(**base, negative_prompt="", options={"true_cfg": 4.0}))
    assert R.stage_keys(neg, R.make_pipeline(neg))["sample"] != keys["sample"]
    enc = R.make_pipeline(neg).encode(neg)
    assert enc["negative_embeds"].array.shape == enc["prompt_embeds"].array.shape
