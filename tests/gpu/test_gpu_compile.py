"""Every kernel variant of the manifest heads compiles for an H100 (sm_90), without a GPU: the
interpreter that runs the other tests accepts code that the GPU compiler refuses."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "sm90_compile.py"


# (every variant, a minute of CPU: the slow tier; tests/compiler/test_portable_builds.py compiles one manifest
# kernel for sm_90 and sm_100 in the default tier)
@pytest.mark.slow
def test_manifest_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["LOSSCODEGEN_CACHE"] = str(tmp_path)
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    kernels = done.stdout.splitlines()
    assert any("[STATS+EXACT+ROWS+GRAD]" in k for k in kernels), done.stdout[-2000:]
    assert any("[MERGE+ROWS+GRAD]" in k for k in kernels) and any(k.startswith("segments_") for k in kernels)
