"""The torch backend (``HeadLoss(..., backend="torch")``): every built-in head of generated/manifest
and declared terms against the float64 reference, in every launch sequence (one launch, reads split
over launches, vocabulary blocks that do not divide it), through ``head()`` and ``head.linear()``,
with the validation flags, under torch.compile, in bounded memory, and in a process where triton
cannot be imported at all."""
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import losscodegen as lcg
from losscodegen import backends
from losscodegen import symbols as S
from losscodegen.__main__ import manifest_heads
from losscodegen.backends.torch import Config
from losscodegen.testing import assert_parity, compare, reference

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = [line for line, _ in manifest_heads(ROOT / "generated" / "manifest")]
# small vocabulary blocks that do not divide the vocabulary (the online rescale across blocks), and
# the reads as a launch each (stats, exact, rows and gradient)
CONFIGS = {"one_launch": None, "split_small_blocks": Config(block_v=37, split=True)}

p_y = S.exp(S.target_logit - S.lse)
DECLARED = [
    lcg.declare_term("poly1", S.lse - S.target_logit + S.param("eps") * (1 - p_y))(eps=2.0),
    lcg.declare_term("collision", S.vsum(S.softmax ** 2))(),
    lcg.declare_term("weighted_ce", S.token("token_weight") * (S.lse - S.target_logit))(),
    lcg.declare_term("mean_abs_logit", S.vsum(S.Abs(S.logit)) / S.vocab_size)(),
]


def _torch_head(line: str) -> lcg.HeadLoss:
    namespace = {name: getattr(lcg, name) for name in lcg.__all__}
    namespace["HeadLoss"] = lambda *terms, **options: lcg.HeadLoss(*terms, **options, backend="torch")
    return eval(line, namespace)


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("line", MANIFEST)
def test_every_manifest_head_matches_float64(line, config):
    head = _torch_head(line)
    assert head.backend.name == "torch"
    head.tile_override = CONFIGS[config]
    assert_parity(head, rows=20, vocab=300)
    if head.loss_terms and not head.kernel.SEGMENTS:   # the deferred gradient of reduction="none"
        assert_parity(head, rows=12, vocab=300, dtypes=(torch.float32,), reduction="none")


@pytest.mark.parametrize("term", DECLARED, ids=lambda t: t.name)
def test_declared_terms_match_float64(term):
    head = lcg.HeadLoss(term, lcg.CrossEntropy(weight=0.5), metrics=(lcg.Entropy(),), backend="torch")
    head.tile_override = Config(block_v=64)
    assert_parity(head, rows=16, vocab=200)


def test_class_weights_logit_scale_and_softcap(device):
    weight = (torch.rand(300, generator=torch.Generator().manual_seed(1)) + 0.5).to(device)
    head = lcg.HeadLoss(lcg.CrossEntropy(class_weight=weight), lcg.ZLoss(weight=1e-2), logit_scale=0.5,
                        softcap=3.0, backend="torch")
    assert_parity(head, rows=16, vocab=300, device=device)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_head_linear_in_chunks_of_rows(reduction, device):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 16, generator=g)
    weight, bias = torch.randn(130, 16, generator=g) / 4, torch.randn(130, generator=g)
    labels = torch.randint(0, 130, (3, 7), generator=g)
    labels[0, 2] = -100
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=0.1), metrics=(lcg.Entropy(),), backend="torch")
    head.tile_override = Config(block_v=50)
    h = hidden.to(device, copy=True).requires_grad_()
    w = weight.to(device, copy=True).requires_grad_()
    out = head.linear(h, w, labels.to(device), bias=bias.to(device), chunk_rows=4, reduction=reduction)
    upstream = torch.randn(out.loss.shape, generator=g)
    (out.loss * upstream.to(device)).sum().backward()

    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logits = hd @ wd.T + bias.double()
    want_loss, want, grad_logits = reference(head)(logits.detach(), labels, reduction=reduction)
    compare("loss", out.loss, want_loss, torch.float32)
    for name, value in {**out.terms, **out.metrics}.items():
        compare(name, value, want[name], torch.float32)
    logits.backward(grad_logits * (upstream.double()[..., None] if reduction == "none" else upstream.double()))
    compare("gradient", h.grad, hd.grad, torch.float32)
    compare("gradient", w.grad, wd.grad, torch.float32)


def test_bad_values_raise_as_on_triton(device):
    head = lcg.HeadLoss(lcg.GSPO(), lcg.TopKForwardKL(weight=0.5), backend="torch")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 40, generator=g).to(device)
    ids = torch.stack([torch.randperm(40, generator=g)[:4] for _ in range(6)])
    good = dict(advantages=torch.randn(6, generator=g), old_logprobs=torch.randn(6, generator=g) - 4,
                segment_ids=torch.tensor([0, 0, 1, 1, 2, 2]), teacher_topk_ids=ids,
                teacher_topk_logprobs=torch.log_softmax(torch.randn(6, 4, generator=g), -1))
    good = {**{k: v.to(device) for k, v in good.items()}, "num_segments": 3}
    y = torch.randint(0, 40, (6,), generator=g).to(device)
    assert torch.isfinite(head(x, y, **good).loss)
    with pytest.raises(ValueError, match="labels: values must be in \\[0, 40\\).*found 40"):
        head(x, torch.where(torch.arange(6, device=device) == 3, 40, y), **good)
    with pytest.raises(ValueError, match="segment_ids .* found 7"):
        head(x, y, **{**good, "segment_ids": torch.tensor([0, 0, 1, 7, 2, 2], device=device)})
    repeated = ids.clone()
    repeated[2, 3] = repeated[2, 1]
    with pytest.raises(ValueError, match=f"found {int(repeated[2, 1])} twice"):
        head(x, y, **{**good, "teacher_topk_ids": repeated.to(device)})


def test_compiled_step_equals_eager(device):
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ForwardKL(weight=0.5), metrics=(lcg.Entropy(),), backend="torch")
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(10, 90, generator=g).to(device), torch.randn(10, 90, generator=g).to(device)
    y = torch.randint(0, 90, (10,), generator=g).to(device)

    def step(logits):
        out = head(logits, y, teacher_logits=t)
        out.loss.backward()
        return out.loss.detach(), out.metrics["entropy"]
    grads = []
    results = []
    for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=False)):
        logits = x.clone().requires_grad_()
        results.append(fn(logits))
        grads.append(logits.grad)
    torch.testing.assert_close(results[0], results[1])
    torch.testing.assert_close(grads[0], grads[1])


def test_no_rows_by_vocabulary_fp32_temporary(device):
    """Chunks of rows x blocks of the vocabulary: no fp32 tensor the size of the logits (bf16 here,
    so the gradient buffer is bf16) is ever made."""
    rows, V = 300, 5000
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ForwardKL(), metrics=(lcg.Entropy(),), backend="torch")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, V, generator=g).bfloat16().to(device).requires_grad_()
    t = torch.randn(rows, V, generator=g).bfloat16().to(device)
    y = torch.randint(0, V, (rows,), generator=g).to(device)
    head(x[:2], y[:2], teacher_logits=t[:2])   # (the kernel file generated outside the count)
    with _Fp32Sizes() as made:
        head(x, y, teacher_logits=t).loss.backward()
    assert 0 < max(made.sizes) <= 256 * 4096 < rows * V


class _Fp32Sizes(TorchDispatchMode):
    """The size of every fp32 tensor an op makes."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.sizes += [t.numel() for t in torch.utils._pytree.tree_leaves(out)
                       if isinstance(t, torch.Tensor) and t.dtype == torch.float32]
        return out


def test_backend_option_resolves_and_survives_a_copy(monkeypatch):
    with pytest.raises(ValueError, match="backend must be one of"):
        lcg.HeadLoss(lcg.CrossEntropy(), backend="cuda")
    head = lcg.HeadLoss(lcg.CrossEntropy(), backend="torch")
    copy = pickle.loads(pickle.dumps(head))
    assert copy.backend_name == "torch" and copy.backend is backends.get("torch")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert backends.resolve("auto") == "torch" and backends.resolve("triton") == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backends.resolve("auto") == "triton"   # (triton is installed here)
    # the two backends' files of one head are two files, in the cache by their own CODEGEN
    ce = lcg.HeadLoss(lcg.CrossEntropy(), backend="torch")
    assert lcg.load.module_path(ce.key, ce.backend).name == f"head_loss_{ce.key}_torch.py"


NO_TRITON = textwrap.dedent('''
    import sys
    sys.modules["triton"] = None          # import triton raises ImportError, as where it is not installed
    import torch
    import losscodegen as lcg
    from losscodegen import backends
    from losscodegen.__main__ import manifest_heads
    from losscodegen.testing import assert_parity
    from pathlib import Path
    from losscodegen import symbols as S

    heads = [head for _, head in manifest_heads(Path(sys.argv[1]))]
    heads.append(lcg.HeadLoss(lcg.declare_term("focal", -(1 - S.exp(S.target_logit - S.lse)) ** S.param("gamma")
                                               * (S.target_logit - S.lse))(gamma=2.0)))
    for head in heads:
        assert head.backend.name == "torch", head.backend.name
        assert_parity(head, rows=10, vocab=120)
    assert sys.modules["triton"] is None and not any(m.startswith("losscodegen.backends.triton") for m in sys.modules)
    print("computed", len(heads), "heads")
''')


def test_without_triton_every_head_computes_on_the_cpu(tmp_path):
    """triton absent (an import of it fails): ``import losscodegen`` works, backend="auto" is torch
    (TRITON_INTERPRET set or not), and every built-in head and a declared one match float64."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "LOSSCODEGEN_CACHE": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", NO_TRITON, str(ROOT / "generated" / "manifest")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"computed {len(MANIFEST) + 1} heads" in run.stdout


def test_a_declaration_renaming_an_argument_fails_at_generation(monkeypatch):
    """The torch file's functions take interface.signatures' interface (through interface.kernel_spec,
    as Triton's do): a renamed argument is refused when the file is written."""
    import dataclasses
    from losscodegen import interface
    declared = interface.signatures

    def renamed(*a, **kw):
        sigs = declared(*a, **kw)
        s = sigs["head_loss"]
        sigs["head_loss"] = dataclasses.replace(s, params=tuple(
            dataclasses.replace(p, name="x_row_stride") if p.name == "x_stride" else p for p in s.params))
        return sigs
    monkeypatch.setattr(interface, "signatures", renamed)
    with pytest.raises(ValueError, match="x_stride"):
        lcg.HeadLoss(lcg.CrossEntropy(), backend="torch").source()


_l = S.target_logit - S.lse


@pytest.mark.parametrize("terms", [
    lambda: (lcg.GSPO(), lcg.JSD(weight=0.3)),
    # the language's constructs: a row term of segment statistics, the row max, a per-class vector
    lambda: (lcg.declare_term("spread", (_l - S.segment_mean(_l)) ** 2 * S.token("advantages") / S.segment_count)(),
             lcg.declare_term("max_z", S.row_max ** 2)(weight=0.1),
             lcg.declare_term("prior", S.vsum(S.vector("prior") * (S.lse - S.logit)))(weight=0.5)),
], ids=["gspo_jsd", "constructs"])
def test_its_kernels_trace_whole_under_torch_compile(monkeypatch, terms):
    """Each function of a torch kernel file is one graph to torch.compile (fullgraph=True: no host
    read, no data-dependent branch; validate=False, whose check reads the host, is the one break)."""
    torch_backend = backends.get("torch")
    kernel = torch_backend.kernel
    monkeypatch.setattr(torch_backend, "kernel", lambda fn, *args: kernel(
        torch.compile(fn, fullgraph=True, backend="eager", dynamic=False), *args))
    head = lcg.HeadLoss(*terms(), metrics=(lcg.TokenAccuracy(),), validate=False, backend="torch")
    assert_parity(head, rows=10, vocab=150, dtypes=(torch.float32,))


def test_a_topk_sum_of_the_final_lse_is_right_when_the_reads_are_split(device):
    # (found by the fuzzer: the torch file's HAS_EXACT counted the vocabulary's exact sums only, so
    # split reads never ran the launch that sums the top-k entries against the final lse)
    from losscodegen.fuzz import Plan, check
    from losscodegen import symbols as S
    unlikely = lcg.declare_term("unlikely", S.topk_sum(S.log(1 - S.exp(S.topk_logit - S.lse))))
    head = lcg.HeadLoss(lcg.CrossEntropy(), metrics=(unlikely(),), backend="torch")
    check(head, Plan(tile=(24, 4, True)), rows=3, vocab=61, seed=611, device=device)


def test_a_topk_gradient_with_shared_temporaries_is_generated_where_it_is_used(device):
    # (found by the fuzzer: the top-k gradient's temporaries were printed with the vocabulary's,
    # inside its loop, and read after it; the scope check refused the file)
    from losscodegen.fuzz import Plan, check
    from losscodegen import symbols as S
    t = lcg.declare_term("topk_ent", S.topk_sum(S.exp(S.topk_logit - S.lse) * (S.topk_logit - S.lse)))
    check(lcg.HeadLoss(t(), backend="torch"), Plan(), rows=3, vocab=61, seed=530, device=device)
