"""Benchmark cases for the shared components and Wan, at the real widths of the released models.

Each case returns ``dict(component, config, vidax, reference, flops=None)``: two callables that
each run one forward and block until it is done (see ``benchmarks.harness.paired``).

The keyword arguments of the cases (sizes, ``dtype``, ``device``: where the PyTorch reference runs)
default to the CPU figures of the README; ``benchmarks/device.py`` calls them with an accelerator
profile (``benchmarks/device.sh``).
"""
from __future__ import annotations

import numpy as np


def _torch_on(module, device: str, dtype: str = "float32"):
    """The reference module moved to ``device`` in ``dtype`` (e.g. "cuda", "bfloat16"), eval mode,
    its ``_keep_in_fp32_modules`` left in float32 as diffusers' ``from_pretrained(torch_dtype=...)``
    loads them."""
    import torch

    module = module.to(device=device).eval()
    keep = getattr(module, "_keep_in_fp32_modules", None) or []
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.is_floating_point():
            t.data = t.data.to(torch.float32 if any(k in name for k in keep) else getattr(torch, dtype))
    return module


def _sync(device: str) -> None:
    """Block until the reference's queued GPU work is done (CPU: nothing to wait for)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _cast(tree, dtype: str):
    """Every floating leaf of a params tree in ``dtype`` (vidax computes in its params' dtype)."""
    import jax
    import jax.numpy as jnp

    dt = jnp.dtype(dtype)
    return jax.tree.map(lambda a: a.astype(dt) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def dit_1p3b(layers: int = 2, latents: tuple = (8, 32, 32), text_tokens: int = 512, dtype: str = "float32",
             device: str = "cpu", heads: int = 12, head_dim: int = 128, ffn: int = 8960, text_dim: int = 4096):
    """Wan DiT forward at the 1.3B head size and FFN ratio (dim 1536, 12 heads of 128, FFN 8960),
    2 blocks, 2048 video + 512 text tokens (latents 8x32x32, patch 1x2x2), vs diffusers'
    WanTransformer3DModel. 480p/81 frames is ``latents=(21, 60, 104)`` (32760 tokens)."""
    import jax
    import jax.numpy as jnp
    import torch
    from diffusers import WanTransformer3DModel

    from tests.refutil import perturb
    from vidax.core import nn
    from vidax.models.wan import dit
    from vidax.weights import load_params

    hd, lt = head_dim, text_tokens
    f, h, w = latents  # 8 x 16 x 16 = 2048 tokens at the default
    ref = perturb(WanTransformer3DModel(num_attention_heads=heads, attention_head_dim=hd, in_channels=16,
                                        out_channels=16, text_dim=text_dim, ffn_dim=ffn, num_layers=layers))
    cfg = dit.WanDiTConfig.from_diffusers(dict(ref.config))
    sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    params = jax.device_put(_cast(nn.fill(dit.abstract_state(cfg), load_params(sd, dit.diffusers_keymap(cfg),
                                                                                dit.param_shapes(cfg))), dtype))
    del sd
    ref = _torch_on(ref, device, dtype)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 16, f, h, w)).astype(np.float32)
    ctx = rng.standard_normal((1, lt, text_dim)).astype(np.float32)
    t = np.array([500.0], np.float32)
    fwd = jax.jit(dit.forward, static_argnums=1)
    xj, cj, tj = jnp.asarray(x.transpose(0, 2, 3, 4, 1), dtype), jnp.asarray(ctx, dtype), jnp.asarray(t)
    tdt = getattr(torch, dtype)
    xt, ct = (torch.from_numpy(a).to(device=device, dtype=tdt) for a in (x, ctx))
    tt = torch.from_numpy(t).to(device)

    def reference():
        with torch.no_grad():
            ref(hidden_states=xt, timestep=tt, encoder_hidden_states=ct, return_dict=False)
        _sync(device)

    vidax = lambda: fwd(params, cfg, xj, tj, cj).block_until_ready()  # noqa: E731
    # counted by hand: XLA's cost analysis counts the body of the query-blocked attention's scan once
    D, L, F = heads * hd, f * h * w // 4, ffn
    block = (4 * 2 * L * D * D + 4 * L * L * D  # self-attention: q/k/v/o, scores and values
             + 2 * 2 * L * D * D + 2 * 2 * lt * D * D + 4 * L * lt * D  # cross-attention
             + 2 * 2 * L * D * F)  # feed-forward
    flops = layers * block + 2 * lt * (text_dim * D + D * D) + 2 * L * 64 * D * 2
    return dict(component="DiT forward (vs diffusers WanTransformer3DModel)",
                config=f"{'1.3B widths: ' if D == 1536 else ''}dim {D}, {heads}x{hd} heads, FFN {ffn}, {layers} blocks, "
                       f"{L} video + {lt} text "
                       f"tokens{'' if dtype == 'float32' else ', ' + dtype}",
                vidax=vidax, reference=reference, flops=flops)


def umt5_xxl(layers: int = 2, tokens: int = 512, device: str = "cpu", d_model: int = 4096, heads: int = 64,
             d_ff: int = 10240):
    """UMT5-XXL encoder layers at their real width (d_model 4096, 64 heads, FFN 10240), 2 layers,
    512 tokens (200 real), vs transformers' UMT5EncoderModel. Float32 on both sides (vidax's T5
    computes in float32 whatever its parameters' dtype, as the pipelines use it)."""
    import jax.numpy as jnp
    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    from tests.refutil import perturb
    from vidax.text import t5

    hc = UMT5Config(vocab_size=4096, d_model=d_model, d_kv=64, d_ff=d_ff, num_layers=layers, num_heads=heads,
                    feed_forward_proj="gated-gelu", dropout_rate=0.0)
    ref = perturb(UMT5EncoderModel(hc))
    cfg = t5.T5Config.from_hf(hc.to_dict())
    sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    enc = t5.from_params(cfg, t5.load_params_from(sd, cfg))
    ref = _torch_on(ref, device)
    L = tokens
    rng = np.random.default_rng(0)
    ids = rng.integers(2, 4096, (1, L)).astype(np.int64)
    mask = np.zeros((1, L), np.int64)
    mask[:, :min(200, L)] = 1
    ij, mj = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)
    it, mt = torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)

    def reference():
        with torch.no_grad():
            ref(input_ids=it, attention_mask=mt)
        _sync(device)

    d, inner, ff = d_model, heads * 64, d_ff
    flops = layers * (2 * L * d * inner * 4 + 4 * L * L * inner + 2 * L * d * ff * 3)
    return dict(component="Text encode (vs transformers UMT5EncoderModel)",
                config=f"{'UMT5-XXL widths: ' if d == 4096 else ''}d_model {d}, {heads} heads, FFN {ff}, {layers} layers, "
                       f"{L} tokens",
                vidax=lambda: enc(ij, mj).block_until_ready(), reference=reference, flops=flops)


def offload_chunk1():
    """The DiT with its blocks streamed from host memory one block at a time vs resident (both
    vidax, same process): the cost of offloading's bookkeeping and transfers on this machine."""
    import jax
    import jax.numpy as jnp

    from vidax.models.wan import dit

    cfg = dit.WanDiTConfig(num_heads=8, head_dim=64, text_dim=512, freq_dim=64, ffn_dim=2048, num_layers=8)
    state = dit.init_state(cfg, seed=0)
    resident = dit.runner(state, cfg)
    offloaded = dit.runner(state, cfg, offload_chunk_size=1)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 4, 32, 32, 16)).astype(np.float32))
    ctx = jnp.asarray(rng.standard_normal((1, 128, 512)).astype(np.float32))
    t = jnp.asarray([500.0], jnp.float32)
    return dict(component="Offload chunk=1 (vs the same DiT resident)",
                config="8 blocks, dim 512, 8 heads, FFN 2048, 1024 video + 128 text tokens",
                vidax=lambda: jax.block_until_ready(offloaded(x, t, ctx)),
                reference=lambda: jax.block_until_ready(resident(x, t, ctx)), flops=None)


CASES = [dit_1p3b, umt5_xxl, offload_chunk1]


def vae_decode_real_width(conv_impl=None, latents: tuple = (2, 16, 16), device: str = "cpu", base_dim: int = 96):
    """Wan2.1 VAE decode at the released widths (base_dim 96, z 16): 2 latent frames at 16x16 ->
    5 x 128 x 128 pixels, vs diffusers' AutoencoderKLWan (float32 both sides, as the pipelines
    decode). ``conv_impl``: vidax's (None: its default). Both sides return the frames on the host.
    ``vidax_lowered`` gives the two chunk programs (first, later) lowered, for their optimized HLO."""
    import jax
    import torch
    from diffusers import AutoencoderKLWan

    from tests.refutil import perturb
    from vidax.models.wan import vae
    from vidax.weights import load_params

    ref = perturb(AutoencoderKLWan(base_dim=base_dim, z_dim=16))
    cfg = vae.WanVAEConfig.from_diffusers(dict(ref.config))
    sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    state = jax.device_put(vae.state_from_pure(cfg, load_params(sd, vae.diffusers_keymap(cfg), vae.param_shapes(cfg))))
    ref = _torch_on(ref, device)
    f, h, w = latents
    z = np.random.default_rng(0).standard_normal((1, 16, f, h, w)).astype(np.float32)
    zt = torch.from_numpy(z).to(device)

    def reference():
        with torch.no_grad():
            ref.decode(zt, return_dict=False)[0].cpu()

    def lowered():
        impl = vae._conv_impl(conv_impl)
        kw = dict(cfg=cfg, attn_impl=None, conv_impl=impl)
        _, cache = vae.decode(state, cfg, z, stop=1, return_cache=True, conv_impl=conv_impl)
        return [vae.decode_chunk_jit.lower(state, jax.device_put(z[:, :, :1]), None, first=True, **kw),
                vae.decode_chunk_jit.lower(state, jax.device_put(z[:, :, 1:2]), cache, first=False, **kw)]

    return dict(component="VAE decode (vs diffusers AutoencoderKLWan)",
                config=f"{'Wan2.1 widths: ' if base_dim == 96 else ''}base_dim {base_dim}, z 16, latents {f}x{h}x{w} -> "
                       f"{(f - 1) * 4 + 1}x{8 * h}x{8 * w} px",
                vidax=lambda: np.asarray(vae.decode(state, cfg, z, conv_impl=conv_impl)), reference=reference,
                flops=None, vidax_lowered=lowered, vidax_inputs=(state, cfg, z))


CASES.append(vae_decode_real_width)


#: the tiny Wan components of the end-to-end parity test (tests/test_wan_pipeline.py)
TINY_DIT = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
                text_dim=32, freq_dim=32, ffn_dim=48, num_layers=2, rope_max_seq_len=64)
TINY_VAE = dict(base_dim=16, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True])


def whole_run_tiny(frames: int = 9, height: int = 32, width: int = 32, steps: int = 4, guidance: float = 5.0,
                   device: str = "cpu"):
    """A whole text-to-video run from prompt embeddings to frames in [0, 1] (CFG sampling loop with
    UniPC, then the VAE decode) with tiny widths, vs diffusers' WanPipeline on the same components:
    the per-step overheads (scheduler, dispatch, transfers) rather than the matmuls. Not in ``CASES``
    (``benchmarks/device.py`` runs it)."""
    import tempfile

    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    from tests.refutil import perturb
    from vidax.models.wan.pipeline import WanT2V

    torch.manual_seed(0)
    transformer = perturb(WanTransformer3DModel(**TINY_DIT), seed=1)
    vae = perturb(AutoencoderKLWan(**TINY_VAE), seed=2)
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000,
                                    flow_shift=3.0)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, transformer=transformer, vae=vae, scheduler=sched)
    folder = tempfile.mkdtemp(prefix="vidax-bench-wanrun-")
    pipe.save_pretrained(folder)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    ours = WanT2V(folder)
    rng = np.random.default_rng(0)
    cond, uncond = (rng.standard_normal((1, 16, TINY_DIT["text_dim"])).astype(np.float32) for _ in range(2))
    lat = rng.standard_normal((1, 16, (frames - 1) // 4 + 1, height // 8, width // 8)).astype(np.float32)
    size = dict(height=height, width=width, num_frames=frames)
    ct, ut, lt = (torch.from_numpy(a).to(device) for a in (cond, uncond, lat))

    def vidax():
        z = ours.sample_latents(cond, uncond, latents=lat, steps=steps, guidance=guidance, **size)
        ours.decode_video(z)  # numpy out: blocks until done

    def reference():
        with torch.no_grad():
            pipe(prompt_embeds=ct, negative_prompt_embeds=ut, latents=lt, num_inference_steps=steps,
                 guidance_scale=guidance, output_type="np", **size)

    return dict(component="Whole tiny run: CFG sampling + decode (vs diffusers WanPipeline)",
                config=f"tiny widths (dim 24, 2 blocks; VAE base_dim 16), {steps} steps, {frames}x{height}x{width} px",
                vidax=vidax, reference=reference, flops=None)
