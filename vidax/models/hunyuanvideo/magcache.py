"""Published step-cache calibrations of HunyuanVideo (text-to-video).

MagCache: the calibration (text-to-video, 720p): the per-step magnitude ratios
of the block stack's residual (the video tokens), 50 steps, one branch (the release is guidance
distilled: no CFG batch), the leading 1.0 the authors' padding of the first step.

Source: the MagCache authors' release, Zehong-Ma/MagCache, ``MagCache4HunyuanVideo/magcache_sample_video.py``
(its ``video_size[0] == 720`` table; Ma et al., "MagCache: Fast Video Generation with Magnitude-Aware
Cache", arXiv:2506.09045). The same script's 544p table is not wired (vidax keys the ratios by model,
not by resolution: pass it with ``--cache-ratios FILE``). ``--cache magcache`` resamples the ratios to
the request's step count by nearest neighbour (as their scripts and diffusers do); with true CFG both
branches take them."""
from __future__ import annotations

_T2V_720P = [1.0] + [
    1.0754, 1.27807, 1.11596, 1.09504, 1.05188, 1.00844, 1.05779, 1.00657, 1.04142, 1.03101, 1.00679, 1.02556, 1.00908,
    1.06949, 1.05438, 1.02214, 1.02321, 1.03019, 1.00779, 1.03381, 1.01886, 1.01161, 1.02968, 1.00544, 1.02822, 1.00689,
    1.02119, 1.0105, 1.01044, 1.01572, 1.02972, 1.0094, 1.02368, 1.0226, 0.98965, 1.01588, 1.02146, 1.0018, 1.01687,
    0.99436, 1.00283, 1.01139, 0.97122, 0.98251, 0.94513, 0.97656, 0.90943, 0.85703, 0.75456]

#: model id -> MagCache ratios, one list for every CFG branch
MAG_RATIOS = {"hunyuanvideo-t2v": [_T2V_720P]}


#: Published TeaCache rescaling polynomial (highest power first) of HunyuanVideo T2V, with the authors'
#: schedule: the modulated input is the first double block's normalised video tokens with its first
#: shift / scale (``HunyuanVideoTransformer.teacache_input``), the first and the last step always
#: computed. Source: the TeaCache authors' release, ali-vilab/TeaCache,
#: ``TeaCache4HunyuanVideo/teacache_sample_video.py`` (Liu et al., arXiv:2411.19108); read from copies
#: that cite that file (chipmunk's ``COEFFICIENTS['hunyuan']``, ComfyUI TeaCache patches' ``HunYuanVideo``
#: entry, sglang's HunyuanVideo ``TeaCacheParams``), which agree digit for digit.
TEA_COEFFS = {
    "hunyuanvideo-t2v": {"coefficients": [7.33226126e+02, -4.01131952e+02, 6.75869174e+01, -3.14987800e+00,
                                          9.61237896e-02], "warmup": 1, "final": True},
}
