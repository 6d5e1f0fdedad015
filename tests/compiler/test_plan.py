"""Stage 3, plan (losscodegen/plan.py), alone: the launches of a call for each plan state, and what a
head's plan packs, reads and streams. The expectations are derived by hand from the rules plan.py
states (one launch on one device; a segment term needs every row's values before any gradient; an
exchange of packed stats ends a launch unless the shards exchange in-kernel; exact sums need the
final normalisers first), not read back from the code."""
import itertools

import pytest

import losscodegen as lcg
from losscodegen import symbols as S
from losscodegen.plan import Launch, launch_sequence, pow2


def L(text: str) -> Launch:
    """A launch written as its phases: "stats+store>gather" is Launch(stats=True, store_stats=True,
    then="gather")."""
    phases, _, then = text.partition(">")
    names = {"store": "store_stats"}
    return Launch(**{names.get(p, p): True for p in phases.split("+")}, then=then)


# (has_exact, segments, sharded, grad, split, exchange) -> the launches, by the rules above
EXPECTED = {
    # one device: one launch runs every phase (exact too; a kernel without exact sums skips it)
    (False, False, False, True, False, False): ["stats+exact+rows+grad"],
    (True, False, False, True, False, False): ["stats+exact+rows+grad"],
    (False, False, False, False, False, False): ["stats+exact+rows"],
    # a segment term: rows (and the segment sums) first, keeping the stats for the gradient launch
    (False, True, False, True, False, False): ["stats+exact+store+rows>segments", "grad"],
    (False, True, False, False, False, False): ["stats+exact+rows>segments"],
    # split (measured faster): a launch a read, each keeping what the next one reads
    (False, False, False, True, True, False): ["stats+store", "rows+grad"],
    (True, False, False, True, True, False): ["stats+store", "exact+store", "rows+grad"],
    (False, True, False, True, True, False): ["stats+store", "rows>segments", "grad"],
    # vocab-parallel: the packed stats gathered after the first read, merged by the next launch
    (False, False, True, True, False, False): ["stats+store>gather", "merge+rows+grad"],
    (False, False, True, False, False, False): ["stats+store>gather", "merge+rows"],
    (True, False, True, True, False, False): ["stats+store>gather", "merge+exact+store>sum_exact", "rows+grad"],
    (False, True, True, True, False, False): ["stats+store>gather", "merge+store+rows>segments", "grad"],
    (True, True, True, True, False, False): ["stats+store>gather", "merge+exact+store>sum_exact",
                                             "rows>segments", "grad"],
    # split changes nothing once sharded: each read is a launch already
    (False, False, True, True, True, False): ["stats+store>gather", "merge+rows+grad"],
    # in-kernel exchange: one launch without exact sums; with them, as without the exchange
    (False, False, True, True, False, True): ["stats+exchange+merge+rows+grad"],
    (False, True, True, True, False, True): ["stats+exchange+merge+store+rows>segments", "grad"],
    (True, False, True, True, False, True): ["stats+store>gather", "merge+exact+store>sum_exact", "rows+grad"],
}


@pytest.mark.parametrize("state", list(EXPECTED), ids=lambda s: "-".join(
    n for n, on in zip(("exact", "segments", "sharded", "grad", "split", "exchange"), s) if on) or "plain")
def test_each_plan_state_gets_its_launches(state):
    has_exact, segments, sharded, grad, split, exchange = state
    got = launch_sequence(has_exact=has_exact, segments=segments, sharded=sharded, grad=grad, split=split,
                          exchange=exchange)
    assert got == tuple(L(t) for t in EXPECTED[state])


@pytest.mark.parametrize("state", list(itertools.product([False, True], repeat=6)))
def test_every_launch_sequence_keeps_the_rules(state):
    """Over all 64 states: the first launch reads the vocabulary first; each later launch finds the
    stats a launch before it kept; rows are written once; the gradient is the last launch's, and
    only asked for; stats are merged once, and only across shards; an exact read where the head has
    exact sums; a host exchange ends every launch but the last exactly where the plan needs one."""
    has_exact, segments, sharded, grad, split, exchange = state
    seq = launch_sequence(has_exact=has_exact, segments=segments, sharded=sharded, grad=grad, split=split,
                          exchange=exchange)
    assert seq[0].stats
    for i in range(1, len(seq)):
        assert any(l.store_stats for l in seq[:i]), seq
    assert sum(l.rows for l in seq) == 1
    assert [l.grad for l in seq] == [False] * (len(seq) - 1) + [grad]
    assert sum(l.merge for l in seq) == int(sharded)
    assert any(l.exact for l in seq) or not has_exact
    assert sum(l.exchange for l in seq) == int(sharded and exchange and not has_exact)
    thens = [l.then for l in seq if l.then]
    assert thens == (["gather"] * (sharded and not (exchange and not has_exact))
                     + ["sum_exact"] * (sharded and has_exact) + ["segments"] * segments)
    # one launch is the fewest: one device, no split, no segment term's gradient to wait for
    assert (len(seq) == 1) == ((not sharded or (exchange and not has_exact)) and (sharded or not split)
                               and not (segments and grad))


def _columns(head):
    return [(c.name, c.merge) for c in head.plan().columns]


def test_cross_entropy_packs_the_max_the_target_logit_and_one_normaliser():
    p = lcg.HeadLoss(lcg.CrossEntropy()).plan()
    (m, z_y, lse) = p.columns
    assert (m.name, m.merge) == ("m", "max") and (z_y.name, z_y.merge) == ("z_y", "sum")
    # sum exp(z - m), rescaled by exp(m_shard - m) when shards merge: alpha 1, no teacher
    assert lse.merge == "scaled" and (lse.alpha, lse.beta) == (1, 0)
    assert p.exact == () and p.reads == 1
    assert [(w.name, w.reverse, w.streams) for w in p.sweeps] == [("stats", False, ("x",)), ("grad", True, ("x",))]
    grad = p.sweeps[-1]
    assert grad.evict_first and grad.stream_stores        # its last read of a row: nothing reads it again
    assert p.state == ("x", 1, 0)
    # bf16: the logits read twice (stats, gradient), the gradient written once
    assert p.bytes_per_element() == 2 + 2 + 2 and p.bytes_per_element(grad=False) == 2
    assert p.bytes_per_element(logit_bytes=4) == 4 + 4 + 4


def test_an_argmax_metric_adds_a_column_and_a_running_value():
    assert _columns(lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.TokenAccuracy(),)))[:3] == [
        ("m", "max"), ("z_y", "sum"), ("argmax", "argmax")]
    assert lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.TokenAccuracy(),)).plan().state == ("x", 2, 0)


def test_a_teacher_adds_its_max_and_a_stream_to_each_read():
    p = lcg.HeadLoss(lcg.ForwardKL()).plan()
    names = [c.name for c in p.columns]
    assert names[:2] == ["m", "m_t"] and "z_y" not in names   # no label read
    scaled = {(c.alpha, c.beta) for c in p.columns if c.merge == "scaled"}
    assert scaled == {(1, 0), (0, 1)}    # the student's normaliser and the teacher's sums
    assert p.exact == () and p.reads == 1
    # the gradient p - p_t reads the teacher again
    assert [w.streams for w in p.sweeps] == [("x", "t"), ("x", "t")]
    assert p.bytes_per_element() == 4 + 4 + 2


def test_a_mixture_log_needs_an_exact_read_between_stats_and_gradient():
    """JSD's log of the mixture of p and p_t is known only with both final normalisers: a second
    read of the logits and the teacher, run backward, then the gradient read forward."""
    p = lcg.HeadLoss(lcg.JSD()).plan()
    assert p.exact and p.reads == 2
    assert [(w.name, w.reverse) for w in p.sweeps] == [("stats", False), ("exact", True), ("grad", False)]
    assert p.bytes_per_element() == 3 * (2 + 2) + 2
    assert p.bytes_per_element(teacher_bytes=4) == 3 * (2 + 4) + 2
    assert p.state[0] == "xt" and p.state[2] == len(p.exact)
    assert p.launches(sharded=True, grad=True, exchange=True) == p.launches(sharded=True, grad=True)


def test_a_topk_sum_of_the_final_lse_has_exact_sums_but_no_exact_read():
    """log(1 - p) summed over the top-k entries needs the final lse: exact sums of the top-k entries
    only. No second read of the vocabulary, but split or sharded a launch must compute them."""
    u = lcg.declare_term("unlikely", -S.topk_sum(S.log(1 - S.exp(S.topk_logit - S.lse))))
    p = lcg.HeadLoss(u()).plan()
    assert p.exact and not p.lowered.has_exact and p.reads == 1
    assert [w.name for w in p.sweeps] == ["stats", "grad"]
    assert any(l.exact for l in p.launches(sharded=False, grad=True, split=True)[1:-1])
    assert len(p.launches(sharded=True, grad=True, exchange=True)) == 3


def test_a_segment_term_splits_rows_from_the_gradient():
    p = lcg.HeadLoss(lcg.GSPO()).plan()
    assert p.launches(sharded=False, grad=True) == (L("stats+exact+store+rows>segments"), L("grad"))
    assert p.launches(sharded=False, grad=False) == (L("stats+exact+rows>segments"),)


def test_a_softcap_is_recorded_and_changes_no_column():
    plain, capped = lcg.HeadLoss(lcg.CrossEntropy()).plan(), lcg.HeadLoss(lcg.CrossEntropy(), softcap=30.0).plan()
    assert capped.softcap and not plain.softcap and capped.columns == plain.columns


@pytest.mark.parametrize("n,want", [(0, 1), (1, 1), (2, 2), (3, 4), (1000, 1024), (1024, 1024), (1025, 2048)])
def test_pow2_is_the_least_power_of_two_not_below(n, want):
    assert pow2(n) == want


def test_the_plan_prints_each_launch_sequence():
    text = str(lcg.HeadLoss(lcg.JSD()).plan())
    assert "single device: 1 launch(es): [stats+exact+rows+grad]" in text
    assert "sharded: 3 launch(es): [stats] gather -> [merge+exact] sum_exact -> [rows+grad]" in text
