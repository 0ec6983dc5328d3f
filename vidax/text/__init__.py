"""Text (and image) encoders shared by every family."""

#: reference class -> module registering its ``vidax.compat`` adapter
PORTS = {
    "T5EncoderModel": "vidax.text.t5",
    "UMT5EncoderModel": "vidax.text.t5",
    "CLIPVisionModel": "vidax.text.clip",
    "CLIPVisionModelWithProjection": "vidax.text.clip",
}
