"""The phase program (losscodegen/program.py) and its dialects: a third backend's dialect, written
here and nowhere else (a NumPy printer and three primitives, laid out by a template of its own),
renders a head's first read and the vocab shards' merge; what it computes is checked against
float64 NumPy on the whole row. Both shipped backends render from the same program (their files
are otherwise unchanged: tests/compiler/test_generation.py's ``generate --check``)."""
import numpy as np
import pytest
import sympy as sp

import losscodegen as lcg
from losscodegen import emit, program
from losscodegen.plan import Merge
from losscodegen.program import Dialect, MergeStep, OnlineGroup


class NumpyPrinter(emit.ArrayPrinter):
    module = "np"


class NumpyDialect(Dialect):
    """A row block at a time, each value a [rows, 1] or [rows, block] array; the shards' stats a
    [world, rows, columns] array (``part``) merged over its first axis."""

    printer = NumpyPrinter()

    def summand(self, group: OnlineGroup, body: sp.Expr) -> str:
        return f"({self.print(body)}) * np.ones_like(zb)"

    def row_value(self, index: int) -> str:
        return f"v[:, {index}]"

    def merge(self, steps: tuple[MergeStep, ...]) -> list[str]:
        lines = []
        for c in steps:
            part = f"part[:, :, {c.at}:{c.at + 1}]"
            if c.rule is Merge.MAX:
                lines += [f"{c.name}_r = {part}", f"{c.name} = {c.name}_r.max(0)"]
            elif c.rule is Merge.SCALED:
                if c.moved is not None:
                    base = f"part[:, :, {c.base_at}:{c.base_at + 1}]"
                    part = f"({part} + {self.where(f'{base} > 0.0', f'({self.print(c.moved)}) * {base}', '0.0')})"
                lines.append(f"{c.name} = ({part} * {self.print(sp.exp(c.rescale))}).sum(0)")
            else:
                raise NotImplementedError(c.rule)   # (the heads below have no other rule)
        return lines


# the toy backend's layout: the first read a block of columns at a time, then the merge
TEMPLATE = """
def stats(z, t, block):
    m = np.full((z.shape[0], 1), -np.inf)
    m_t = np.full((z.shape[0], 1), -np.inf)
{inits}
    for start in range(0, z.shape[1], block):
        zb, tb = z[:, start:start + block], t[:, start:start + block]
        m_new = np.maximum(m, zb.max(1, keepdims=True))
        m_ref = np.where(m_new == -np.inf, 0.0, m_new)
        m_t_new = np.maximum(m_t, tb.max(1, keepdims=True))
        m_t_ref = np.where(m_t_new == -np.inf, 0.0, m_t_new)
        zm, tm = zb - m_ref, tb - m_t_ref
{online}
        m, m_t = m_new, m_t_new
    return np.concatenate([{columns}], 1)


def merge(part):
{merge}
    return np.concatenate([{columns}], 1)
"""


def render(head: lcg.HeadLoss, dialect: Dialect) -> str:
    plan = head.plan()
    body, _ = emit.printed_bodies(plan.lowered)
    online = []
    for g in dialect.online(program.online(plan, body)):
        online += [f"s{g['index']} = {g['scale'] or '1.0'}", f"r{g['index']} = {g['rescale'] or '1.0'}"]
        online += [f"{acc}_moved = {moved}" for acc, moved in g["shifts"].items()]
        online += [f"{acc} = ({acc}{f' + {acc}_moved' if acc in g['shifts'] else ''}) * r{g['index']}"
                   f" + (s{g['index']} * {summand}).sum(1, keepdims=True)" for acc, summand in g["accs"]]
    inits = [f"{acc} = np.zeros((z.shape[0], 1))" for g in program.online(plan, body) for acc, _ in g.accs]
    return TEMPLATE.format(inits="\n".join("    " + s for s in inits),
                           online="\n".join("        " + s for s in online),
                           merge="\n".join("    " + s for s in dialect.merge(program.merge(plan))),
                           columns=", ".join(c.name for c in plan.columns))


HEADS = {"z-loss + entropy": lcg.HeadLoss(lcg.ZLoss(), metrics=(lcg.Entropy(),)),
         "forward + reverse KL + entropy": lcg.HeadLoss(lcg.ForwardKL(), lcg.ReverseKL(), metrics=(lcg.Entropy(),))}


@pytest.mark.parametrize("name", list(HEADS))
def test_a_third_dialect_renders_the_first_read_and_the_merge_of_vocab_shards(name):
    head = HEADS[name]
    text = render(head, NumpyDialect())
    toy: dict = {"np": np}
    exec(compile(text, f"<toy dialect: {name}>", "exec"), toy)   # (a test may exec: the package never does)
    rng = np.random.default_rng(0)
    z, t = rng.normal(0, 3, (5, 96)), rng.normal(0, 2, (5, 96))
    # (the first block's moves are selected away where they are -inf * 0, as in every dialect)
    with np.errstate(invalid="ignore"):
        whole = toy["stats"](z, t, 16)
        # three vocab shards, each read on its own, then merged
        part = np.stack([toy["stats"](z[:, s:s + 32], t[:, s:s + 32], 16) for s in (0, 32, 64)])
        merged = toy["merge"](part)
    np.testing.assert_allclose(merged, whole, rtol=1e-12, atol=1e-12)
    # and what the columns mean, in float64 NumPy on the whole row
    cols = dict(zip([c.name for c in head.plan().columns], whole.T))
    np.testing.assert_allclose(cols["m"], z.max(1))
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    p = np.exp(z - lse[:, None])
    group = next(g for g in program.online(head.plan(), emit.printed_bodies(head.plan().lowered)[0])
                 if g.exponent == emit.online_exponent(1, 0))
    sums = dict(group.accs)
    norm = next(a for a, b in sums.items() if b == 1)     # sum exp(z - m)
    np.testing.assert_allclose(np.log(cols[norm]) + cols["m"], lse, rtol=1e-12)
    rel = next(a for a, b in sums.items() if b == emit.ZM)  # sum exp(z - m) (z - m): the entropy's
    np.testing.assert_allclose(cols[rel] / cols[norm], (p * (z - z.max(1, keepdims=True))).sum(1), rtol=1e-10)


def test_the_shipped_dialects_differ_only_in_their_primitives():
    """Each backend's dialect writes the same program: the same groups, shifts and merge steps, in
    its own ops."""
    from losscodegen.backends.torch.render import TorchDialect
    from losscodegen.backends.triton.render import TritonDialect
    head = HEADS["forward + reverse KL + entropy"]
    plan = head.plan()
    groups = program.online(plan, emit.printed_bodies(plan.lowered)[0])
    for dialect in (TorchDialect(), TritonDialect(), NumpyDialect()):
        printed = dialect.online(groups)
        assert [sorted(g["shifts"]) for g in printed] == [["acc1"], ["acc3", "acc4"]]
        assert all(f"{dialect.printer.module}.where(acc" in moved for g in printed for moved in g["shifts"].values())
    steps = program.merge(plan)
    assert [s.rule for s in steps] == [Merge.MAX] * 2 + [Merge.SCALED] * 5
    assert TorchDialect().merge(steps)[0] == "m_r = part[:, :, 0:1]"
    assert TritonDialect().merge(steps)["maxima"][0] == "m = tl.maximum(m, tl.load(part + r * step + 0))"
