"""The zero-bubble weight-gradient store belongs to whoever defers (a pipeline stage's chunk), not to the
module: only the owner's parameters are deferred, and two owners deferring at once keep their own work."""

from __future__ import annotations

import torch
from torch import nn

from ptdp.ops.weight_grad import defer_weight_grads, grad_deferred, linear


def test_only_the_owners_parameters_are_deferred():
    torch.manual_seed(0)
    w1, w2 = nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(3, 6))
    x = torch.randn(5, 4)
    linear(linear(x, w1), w2).square().sum().backward()
    want = (w1.grad.clone(), w2.grad.clone())
    w1.grad = w2.grad = None
    seen = []
    w1.register_post_accumulate_grad_hook(lambda p: seen.append(grad_deferred(p)))
    with defer_weight_grads([w1]) as store:  # w2 belongs to no deferring owner: computed at once
        linear(linear(x, w1), w2).square().sum().backward()
    assert w1.grad is None and w2.grad is not None and len(store) == 1 and seen == [True]
    torch.testing.assert_close(w2.grad, want[1])
    store.run()
    assert seen == [True, False]  # W's accumulation is the real one (what the gradient buffers count)
    torch.testing.assert_close(w1.grad, want[0])


def test_two_owners_defer_at_once_into_their_own_stores():
    torch.manual_seed(1)
    w1, w2 = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4)
    with defer_weight_grads([w1]) as first, defer_weight_grads([w2]) as second:
        linear(x, w1).sum().backward()
        linear(x, w2).sum().backward()
    assert (len(first), len(second)) == (1, 1) and w1.grad is None and w2.grad is None
    first.run()
    assert w1.grad is not None and w2.grad is None
    second.run()
    torch.testing.assert_close(w2.grad, torch.ones(2, 4).t().mm(x))
    assert not hasattr(w1, "_ptdp_weight_grad_store") or w1._ptdp_weight_grad_store is None
