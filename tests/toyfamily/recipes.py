from vidax.pipeline import Recipe

RECIPES = [
    Recipe("toy-av", "tests.toyfamily.pipeline:ToyAV", ("tiny",),
           dict(height=64, width=96, num_frames=17, steps=4, guidance=3.0, fps=8),
           description="test family: audio + video, embedded guidance, 8k+1 frames"),
]
