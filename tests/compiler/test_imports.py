"""The package's import graph, read from its source: no import circle anywhere; the compiler stages
(declare, lower, plan, interface, emit, and a backend's renderer) import neither the runtime nor
torch/triton; and a backend is one folder: only its own modules import what it is written in
(triton) or each other, and the runtime reaches it through ``losscodegen.backends`` alone."""
from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import losscodegen as lcg
from losscodegen import head

PACKAGE = Path(lcg.__file__).resolve().parent
COMPILER = {"losscodegen.symbols", "losscodegen.terms", "losscodegen.lower", "losscodegen.derive", "losscodegen.stable",
            "losscodegen.plan", "losscodegen.interface", "losscodegen.emit", "losscodegen.program",
            "losscodegen.resources", "losscodegen.backends.triton.render", "losscodegen.backends.torch.render"}
BACKENDS = "losscodegen.backends."
# what each backend is written in: imported by that backend's folder and nowhere else in the package
# (torch: the runtime's own language, so nothing to keep out of the other modules but the folder itself)
LANGUAGES = {"triton": {"triton"}, "torch": set()}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def graph() -> dict[str, set[str]]:
    """module -> what it imports (inside the package: modules; outside: top-level package names),
    at any depth of the file (imports inside functions count)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out = edges.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out |= {a.name if a.name in modules else a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                    + ([node.module] if node.module else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    out.add(sub if sub in modules else base if base in modules else base.split(".")[0])
        out.discard(name)
    return edges


def test_no_import_circle():
    edges = graph()
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in edges.get(m, ()):
            if n not in edges:
                continue
            assert state.get(n) != 1, "import circle: " + " -> ".join(path + [m, n])
            if n not in state:
                visit(n, path + [m])
        state[m] = 2
    for m in sorted(edges):
        if m not in state:
            visit(m, [])


def test_the_compiler_stages_import_no_runtime_and_no_torch():
    edges = graph()
    for stage in COMPILER:
        seen, todo = set(), [stage]
        while todo:
            m = todo.pop()
            for n in edges.get(m, ()):
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        assert not seen & {"torch", "triton"}, f"{stage} reaches {sorted(seen & {'torch', 'triton'})}"
        runtime = {m for m in seen if m.startswith("losscodegen") and m not in COMPILER}
        assert not runtime, f"{stage} imports runtime modules {sorted(runtime)}"


def test_a_backend_is_one_folder():
    edges = graph()
    backends = {m.split(".")[2] for m in edges if m.startswith(BACKENDS)}
    assert backends == set(LANGUAGES), f"backends {sorted(backends)}: list what each is written in"
    for m, imports in edges.items():
        own = m.split(".")[2] if m.startswith(BACKENDS) else None
        for name, language in LANGUAGES.items():
            if name == own:
                continue
            reached = sorted(imports & language) + sorted(n for n in imports if n.startswith(BACKENDS + name))
            assert not reached, f"{m} imports {reached}: only losscodegen/backends/{name}/ may"


# issue 34: ``import losscodegen`` costs at most torch's own import plus this (CPU seconds)
# What losscodegen's own modules may cost at import beyond torch's and sympy's (measured: ~0.07 CPU-s;
# with sympy ~0.45 s beyond torch, under the 0.5 s the hygiene budget allows: docs/decisions.md). The
# bound leaves room for a slow CI core: sympy's own import, which no change here can shorten, is
# kept out of it, so that the test cannot fail on a machine where only sympy is slow.
OWN_IMPORT_BUDGET_S = 0.25


def test_importing_losscodegen_costs_little_beyond_torch_and_sympy():
    """Measured in a fresh interpreter (no other test's imports count) as CPU time, which other
    processes on a loaded machine do not add to: ``import torch, sympy``, then ``import losscodegen``
    in the same process. The best of up to 5 runs (it stops at the first within budget). Bytecode is
    written (a checkout run with PYTHONDONTWRITEBYTECODE would compile the package at each import,
    which an installed package does not)."""
    code = ("import time\nimport torch, sympy\nstart = time.process_time()\n"
            "import losscodegen\nprint(time.process_time() - start)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    runs = []
    for _ in range(5):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent,
                              env=env)
        assert done.returncode == 0, done.stderr
        runs.append(float(done.stdout))
        if runs[-1] <= OWN_IMPORT_BUDGET_S:
            return
    assert False, (f"import losscodegen costs {min(runs):.2f} CPU-s beyond torch's and sympy's imports "
                   f"(budget {OWN_IMPORT_BUDGET_S} s; runs {runs})")


def test_importing_losscodegen_loads_neither_dynamo_nor_a_training_library():
    """``import losscodegen`` loads no Dynamo (2-3 s), no transformers or trl (a fresh interpreter,
    so that no other test's imports count), and declares no built-in term (each is declared at its
    first use)."""
    code = ("import sys, losscodegen, losscodegen.integrations\n"
            "heavy = ('torch._dynamo', 'transformers', 'trl', 'accelerate', 'datasets')\n"
            "print(sorted(m for m in heavy if m in sys.modules))\n"
            "print(sorted(n for n in losscodegen.terms.BUILTIN_NAMES if n in vars(losscodegen.terms)))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr
    loaded, declared = done.stdout.splitlines()
    assert loaded == "[]", f"import losscodegen loads {loaded}"
    assert declared == "[]", f"import losscodegen declares built-in terms {declared}"


def test_a_built_in_term_is_declared_at_its_first_use():
    """``lcg.CrossEntropy`` etc. are the same factories however they are reached, and BUILTINS
    lists them all, in order."""
    from losscodegen import terms
    assert [getattr(lcg, n) for n in terms.BUILTIN_NAMES] == list(terms.BUILTINS)
    assert lcg.JSD is terms.JSD
    assert set(terms.BUILTIN_NAMES) <= set(dir(lcg)) & set(lcg.__all__)
    assert lcg.JSD.trl(beta=0.0).name == "forward_kl"
    with pytest.raises(AttributeError, match="has no attribute 'CrossEntropi'"):
        lcg.CrossEntropi


def test_the_kernel_lookup_is_marked_as_torch_compilers_decorator_marks_it():
    """head._kernel_of is marked constant for Dynamo by hand (the decorator imports Dynamo): the mark
    must be what ``torch.compiler.assume_constant_result`` sets, on this torch."""
    def probe():
        return 0
    marked = torch.compiler.assume_constant_result(probe)
    assert marked is probe and vars(probe) == {"_dynamo_marked_constant": True}, vars(probe)
    assert vars(head._kernel_of).items() >= vars(probe).items()


def test_command_line_help_describes_every_option(monkeypatch):
    from losscodegen.__main__ import main
    parsers: list[argparse.ArgumentParser] = []

    def capture(self, *args, **kwargs):   # the parser main() builds, before it parses anything
        parsers.append(self)
        raise SystemExit(0)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(SystemExit):
        main([])
    (top,) = parsers
    (commands,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    undescribed = [f"{name} {action.option_strings or action.dest}"
                   for name, parser in commands.choices.items() for action in parser._actions if not action.help]
    described = {c.dest for c in commands._choices_actions if c.help}
    undescribed += [name for name in commands.choices if name not in described]
    assert top.description and not undescribed, f"options without a help text: {undescribed}"
