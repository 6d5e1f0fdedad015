"""The integrations are optional: importing losscodegen, or the integrations package, imports neither
transformers nor trl (a fresh interpreter, so that no other test's imports count)."""
import subprocess
import sys


def test_importing_losscodegen_imports_no_training_library():
    code = ("import sys, losscodegen, losscodegen.integrations\n"
            "loaded = sorted(m for m in ('transformers', 'trl', 'accelerate', 'datasets') if m in sys.modules)\n"
            "assert not loaded, loaded\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
