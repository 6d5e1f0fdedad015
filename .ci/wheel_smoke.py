"""Run by .ci/run from outside the checkout, with losscodegen installed from its wheel (not editable):
a prebuilt head, a newly declared term, and a head generated into a user folder (--out) that is
found through LOSSCODEGEN_KERNELS. Exits non-zero on any failure."""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import losscodegen as lcg
from losscodegen import symbols as S

here = Path(lcg.__file__).resolve().parent
assert "site-packages" in str(here), f"losscodegen imported from {here}, not from an installed wheel"
logits, labels = torch.randn(6, 50), torch.randint(0, 50, (6,))

prebuilt = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss())
assert Path(prebuilt.kernel.__file__).parent == here / "generated", prebuilt.kernel.__file__
lcg.testing.assert_parity(prebuilt, rows=8, vocab=64, dtypes=(torch.float32,))

Collision = lcg.declare_term("collision", S.vsum(S.softmax ** 2))
declared = lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=0.2), metrics=(Collision(),))
assert Path(os.environ["LOSSCODEGEN_CACHE"]) in Path(declared.kernel.__file__).parents
lcg.testing.assert_parity(declared, rows=8, vocab=64, dtypes=(torch.float32,))

with tempfile.TemporaryDirectory() as tmp:
    manifest = Path(tmp) / "manifest"
    manifest.write_text("Poly1 = declare_term('poly1', S.lse - S.target_logit + S.param('eps') * "
                        "(1 - S.exp(S.target_logit - S.lse)))\nHeadLoss(Poly1(eps=1.5))\n")
    out = Path(tmp) / "kernels"
    subprocess.run([sys.executable, "-m", "losscodegen", "generate", "--manifest", str(manifest),
                    "--out", str(out)], check=True)
    subprocess.run([sys.executable, "-m", "losscodegen", "generate", "--manifest", str(manifest),
                    "--out", str(out), "--check"], check=True)
    os.environ["LOSSCODEGEN_KERNELS"] = str(out)
    Poly1 = lcg.declare_term("poly1", S.lse - S.target_logit + S.param("eps") * (1 - S.exp(S.target_logit - S.lse)))
    built = lcg.HeadLoss(Poly1(eps=1.5))
    assert Path(built.kernel.__file__).parent == out, built.kernel.__file__
    lcg.testing.assert_parity(built, rows=8, vocab=64, dtypes=(torch.float32,))
print("wheel: prebuilt, declared and build-time heads all served and correct")
