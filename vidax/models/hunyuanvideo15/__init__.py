"""HunyuanVideo 1.5 (text-to-video and image-to-video, 480p / 720p): the 54-block dual-stream
DiT with three condition streams (Qwen2.5-VL text, ByT5 glyphs, SigLIP image), its 32-channel
causal VAE (16x spatial, 4x temporal), the pipelines. ``dit`` and ``vae`` import nothing of the
pipeline."""

#: reference class -> module registering its ``vidax.compat`` adapter
PORTS = {
    "HunyuanVideo15Transformer3DModel": "vidax.models.hunyuanvideo15.dit",
    "AutoencoderKLHunyuanVideo15": "vidax.models.hunyuanvideo15.vae",
}
