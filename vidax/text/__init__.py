"""Text (and image) encoders shared by every family."""

#: reference class -> module registering its ``vidax.compat`` adapter
PORTS = {
    "T5EncoderModel": "vidax.text.t5",
    "UMT5EncoderModel": "vidax.text.t5",
    "CLIPVisionModel": "vidax.text.clip",
    "CLIPVisionModelWithProjection": "vidax.text.clip",
    # decoder LMs (text towers): Llama 3, Qwen2 / Qwen2.5-VL, Gemma 3
    **{name: "vidax.text.lm" for name in (
        "LlamaModel", "LlamaForCausalLM", "Qwen2Model", "Qwen2ForCausalLM", "Qwen2_5_VLTextModel",
        "Qwen2_5_VLModel", "Qwen2_5_VLForConditionalGeneration", "Gemma3TextModel", "Gemma3ForCausalLM",
        "Gemma3Model", "Gemma3ForConditionalGeneration", "LlavaForConditionalGeneration")},
    "CLIPTextModel": "vidax.text.clip_text",
    "CLIPTextModelWithProjection": "vidax.text.clip_text",
    "SiglipVisionModel": "vidax.text.siglip",
}
