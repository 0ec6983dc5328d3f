"""LTX-Video 0.9.x and LTX-2.x: DiTs, VAEs (video, audio + vocoder, the diffusion decoder), the
LTX-2 text connectors, the pipelines."""

#: reference class -> module registering its ``vidax.compat`` adapter
PORTS = {
    "LTXVideoTransformer3DModel": "vidax.models.ltx.dit",
    "AutoencoderKLLTXVideo": "vidax.models.ltx.vae",
    "AutoencoderKLLTX2Video": "vidax.models.ltx.vae",
    "LTX2VideoTransformer3DModel": "vidax.models.ltx.dit2",
    "LTX2TextConnectors": "vidax.models.ltx.connectors",
    "AutoencoderKLLTX2Audio": "vidax.models.ltx.audio",
    "LTX2Vocoder": "vidax.models.ltx.audio",
    "LTX2VocoderWithBWE": "vidax.models.ltx.audio",
    "LTX2VideoDiffusionDecoderModel": "vidax.models.ltx.diffusion_decoder",
}
