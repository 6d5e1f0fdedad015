"""The kernel interface is declared once (emit.signatures): the template writes each kernel's
signature from it, the generated file records it, and the launcher passes arguments by its names. A
template or a declaration that disagrees fails when the kernel file is generated, not at a launch."""
import inspect
import shutil

import pytest

import losscodegen as lcg
from losscodegen import emit, launch, load
from losscodegen.backends.triton import render


def _head():
    return lcg.HeadLoss(lcg.GRPO(), lcg.CrossEntropy(weight=0.1), metrics=(lcg.Entropy(),))


def _template_with(tmp_path, old: str, new: str):
    """A copy of the templates folder (the Triton template and those it includes), ``old`` replaced."""
    folder = shutil.copytree(render.TEMPLATES, tmp_path / "templates")
    holding = [path for path in (folder / name for name in (render.TEMPLATE, *render.PHASES)) if old in path.read_text()]
    assert len(holding) == 1
    holding[0].write_text(holding[0].read_text().replace(old, new))
    return folder


def test_generated_kernels_take_exactly_their_declared_interface():
    from losscodegen.__main__ import manifest_heads
    for line, head in manifest_heads(load.GENERATED / "manifest"):
        k = head.kernel
        fn = getattr(k, f"head_loss_{k.KEY}")
        params = tuple(inspect.signature(getattr(fn, "fn", fn)).parameters)
        assert params == k.ARGS + k.FIXED + k.CONSTEXPRS, line
        if k.SEGMENTS:
            fn = getattr(k, f"segments_{k.KEY}")
            params = tuple(inspect.signature(getattr(fn, "fn", fn)).parameters)
            assert params == k.SEGMENT_ARGS + k.SEGMENT_FIXED + k.SEGMENT_CONSTEXPRS, line


def test_a_template_reading_a_renamed_argument_fails_at_generation(tmp_path, monkeypatch):
    folder = _template_with(tmp_path, "x_row = x_ptr + row * x_stride", "x_row = x_ptr + row * x_row_stride")
    monkeypatch.setattr(render, "TEMPLATES", folder)
    with pytest.raises(ValueError, match=r"reads \['x_row_stride'\], which is no argument"):
        _head().source()


def test_a_declaration_renaming_an_argument_fails_at_generation(monkeypatch):
    declared = emit.signatures

    def renamed(*a, **kw):
        sigs = declared(*a, **kw)
        s = sigs["head_loss"]
        sigs["head_loss"] = emit.Signature(s.name, tuple("x_row_stride" if n == "x_stride" else n for n in s.args),
                                           s.fixed, s.constexprs, s.unspecialized)
        return sigs
    monkeypatch.setattr(emit, "signatures", renamed)   # (what emit.kernel_spec declares every backend's files with)
    with pytest.raises(ValueError, match="x_stride"):
        _head().source()


def test_a_template_writing_its_own_signature_fails_at_generation(tmp_path, monkeypatch):
    folder = _template_with(tmp_path, "{{ kernel_def(sigs.head_loss) }}",
                            "@triton.jit\ndef head_loss_{{ key }}(x_ptr, x_stride):")
    monkeypatch.setattr(render, "TEMPLATES", folder)
    with pytest.raises(ValueError, match="are not its declared interface"):
        _head().source()


def test_an_argument_the_launcher_cannot_pass_is_named():
    spec = _head().kernel.SPEC
    with pytest.raises(TypeError, match="'w_ptr' that launch.py does not know how to pass"):
        launch.binder(spec, spec.args + ("w_ptr",))
    bind = launch.binder(spec, ("n_rows", "off_stats", "tok_advantages_ptr"))
    call = type("Call", (), {"rows": 7, "tokens": ("a", "b", "c")})()
    ws = type("Ws", (), {"off_stats": 42})()
    position = spec.tokens.index("advantages")
    assert bind(None, None, None, call, ws, 0, None, None, 0, None, 0, None, None) == (7, 42, call.tokens[position])


_HEADS = [lambda **kw: lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(), lcg.ForwardKL(),
                                    metrics=(lcg.Entropy(), lcg.TokenAccuracy()), **kw),
          lambda **kw: lcg.HeadLoss(lcg.GSPO(), metrics=(lcg.Entropy(),), **kw),
          lambda **kw: lcg.HeadLoss(lcg.TopKForwardKL(), lcg.CrossEntropy(), **kw)]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_templates_read_the_spec_and_the_printed_phases_only(backend, monkeypatch):
    """A template's context holds the file's KernelSpec and the plan printed by phase (emit.phases,
    the renderer's own layout), nothing of the Plan or the Lowered head (issue 31)."""
    import jinja2
    from losscodegen.lower import Lowered
    from losscodegen.plan import Plan
    contexts = []
    render_template = jinja2.Template.render

    def recording(self, *args, **kwargs):
        contexts.append(dict(*args, **kwargs))
        return render_template(self, *args, **kwargs)
    monkeypatch.setattr(jinja2.Template, "render", recording)

    def values(v):
        yield v
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, (list, tuple)):
            for item in v:
                yield from values(item)
    for make in _HEADS:
        make().source(lcg.backends.get(backend))
    assert contexts
    for context in contexts:
        assert isinstance(context["spec"], emit.KernelSpec)
        assert not [v for v in values(context) if isinstance(v, (Plan, Lowered))]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_loaded_file_records_its_spec(backend, tmp_path, monkeypatch):
    """load reads a kernel file's constants back into its SPEC (emit.FileSpec): the KernelSpec the
    file was rendered from, as both backends' templates write it."""
    monkeypatch.setenv("LOSSCODEGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(load, "_modules", {})
    for make in _HEADS:
        head = make(backend=backend)
        spec = emit.kernel_spec(head.plan(), head.key, {t.name: lcg.terms.kernel_normalize(t)
                                                        for t in head.loss_terms})
        assert head.kernel.SPEC == spec.recorded
