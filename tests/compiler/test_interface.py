"""The kernel interface is declared once (interface.signatures), each argument a typed record
(interface.Arg): the template writes each kernel's signature from it, the generated file records its
names, and the launcher passes each argument by its record. A template or a declaration that
disagrees fails when the kernel file is generated, not at a launch."""
import ast
import dataclasses
import inspect
import re
import shutil
from pathlib import Path

import pytest

import losscodegen as lcg
from losscodegen import interface, launch, load
from losscodegen import symbols as S
from losscodegen.backends.triton import render
from losscodegen.interface import Region, Role, Value


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
    declared = interface.signatures

    def renamed(*a, **kw):
        sigs = declared(*a, **kw)
        s = sigs["head_loss"]
        sigs["head_loss"] = dataclasses.replace(s, params=tuple(
            dataclasses.replace(p, name="x_row_stride") if p.name == "x_stride" else p for p in s.params))
        return sigs
    # (what interface.kernel_spec declares every backend's files with)
    monkeypatch.setattr(interface, "signatures", renamed)
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
        launch.binding(spec, spec.args + ("w_ptr",), "head_loss")
    with pytest.raises(TypeError, match="takes 'world' among each launch's arguments"):
        launch.binding(spec, spec.args + ("world",), "head_loss")
    with pytest.raises(TypeError, match="'x_ptr', a value of each launch"):
        launch.binding(spec, ("ws_ptr", "x_ptr"), "segments", per_launch=False)
    with pytest.raises(TypeError, match=r"takes \['n_rows'\] among its fixed arguments"):
        launch.fixed_values(spec, ("world", "n_rows"), {Value.WORLD: 1}, "head_loss")


def test_each_argument_is_a_typed_record_named_by_the_interface_alone():
    """A head's signature is of ``Arg`` records, each with its role and what the runtime passes; the
    names made of the head's own (tokens, vectors, workspace regions, weights) come from
    interface.py's functions, and the file records exactly the records' names."""
    head = _head()
    spec = head.kernel.SPEC
    sig = spec_sig = interface.kernel_spec(head.plan(), head.key).sigs["head_loss"]
    assert all(isinstance(a, interface.Arg) for a in sig.params)
    assert (sig.args, sig.fixed, sig.constexprs) == (spec.args, spec.fixed, spec.constexprs)
    assert all((a.value is None) == (a.role is Role.CONSTEXPR) for a in sig.params)
    tokens = [a for a in spec_sig.params if a.value is Value.TOKEN]
    assert [a.item for a in tokens] == list(spec.tokens) and spec.tokens
    assert [a.name for a in tokens] == [interface.token_arg(t).name for t in spec.tokens]
    assert interface.token_arg("advantages").name == "tok_advantages_ptr"   # (the name the files have always had)
    assert interface.vector_arg("prior").name == "vec_prior_ptr"
    assert interface.offset_arg(Region.STATS).name == "off_stats"
    assert interface.weight_name("grpo") == "weight_grpo" and "weight_grpo" in spec.scalars
    assert {a.item for a in sig.params if a.value is Value.OFFSET} <= set(Region)
    # the records the runtime resolves from the file's names are the declaration's
    assert interface.resolve(spec.args + spec.fixed, spec.tokens, spec.vectors, "k") == \
        tuple(a for a in sig.params if a.role is not Role.CONSTEXPR)


def test_binding_passes_each_argument_its_value():
    """launch.binding, a round trip: each argument of the head's kernel comes from the value its
    record names (the call's, in _CALL's order, the region offsets, tokens and vectors, then the
    launch's), by position, with no name read apart and nothing compiled."""
    prior = lcg.declare_term("prior_ce", S.vsum(S.vector("prior") * (S.lse - S.logit)))
    head = lcg.HeadLoss(lcg.GRPO(), lcg.CrossEntropy(weight=0.1), prior())
    spec = head.kernel.SPEC
    assert spec.tokens and spec.vectors
    call_values = (*[("call", v) for v in launch._CALL], *[("region", r) for r in Region],
                   *[("token", t) for t in spec.tokens], *[("vector", v) for v in spec.vectors])
    values = (*call_values, *[("launch", v) for v in launch._LAUNCH])
    bound = launch.binding(spec, spec.args, "head_loss")(values)
    want = []
    for a in interface.resolve(spec.args, spec.tokens, spec.vectors, "head_loss"):
        kind = {Value.OFFSET: "region", Value.TOKEN: "token", Value.VECTOR: "vector"}.get(a.value)
        want.append((kind, a.item) if kind else ("call" if a.value in launch._CALL else "launch", a.value))
    assert list(bound) == want
    assert bound[spec.args.index("tok_advantages_ptr")] == ("token", "advantages")
    assert bound[spec.args.index("off_rows")] == ("region", Region.ROWS)
    assert bound[spec.args.index("x_stride")] == ("launch", Value.LOGITS_STRIDE)
    # a kernel of one argument still gets a tuple
    assert launch.binding(spec, ("n_rows",), "k")(values) == (("call", Value.N_ROWS),)


# The one compile: a manifest is the user's Python file of heads, run as a module by an importlib
# loader (as ``python file.py`` would run it), its top-level expressions handed back with their lines
_MANIFEST_LOADER = "__main__.py"


def test_no_module_compiles_code_from_strings():
    """No call of ``exec`` or ``eval`` anywhere in the package, and of ``compile`` only where a user's
    manifest file is loaded as a module (a sympy Function's ``eval`` method is none): the launch binds
    by records, the fuzzer builds heads from objects, the float64 reference walks the formula's tree,
    and the transformers integration runs the model's own forward."""
    package = Path(lcg.__file__).resolve().parent
    calls = [(str(path.relative_to(package)), node) for path in sorted(package.rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id in ("exec", "eval", "compile")]
    assert [f"{path}:{node.lineno}" for path, node in calls
            if node.func.id != "compile" or path != _MANIFEST_LOADER] == []


def test_the_interface_names_are_made_in_interface_py_alone():
    """The names made of a head's own (``tok_<name>_ptr``, ``vec_<name>_ptr``, ``off_<region>``,
    ``weight_<term>``) are written nowhere else: the other modules call interface.py's functions,
    and the templates read the names from their context."""
    package = Path(lcg.__file__).resolve().parent
    made = re.compile(r"""f["'](weight|off|tok|vec)_\{|["']weight_["']|_ptr["'].*(tok|vec)_""")
    found = [str(p.relative_to(package)) for p in sorted(package.rglob("*.py"))
             if p.name != "interface.py" and made.search(p.read_text())]
    assert found == []
    written = re.compile(r"(weight|tok|vec|off)_\{\{")
    assert [p.name for p in sorted(render.TEMPLATES.rglob("*.j2")) if written.search(p.read_text())] == []


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
        assert isinstance(context["spec"], interface.KernelSpec)
        assert not [v for v in values(context) if isinstance(v, (Plan, Lowered))]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_loaded_file_records_its_spec(backend, tmp_path, monkeypatch):
    """load reads a kernel file's constants back into its SPEC (interface.FileSpec): the KernelSpec the
    file was rendered from, as both backends' templates write it."""
    monkeypatch.setenv("LOSSCODEGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(load, "_modules", {})
    for make in _HEADS:
        head = make(backend=backend)
        spec = interface.kernel_spec(head.plan(), head.key, {t.name: lcg.terms.kernel_normalize(t)
                                                        for t in head.loss_terms})
        assert head.kernel.SPEC == spec.recorded
