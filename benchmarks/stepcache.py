"""Step caching figures (issue #29): DiT evaluations per video and the sample stage's wall time
with and without a cache, measured side by side in one process.

    python -m benchmarks.stepcache [--steps 20] [--repeats 2]

1. MagCache's decisions depend only on the calibrated ratios: the evaluations of each Wan2.1
   (and HunyuanVideo) release at its default steps with the published ratios are counted without running a model.
2. The tiny Wan preset through the stages (encode -> sample -> decode -> mux) with ``--cache none``,
   ``fbcache`` and ``magcache``: the sample record's seconds and ``dit_evaluations``; configs
   interleaved, the first (compiling) round dropped."""
from __future__ import annotations

import argparse
import statistics
import tempfile

import numpy as np


def magcache_counts(model: str, steps: int, threshold=0.06, max_skips=3, retention=0.2) -> dict:
    from vidax.core.stepcache import CacheSettings, StepCache
    from vidax.models.hunyuanvideo.magcache import MAG_RATIOS as HV
    from vidax.models.wan.magcache import MAG_RATIOS

    ratios = tuple(tuple(b) for b in {**MAG_RATIOS, **HV}[model])  # a list per CFG branch (HunyuanVideo: one)
    c = StepCache(CacheSettings("magcache", threshold, max_skips, retention, ratios), steps)
    c.begin(1, len(ratios))
    for _ in range(steps):
        compute = c.decide_magnitude()
        c.record(compute, tail={})  # something cached after the first computed step
    return c.evaluations


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--fb-threshold", type=float, default=1.2)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--layers", type=int, default=16, help="a wider, deeper DiT than the tiny preset's (2 layers, "
                    "width 24), so the blocks, not the dispatch, take the time; 0: the tiny preset as is")
    ap.add_argument("--frames", type=int, default=33)
    a = ap.parse_args(argv)
    print("MagCache, published ratios, threshold 0.06, K=3, retention 0.2 (every CFG branch):")
    for model, steps in (("wan2.1-t2v-1.3b", 50), ("wan2.1-t2v-14b", 50), ("wan2.1-i2v-480p", 40),
                         ("wan2.1-i2v-720p", 40), ("hunyuanvideo-t2v", 50)):
        ev = magcache_counts(model, steps)
        print(f"  {model} {steps} steps: {ev['computed']} computed, {ev['skipped']} skipped "
              f"(of {ev['computed'] + ev['skipped']})")
    # the MagCache authors' HunyuanVideo settings (their script: threshold 0.24, K 6; or 0.12, K 4)
    for thr, k in ((0.24, 6), (0.12, 4)):
        ev = magcache_counts("hunyuanvideo-t2v", 50, threshold=thr, max_skips=k)
        print(f"  hunyuanvideo-t2v 50 steps, threshold {thr}, K={k}: {ev['computed']} computed, "
              f"{ev['skipped']} skipped")
    if a.layers:
        from dataclasses import replace

        from vidax.models.wan import pipeline as wp

        t = wp.PRESET_SOURCES["tiny"]
        wp.PRESET_SOURCES["tiny"] = replace(t, dit=replace(t.dit, num_layers=a.layers, num_heads=4, head_dim=64,
                                                           ffn_dim=1024))
    from stages import run as R
    from stages.request import Request, validate
    from stages.store import RunStore

    base = dict(model="wan2.1-t2v-1.3b", preset="tiny", prompt="a lighthouse in a storm", height=a.size, width=a.size,
                num_frames=a.frames, steps=a.steps, guidance=5.0, seed=1)
    configs = {"none": {}, f"fbcache {a.fb_threshold:g}": dict(cache="fbcache", cache_threshold=a.fb_threshold),
               "magcache 0.06 (published)": dict(cache="magcache", cache_threshold=0.06)}
    store = RunStore(f"file://{tempfile.mkdtemp(prefix='vidax-bench-')}")
    seconds = {k: [] for k in configs}
    evals = {}
    for rnd in range(a.repeats + 1):
        for name, over in configs.items():
            req = validate(Request(**base, **over))
            run = store.run(f"r{rnd}-{abs(hash(name)) % 10**6}")
            R.generate(run, req, log=lambda *_: None)
            rec = run.record("sample")
            if rnd:
                seconds[name].append(rec["seconds"])
            evals[name] = rec["details"].get("dit_evaluations") or {"computed": 2 * a.steps, "skipped": 0}
    what = f"{a.layers} layers, width 256" if a.layers else "as is"
    print(f"tiny Wan preset ({what}), {a.size}x{a.size}, {a.frames} frames, {a.steps} steps, CFG; sample stage seconds "
          f"(median of {a.repeats}, first compiling round dropped):")
    ref = statistics.median(seconds["none"])
    for name in configs:
        med = statistics.median(seconds[name])
        print(f"  {name}: {evals[name]['computed']} computed / {evals[name]['skipped']} skipped, "
              f"{med:.2f} s [{min(seconds[name]):.2f}-{max(seconds[name]):.2f}] ({med / ref:.2f}x)")
    return np.asarray([statistics.median(v) for v in seconds.values()])


if __name__ == "__main__":
    main()
