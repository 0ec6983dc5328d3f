"""`bash benchmarks/device.sh --dry-run`: the accelerator benchmark's whole path (profile -> paired
cases vs the references -> table, device.json, device.md) on CPU with tiny sizes, so the script is
known to work before a GPU or TPU machine is lent for a few minutes."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUM = r"\d+\.\d+"


def test_device_script_dry_run_prints_every_case_with_numbers(tmp_path):
    from benchmarks.device import PROFILES

    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    p = subprocess.run(["bash", "benchmarks/device.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    table = p.stdout[p.stdout.index("| component |"):]
    rows = [line for line in table.splitlines()[2:] if line.startswith("| ")]
    data = json.loads((tmp_path / "device.json").read_text())
    cases = list(PROFILES["gpu"]["cases"])
    assert list(PROFILES["dry"]["cases"]) == cases  # the dry run covers every case of the GPU run
    assert [r["case"] for r in data["rows"]] == cases
    assert len(rows) == len(cases), table
    for line, r in zip(rows, data["rows"]):
        assert "error" not in r, r
        assert line.startswith(f"| {r['component']} |")
        # vidax s | reference s | ratio [q1-q3] | pairs: all measured (the table rounds: a tiny case's
        # ratio may print as 0.00x; the JSON holds it unrounded, and positive)
        m = re.search(rf"\| ({NUM}) \| ({NUM}) \| ({NUM})x \[({NUM})-({NUM})\] \| (\d+) \|", line)
        assert m, line
        assert float(m[4]) <= float(m[3]) <= float(m[5]) and int(m[6]) >= 2, line
        assert r["ratio"] == r["ratio"] > 0 and len(r["ratios"]) == r["pairs"]
        assert abs(float(m[3]) - r["ratio"]) <= 0.005 + 1e-9, (line, r["ratio"])
        # the last column: the roof sampled between this case's pairs (the figure that travels)
        assert r["roof_gflops"] > 0 and line.endswith(f"| {r['roof_gflops']:.0f} |"), (line, r["roof_gflops"])
    assert data["environment"]["profile"] == "dry" and data["environment"]["reference_device"] == "cpu"
    assert (tmp_path / "device.md").read_text().strip().endswith(rows[-1])


def test_device_script_without_an_accelerator_says_so(tmp_path):
    env = {**os.environ, "PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "TPU_ACCELERATOR_TYPE": ""}
    if Path("/dev/accel0").exists() or subprocess.run(["sh", "-c", "command -v nvidia-smi"], env=env,
                                                      capture_output=True).returncode == 0:
        import pytest

        pytest.skip("this machine has an accelerator")
    p = subprocess.run(["bash", "benchmarks/device.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: no GPU (nvidia-smi) or TPU (/dev/accel*) on this machine; use --dry-run on a CPU"]
    assert not list(tmp_path.iterdir())
