"""benchmarks/compile_offline.py: the attention kernels compiled for sm_90 without a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_kernel_compiles_for_hopper_here_and_reports_its_resources(tmp_path):
    # a subprocess: under the interpreter (this process) triton.jit makes no compiled kernels
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compile_offline.py"), "--recipes",
         "flash_bf16", "--tiles", "64x64:4:2", "--seq", "128", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "compile_offline.json").read_text())
    assert report["arch"] == 90
    assert not [row for row in report["rows"] if "error" in row]
    forward = [row for row in report["rows"] if row["kernel"] == "_attn_fwd"]
    assert len(forward) == 1
    row = forward[0]
    assert (row["num_warps"], row["num_stages"]) == (4, 2)  # the launch asked for
    assert 0 < row["registers"] <= 255 and row["spills"] >= 0
    assert row["wgmma"] > 0  # Hopper's tensor-core instructions: compiled for sm_90
    assert 0 < row["shared_bytes"] and row["fits_shared"]
    # the key loops' bodies (unmasked and masked tiles), each longer than its two wgmma groups
    assert len(row["loop_instructions"]) >= 2 and min(row["loop_instructions"]) > 100


def test_compile_only_puts_back_what_it_replaced():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import compile_offline
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    import triton
    from triton.runtime.jit import JITFunction

    from fp4lab.kernels import quantize

    before = (JITFunction.run, quantize._kernel_device, os.environ.get("FP4LAB_DIRECT_LAUNCH"),
              triton.runtime.driver._active)  # fmt: skip
    with compile_offline.compile_only(90) as records:
        assert records == []
        assert triton.runtime.driver.active.get_current_target().arch == 90
        assert JITFunction.run is not before[0]
        assert os.environ["FP4LAB_DIRECT_LAUNCH"] == "0"  # no compiled kernel called directly
    after = (JITFunction.run, quantize._kernel_device, os.environ.get("FP4LAB_DIRECT_LAUNCH"),
             triton.runtime.driver._active)  # fmt: skip
    assert after == before
