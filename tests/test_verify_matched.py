"""verify's matched draws (verify/matched.py), in process: every draw form a training step makes is the same at one
process (the global batch) and at N (each rank its rows r, r + N, ...), and the mode changes nothing else about
the program (a leaf stays a leaf, torch.normal passes no gradient, channels_last stays). The review of the fourth
held-out fixes found randint's keyword forms crashing the mode, a non-leaf noise and gradients through normal."""
import pytest
import torch
from torch.nn import functional

from ddpkit.commands.verify.matched import MatchedDraws, worth_rerun

FORMS = {
    "randn": lambda b: torch.randn(b, 3), "rand-tuple": lambda b: torch.rand((b, 2)),
    "randint": lambda b: torch.randint(0, 10, (b,)), "randint-high": lambda b: torch.randint(5, size=(b, 2)),
    "randint-keywords": lambda b: torch.randint(low=1, high=5, size=(b, 2)),
    "randn_like": lambda b: torch.randn_like(torch.ones(b, 4)), "dropout": lambda b: functional.dropout(
        torch.ones(b, 4), 0.5, True), "normal": lambda b: torch.normal(torch.zeros(b, 2), 2.0),
    "normal_": lambda b: torch.empty(b, 3).normal_(0, 2), "uniform_": lambda b: torch.empty(b, 2).uniform_(-1, 1),
    "bernoulli": lambda b: torch.bernoulli(torch.full((b, 3), 0.5)),
    "bernoulli_-tensor": lambda b: torch.empty(b, 2).bernoulli_(torch.full((b, 2), 0.3)),
    "fixed-size": lambda b: torch.randn(7),
    # set 26: a course's MLP drew its mask with torch's own form (train= by keyword)
    "torch.dropout": lambda b: torch.dropout(torch.ones(b, 4), 0.5, train=True),
}


def _drawn(form, batch, rank, world):
    with MatchedDraws(batch, rank, world) as mode:
        first = FORMS[form](batch)
        mode.next_step()
        second = FORMS[form](batch)
    assert mode.unmatched == 0, form
    return first, second


@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_draw_form_is_the_global_batchs_rows_at_two_processes(form):
    one = _drawn(form, 4, 0, 1)
    ranks = [_drawn(form, 2, r, 2) for r in (0, 1)]
    for step in (0, 1):
        whole = one[step]
        if whole.dim() and whole.shape[0] == 4:
            joined = torch.empty_like(whole)
            joined[0::2], joined[1::2] = ranks[0][step], ranks[1][step]
            assert torch.equal(joined, whole), form
        else:
            assert all(torch.equal(r[step], whole) for r in ranks), form
    assert not torch.equal(one[0], one[1]) or form.endswith("dropout")  # another step, other numbers


def test_the_mode_keeps_leaves_gradients_and_layouts():
    with MatchedDraws(2, 1, 2):
        noise = torch.randn(2, 3, requires_grad=True)
        mu = torch.zeros(2, 3, requires_grad=True)
        sample = torch.normal(mu, 1.0)
        image = torch.randn_like(torch.ones(2, 3, 4, 4).contiguous(memory_format=torch.channels_last))
    assert noise.is_leaf and noise.requires_grad
    assert not sample.requires_grad  # torch.normal gives its mean no gradient
    assert image.is_contiguous(memory_format=torch.channels_last)


def test_no_rerun_without_a_batch_to_match_by():
    facts = {"passed": False, "non_finite": False, "random_draws": True, "draw_sources": ["torch"]}
    assert worth_rerun(facts) and not worth_rerun({**facts, "matchable": False})


def test_a_draw_from_the_scripts_own_generator_counts_as_unmatched():
    """Review 40: a draw given a generator of the script's own passes as written, and was counted as nothing, so
    verify took "every draw matched" for true and FAILed a correct script whose noise came from a per-rank
    generator of its own."""
    own = torch.Generator().manual_seed(1)
    with MatchedDraws(4, 0, 1) as mode:
        torch.randn(4, 3, generator=own)
    assert mode.unmatched == 1 and mode.matched == 0
