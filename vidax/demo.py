"""``make demo``: generate a video with the tiny preset (seeded random weights) on the local default."""
import sys

from vidax.cli import main

if __name__ == "__main__":
    sys.exit(main(["generate", "--model", "wan2.1-t2v-1.3b", "--preset", "tiny",
                   "--prompt", "A red panda paddling a canoe across a misty lake at sunrise",
                   "--out", "vidax-runs/demo/video.mp4"]))
