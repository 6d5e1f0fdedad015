"""Every input either computes the right value or gets a clear error naming the argument: the
runtime cases (arguments, higher-order gradients, copies and pickles of heads, logits layouts,
top-k ids, threads, damaged kernel files), each written as a user would hit it."""
import copy
import io
import math
import os
import pickle
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import losscodegen as lcg
from helpers import DEVICE, check_head, make_inputs


def _ce_z():
    return lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=0.5), metrics=(lcg.Entropy(),))


# ---- arguments -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, name", [
    (dict(softcap=math.inf), "softcap"), (dict(softcap=math.nan), "softcap"), (dict(softcap=0.0), "softcap"),
    (dict(softcap=-3.0), "softcap"), (dict(logit_scale=math.nan), "logit_scale"),
    (dict(logit_scale=math.inf), "logit_scale"), (dict(logit_scale=-math.inf), "logit_scale"),
    (dict(ignore_index=2**70), "ignore_index"), (dict(ignore_index=-2**63 - 1), "ignore_index"),
])
def test_bad_head_options_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        lcg.HeadLoss(lcg.CrossEntropy(), **kwargs)


def test_int64_edges_of_ignore_index_work():
    logits, labels, _ = make_inputs(R=6, V=64, ignored=())
    for ignore in (2**63 - 1, -2**63):
        labels[2] = ignore
        x = logits.clone().to(DEVICE).requires_grad_()
        loss = lcg.HeadLoss(lcg.CrossEntropy(), ignore_index=ignore)(x, labels.to(DEVICE)).loss
        loss.backward()
        ref_x = logits.double().requires_grad_()
        ref = torch.nn.functional.cross_entropy(ref_x, labels, ignore_index=ignore)
        ref.backward()
        torch.testing.assert_close(loss.double().cpu(), ref)
        torch.testing.assert_close(x.grad.double().cpu(), ref_x.grad, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("divisor", [0, 0.0, -2, -1.5, math.nan, math.inf])
def test_bad_python_divisor_is_refused(divisor):
    logits, labels, _ = make_inputs(R=6, V=64)
    with pytest.raises(ValueError, match="divisor"):
        _ce_z()(logits.to(DEVICE), labels.to(DEVICE), divisor=divisor)


def test_cpu_tensors_without_the_interpreter_say_how_to_run_them(tmp_path):
    script = textwrap.dedent("""
        import torch, losscodegen as lcg
        head = lcg.HeadLoss(lcg.CrossEntropy(), backend="triton")   # ("auto" takes the torch backend there)
        try:
            head(torch.randn(4, 32), torch.randint(0, 32, (4,)))
        except ValueError as e:
            print("ERROR:", e)
    """)
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert "ERROR:" in out.stdout and "TRITON_INTERPRET=1" in out.stdout, out.stdout + out.stderr


# ---- higher-order gradients ------------------------------------------------------------------------
def test_create_graph_through_a_head_is_an_error():
    logits, labels, _ = make_inputs(R=6, V=64)
    hidden = torch.randn(6, 16, device=DEVICE, requires_grad=True)
    weight = torch.randn(64, 16, device=DEVICE, requires_grad=True)
    head, labels = _ce_z(), labels.to(DEVICE)
    with pytest.raises(RuntimeError, match="not differentiable"):
        torch.autograd.grad(head(hidden @ weight.t(), labels).loss, weight, create_graph=True)
    with pytest.raises(RuntimeError, match="not differentiable"):
        torch.autograd.grad(head.linear(hidden, weight, labels).loss, weight, create_graph=True)
    # a first-order gradient is still one call away
    (g,) = torch.autograd.grad(head(hidden @ weight.t(), labels).loss, weight)
    assert g.grad_fn is None and torch.isfinite(g).all()


@pytest.mark.slow   # (torch.compile; create_graph through an eager head: test_create_graph_through_a_head_raises_or_is_correct)
def test_create_graph_through_a_compiled_head_is_an_error():
    head = _ce_z()
    hidden = torch.randn(6, 16, device=DEVICE, requires_grad=True)
    weight = torch.randn(64, 16, device=DEVICE, requires_grad=True)
    labels = torch.randint(0, 64, (6,), device=DEVICE)
    step = torch.compile(lambda h, w, y: head(h @ w.t(), y).loss)
    (g,) = torch.autograd.grad(step(hidden, weight, labels), weight, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):   # (AOTAutograd refuses it itself)
        (g ** 2).sum().backward()


# ---- identity and pickling -------------------------------------------------------------------------
def _copies(head):
    buf = io.BytesIO()
    torch.save(torch.nn.ModuleDict({"head": head}), buf)
    buf.seek(0)
    return [copy.deepcopy(head), pickle.loads(pickle.dumps(head)),
            torch.load(buf, weights_only=False)["head"]]


def test_copies_of_a_head_compute_its_values_before_and_after_its_first_call():
    logits, labels, _ = make_inputs(R=8, V=96)
    head = lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=0.1), lcg.ZLoss(weight=0.25), logit_scale=0.5,
                        softcap=8.0, metrics=(lcg.Entropy(),))
    before = _copies(head)
    check_head(head, logits, labels)
    after = _copies(head)
    ids = {h.head_id for h in [head, *before, *after]}
    assert len(ids) == 7, "every copy has an id of its own"
    for h in before + after:
        check_head(h, logits, labels)


_OTHER_PROCESS = """
import sys, torch, losscodegen as lcg
sys.path.insert(0, {tests!r})
from helpers import DEVICE, check_head, make_inputs
# a head with the same formulas, made first here: it must not be taken for the loaded one
other = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1.0))
logits, labels, _ = make_inputs(R=6, V=64)
logits, labels = logits.to(DEVICE), labels.to(DEVICE)
other(logits, labels)
for path in sys.argv[1:]:
    head = torch.load(path, weights_only=False)
    check_head(head, logits.cpu(), labels.cpu())           # eager
    loss = torch.compile(lambda x, y: head(x, y).loss)(logits, labels)
    ref = torch.load(path, weights_only=False)(logits, labels).loss
    torch.testing.assert_close(loss, ref)                 # compiled: this head's weights
    print("ok", head.head_id != other.head_id)
"""


@pytest.mark.slow   # (a second interpreter; copies in this process: test_copies_of_a_head_compute_its_values_before_and_after_its_first_call)
def test_a_head_saved_before_and_after_its_first_call_loads_in_another_process(tmp_path):
    logits, labels, _ = make_inputs(R=6, V=64)
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=7.0))
    torch.save(head, tmp_path / "before.pt")
    head(logits.to(DEVICE), labels.to(DEVICE))
    torch.save(head, tmp_path / "after.pt")
    script = _OTHER_PROCESS.format(tests=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "before.pt"), str(tmp_path / "after.pt")],
                         capture_output=True, text=True, timeout=600)
    assert out.stdout.split() == ["ok", "True", "ok", "True"], out.stdout + out.stderr


# ---- top-k inputs ----------------------------------------------------------------------------------
def _topk_call(R=6, V=64, K=5, seed=0):
    logits, labels, g = make_inputs(R=R, V=V, seed=seed, ignored=(1,))
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(R)])
    lps = torch.log_softmax(torch.randn(R, K, generator=g), -1)
    return logits, labels, ids, lps


@pytest.mark.parametrize("bad", [64, 65, -1, 10**9, "repeated"])
def test_bad_topk_ids_name_the_argument_and_the_value(bad):
    logits, labels, ids, lps = _topk_call()
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.TopKForwardKL(weight=0.5))
    if bad == "repeated":
        ids[3, 4], bad, match = ids[3, 1], int(ids[3, 1]), "repeat"
    else:
        ids[3, 2], match = bad, r"\[0, 64\)"
    x = logits.to(DEVICE).requires_grad_()
    args = (x, labels.to(DEVICE))
    kw = dict(teacher_topk_ids=ids.to(DEVICE), teacher_topk_logprobs=lps.to(DEVICE))
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match=rf"teacher_topk_ids.*{match}.*found {bad}\b"):
            head(*args, **kw)
    else:   # deferred: this call's loss is NaN, the error comes no later than the next calls
        assert torch.isnan(head(*args, **kw).loss)
        with pytest.raises(ValueError, match=rf"teacher_topk_ids.*{match}.*found {bad}\b"):
            for _ in range(3):
                head(*args, **kw)
                torch.cuda.synchronize()


def test_topk_ids_of_ignored_rows_are_not_looked_at():
    logits, labels, ids, lps = _topk_call()
    mask = torch.ones(6, dtype=torch.bool)
    mask[4] = False
    garbage = ids.clone()
    garbage[1] = -1                 # labels[1] is ignore_index
    garbage[4] = 10**9              # masked out
    garbage[4, 1] = garbage[4, 0] = 7
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.TopKForwardKL(weight=0.5))
    out = head(logits.to(DEVICE), labels.to(DEVICE), loss_mask=mask.to(DEVICE),
               teacher_topk_ids=garbage.to(DEVICE), teacher_topk_logprobs=lps.to(DEVICE))
    # the reference reads every row's ids: it gets the valid ones where the rows are not counted
    ref = check_head(head, logits, labels, loss_mask=mask, teacher_topk_ids=ids, teacher_topk_logprobs=lps)
    torch.testing.assert_close(out.loss.cpu(), ref.loss.detach().cpu())


# ---- threads ---------------------------------------------------------------------------------------
def _two_threads(head, calls, then_valid=0):
    """One thread calls ``head`` with valid labels, another with a bad one, ``calls`` times each at
    the same time; then (on a GPU) the bad thread waits for its work and calls ``then_valid`` times
    with valid labels. What each saw: ("ok", loss) or ("error", message) a call."""
    logits, labels, _ = make_inputs(R=4, V=32, ignored=())
    bad = labels.clone()
    bad[2] = 777
    seen = {"good": [], "bad": []}
    start = threading.Barrier(2)

    def call(name, y):
        try:
            seen[name].append(("ok", head(logits.to(DEVICE), y.to(DEVICE)).loss))
        except ValueError as e:
            seen[name].append(("error", str(e)))

    def worker(name, y):
        start.wait()
        for _ in range(calls):
            call(name, y)
        if name == "bad" and then_valid:
            torch.cuda.synchronize()
            for _ in range(then_valid):
                call(name, labels)
    threads = [threading.Thread(target=worker, args=a) for a in (("good", labels), ("bad", bad))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {k: [(kind, v if kind == "error" else float(v)) for kind, v in calls] for k, calls in seen.items()}


@pytest.mark.cpu
@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU's immediate check; the GPU's deferred one below")
def test_a_bad_call_is_reported_to_its_own_thread_only(monkeypatch):
    # The interleaving that mixed threads up, made certain: the bad thread's kernel has run, and the
    # good thread makes a whole call before the bad thread's call looks for errors.
    from losscodegen.validation import DeviceChecks
    kernel_ran, good_done, check = threading.Event(), threading.Event(), DeviceChecks.after

    def after(self, *args):
        if threading.current_thread().name == "bad":
            kernel_ran.set()
            good_done.wait(timeout=120)
        return check(self, *args)
    monkeypatch.setattr(DeviceChecks, "after", after)
    head = lcg.HeadLoss(lcg.CrossEntropy())
    logits, labels, _ = make_inputs(R=4, V=32, ignored=())
    bad = labels.clone()
    bad[2] = 777
    seen = {}

    def run(name, y):
        if name == "good":
            kernel_ran.wait(timeout=120)
        try:
            seen[name] = ("ok", head(logits, y).loss)
        except ValueError as e:
            seen[name] = ("error", str(e))
        if name == "good":
            good_done.set()
    for _ in range(3):
        kernel_ran.clear(), good_done.clear()
        threads = [threading.Thread(target=run, args=(n, y), name=n) for n, y in (("good", labels), ("bad", bad))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert seen["good"][0] == "ok" and torch.isfinite(seen["good"][1]), seen
        assert seen["bad"][0] == "error" and "found 777" in seen["bad"][1], seen
    # and free-running: many calls of both threads at once
    seen = _two_threads(head, calls=8)
    assert all(kind == "ok" and math.isfinite(v) for kind, v in seen["good"]), seen["good"]
    assert len(seen["bad"]) == 8 and all(kind == "error" and "777" in v for kind, v in seen["bad"]), seen["bad"]


@pytest.mark.gpu
def test_a_deferred_error_is_reported_to_its_own_thread_only():
    seen = _two_threads(lcg.HeadLoss(lcg.CrossEntropy()), calls=30, then_valid=2)
    assert all(kind == "ok" and math.isfinite(v) for kind, v in seen["good"]), seen["good"]
    bad, after = seen["bad"][:30], seen["bad"][30:]
    errors = [v for kind, v in bad + after if kind == "error"]
    assert errors and all("777" in v for v in errors), seen["bad"]
    assert all(kind == "error" or math.isnan(v) for kind, v in bad), bad
    # once its work is done, the first valid call raises for what is left, if anything: the next is clean
    assert after[1][0] == "ok" and math.isfinite(after[1][1]), after


# ---- logits layouts --------------------------------------------------------------------------------
def _layouts(R=6, V=40):
    """Logits the head accepts, as views of one buffer: (name, make(buffer) -> logits)."""
    return [
        ("rows share memory: expand", lambda b: b[:V].expand(R, V)),
        ("overlapping as_strided (8, 1)", lambda b: b.as_strided((R, V), (8, 1))),
        ("overlapping as_strided (1, 8)", lambda b: b.as_strided((R, V), (1, 8))),
        ("3-d, rows overlapping", lambda b: b.as_strided((2, R // 2, V), (8, 4, 1))),
        ("column slice", lambda b: b[:R * (V + 3)].view(R, V + 3)[:, 1:V + 1]),
        ("transposed", lambda b: b[:R * V].view(V, R).t()),
    ]


@pytest.mark.parametrize("name, make", _layouts(), ids=[n for n, _ in _layouts()])
def test_any_logits_layout_gets_the_right_gradient(name, make):
    R, V = 6, 40
    g = torch.Generator().manual_seed(3)
    base = torch.randn(2 * R * V, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, V, (R,), generator=g)
    labels[1] = -100
    head = _ce_z()
    b = base.float().to(DEVICE).requires_grad_()
    logits = make(b)
    out = head(logits, labels.reshape(logits.shape[:-1]).to(DEVICE))
    out.loss.backward()
    ref_b = base.clone().requires_grad_()
    z = make(ref_b).reshape(-1, V)
    keep = labels != -100
    lse = torch.logsumexp(z, -1)
    ce = (lse - z.gather(1, labels.clamp_min(0)[:, None])[:, 0])[keep].mean()
    ref = ce + 0.5 * (lse[keep] ** 2).mean()
    ref.backward()
    torch.testing.assert_close(out.loss.double().cpu(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad.double().cpu(), ref_b.grad, rtol=1e-4, atol=1e-5)


def test_inplace_backward_refuses_logits_whose_rows_share_memory():
    head = lcg.HeadLoss(lcg.CrossEntropy(), inplace_backward=True)
    base = torch.randn(400, device=DEVICE)
    labels = torch.randint(0, 40, (6,), device=DEVICE)
    for logits in (base[:40].expand(6, 40), base.as_strided((6, 40), (8, 1))):
        with pytest.raises(ValueError, match="inplace_backward.*share memory"):
            head(logits.detach().requires_grad_(False), labels)


# ---- kernel files ----------------------------------------------------------------------------------
def _damage(path, how):
    text = path.read_text()
    if how == "truncated":      # still valid Python: the file stops after a whole line
        lines = text.splitlines(keepends=True)
        path.write_text("".join(lines[:len(lines) * 2 // 3]))
    elif how == "edited":
        path.write_text(text.replace("logit_scale", "logit_scale * 1.5", 1))
    elif how == "empty":
        path.write_text("")
    else:
        path.write_bytes(bytes(range(256)) * 8)


@pytest.mark.parametrize("how", ["truncated", "edited", "empty", "binary"])
def test_a_damaged_cache_file_is_generated_again_with_a_warning(how, tmp_path, monkeypatch):
    from losscodegen import load
    monkeypatch.setenv("LOSSCODEGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(load, "_modules", {})         # (kernels this process loaded before)
    logits, labels, _ = make_inputs(R=6, V=64)
    head = lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=0.17), lcg.ZLoss(weight=0.3))
    path = load.module_path(head.key)
    assert path.parent.parent == tmp_path
    check_head(head, logits, labels)
    _damage(path, how)
    monkeypatch.setattr(load, "_modules", {})         # as in a new process: the file is read again
    again = lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=0.17), lcg.ZLoss(weight=0.3))
    with pytest.warns(UserWarning, match=f"{path}.*generating it again"):
        again.kernel
    check_head(again, logits, labels)
    assert path.read_text() == head.source().text


@pytest.mark.parametrize("how", ["truncated", "edited", "empty", "binary"])
def test_a_damaged_file_in_a_kernel_folder_is_an_error_naming_it(how, tmp_path, monkeypatch):
    from losscodegen import load
    head = lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=0.19))
    path = tmp_path / load.file_name(head.key)
    path.write_text(head.source().text)
    _damage(path, how)
    monkeypatch.setenv("LOSSCODEGEN_KERNELS", str(tmp_path))
    monkeypatch.setattr(load, "_modules", {})
    with pytest.raises(RuntimeError, match=rf"{path}.*regenerate"):
        head(torch.randn(4, 32, device=DEVICE), torch.arange(4, device=DEVICE))


@pytest.mark.parametrize("old, new, named", [
    ("\nTOKENS = ", "\nTOKEN_NAMES = ", "no constant TOKENS"),                # renamed
    ("\nUSES_TEACHER = False", "\nUSES_TEACHER = 0", "USES_TEACHER .* not True or False"),  # of the wrong type
    ("\nLOSS, COUNT, DONE = 1, 2, 3", "\nLOSS, COUNT, DONE = 2, 3, 4", "LOSS is 2, where"),  # disagreeing
])
def test_a_kernel_file_missing_a_constant_of_its_contract_fails_at_load_naming_it(old, new, named, tmp_path,
                                                                                   monkeypatch):
    """load reads a file's constants once into its SPEC (interface.FileSpec); a file (sealed intact) whose
    constants are not the contract's fails there, naming the file and the constant, not later in a
    launch that reads it."""
    from losscodegen import interface, load
    head = lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=0.23))
    path = tmp_path / load.file_name(head.key)
    text = head.source().text
    assert old in text
    body = text[:text.index("# TEXT_HASH: ")]
    path.write_text(interface.seal(body.replace(old, new)))
    monkeypatch.setenv("LOSSCODEGEN_KERNELS", str(tmp_path))
    monkeypatch.setattr(load, "_modules", {})
    with pytest.raises(RuntimeError, match=rf"{path} is no kernel file this version reads: .*{named}"):
        head.kernel


def test_generate_names_an_out_that_is_not_a_folder(tmp_path):
    # (the command line's main() in this process: the message SystemExit carries is what the
    # process prints as it exits with status 1)
    from losscodegen.__main__ import main
    manifest = tmp_path / "manifest"
    manifest.write_text("HeadLoss(CrossEntropy())\n")
    with pytest.raises(SystemExit) as done:
        main(["generate", "--manifest", str(manifest), "--out", os.devnull])
    message = done.value.code
    assert isinstance(message, str) and f"--out {os.devnull}" in message, message
    assert "LOSSCODEGEN_CACHE" not in message


def _topk_ranks(rank, world, port, queue):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    logits, labels, ids, lps = _topk_call(V=64)
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.TopKForwardKL(weight=0.5))
    shard = logits[:, rank * 32:(rank + 1) * 32]
    seen = []
    for bad in (32, 63, 64):   # ids are global: 32 and 63 are rank 1's, 64 is outside the vocabulary
        ids[3, 2] = bad if bad not in ids[3] else ids[3, 2]
        try:
            out = head(shard, labels, process_group=dist.group.WORLD, teacher_topk_ids=ids,
                       teacher_topk_logprobs=lps)
            seen.append(("ok", float(out.loss)))
        except ValueError as e:
            seen.append(("error", str(e)))
    queue.put((rank, seen))
    dist.destroy_process_group()


@pytest.mark.cpu
@pytest.mark.skipif(DEVICE == "cuda", reason="gloo ranks on CPU tensors, under Triton's interpreter")
def test_vocab_parallel_topk_ids_are_checked_against_the_global_vocabulary():
    from helpers import run_ranks
    for rank, seen in run_ranks(_topk_ranks, 2, 2):
        assert [kind for kind, _ in seen] == ["ok", "ok", "error"], (rank, seen)
        assert all(math.isfinite(v) for kind, v in seen if kind == "ok")
        assert "teacher_topk_ids" in seen[2][1] and "[0, 64)" in seen[2][1] and "found 64" in seen[2][1]


def test_a_copy_keeps_a_tensor_weight_of_its_own():
    logits, labels, _ = make_inputs(R=6, V=64)
    weight = torch.tensor(0.5, device=DEVICE)
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=weight))
    head(logits.to(DEVICE), labels.to(DEVICE))
    twin = copy.deepcopy(head)
    weight.fill_(2.0)        # the original's schedule moves; the copy's weight stays 0.5
    lse = torch.logsumexp(logits.double(), -1)
    keep = labels != -100
    ce = (lse - logits.double().gather(1, labels.clamp_min(0)[:, None])[:, 0])[keep].mean()
    z = (lse[keep] ** 2).mean()
    for h, w in ((head, 2.0), (twin, 0.5)):
        loss = h(logits.to(DEVICE), labels.to(DEVICE)).loss
        torch.testing.assert_close(loss.double().cpu(), ce + w * z, rtol=1e-5, atol=1e-5)
