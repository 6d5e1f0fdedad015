"""fp32 precision on par with torch's own fp32: our error against float64 is at most about twice
torch's, torch computing the same formula the straightforward way (log_softmax, tanh, ...) in fp32
on the same inputs."""
import torch
import torch.nn.functional as F

import losscodegen as lcg

FLOOR = 1e-9   # an absolute floor under torch's error, for the values it gets exactly right


def _err(ours: torch.Tensor, ref64: torch.Tensor) -> float:
    return (ours.double() - ref64).abs().max().item()


def assert_on_par(what: str, ours: torch.Tensor, torch32: torch.Tensor, ref64: torch.Tensor) -> None:
    err, bar = _err(ours, ref64), 2 * _err(torch32, ref64) + FLOOR
    assert err <= bar, f"{what}: error {err:.3g} against float64, torch fp32's x2 is {bar:.3g}"


def test_softcap_is_as_precise_as_torch():
    # issue 25's repro: the capped logit 30*tanh(x/30) ~ x, whose error must be relative to x
    torch.manual_seed(42)
    x = torch.randn(4, 8)
    y = torch.randint(0, 8, (4,))
    head = lcg.HeadLoss(lcg.CrossEntropy(), softcap=30.0)
    ours_x = x.clone().requires_grad_()
    ours = head(ours_x, y, reduction="none").loss
    ours.sum().backward()
    results = {}
    for dtype in (torch.float32, torch.float64):
        xx = x.to(dtype).clone().requires_grad_()
        loss = F.cross_entropy(30.0 * torch.tanh(xx / 30.0), y, reduction="none")
        loss.sum().backward()
        results[dtype] = (loss.detach(), xx.grad)
    (v32, g32), (v64, g64) = results[torch.float32], results[torch.float64]
    assert_on_par("softcap CE value", ours.detach(), v32, v64)
    assert_on_par("softcap CE gradient", ours_x.grad, g32, g64)
