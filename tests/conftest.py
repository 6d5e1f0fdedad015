import os
import tempfile

import torch

# Without a GPU the kernels run in Triton's interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Heads not in generated/ are generated into a throwaway cache, never into the user's.
os.environ.setdefault("LOSSCODEGEN_CACHE", tempfile.mkdtemp(prefix="losscodegen-test-"))

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device():
    return DEVICE
