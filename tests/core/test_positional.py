"""Keyword arguments handed to ``checkpoint`` positionally (``lightning_ckpt.core.positional``)."""

import torch

from lightning_ckpt.core.positional import keywords_as_positional


def _record(*args, **kwargs):
    return args, kwargs


def test_without_keywords_nothing_is_wrapped():
    fn, inputs = keywords_as_positional(_record, [1, 2], {})
    assert fn is _record and inputs == (1, 2)


def test_keywords_come_back_by_name_in_their_order():
    t = torch.ones(2)
    nested = {"a": (t, [t])}
    fn, inputs = keywords_as_positional(_record, (1,), {"x": t, "extras": nested, "debug": True})
    assert inputs[0] == 1 and inputs[1] is t and inputs[2] is nested and inputs[3] is True
    args, kwargs = fn(*inputs)
    assert args == (1,) and list(kwargs) == ["x", "extras", "debug"]
    assert kwargs["x"] is t and kwargs["extras"] is nested and kwargs["debug"] is True


def test_checkpoint_options_used_as_keyword_names_stay_the_functions():
    """``debug`` and ``use_reentrant`` are ``checkpoint``'s own options: as block keywords they never reach it."""
    seen = {}

    def body(x, *, debug, use_reentrant):
        seen.update(debug=debug, use_reentrant=use_reentrant)
        return x * 2

    x = torch.ones(3, requires_grad=True)
    fn, inputs = keywords_as_positional(body, (x,), {"debug": "mine", "use_reentrant": "also mine"})
    torch.utils.checkpoint.checkpoint(fn, *inputs, use_reentrant=False).sum().backward()
    assert seen == {"debug": "mine", "use_reentrant": "also mine"} and torch.equal(x.grad, torch.full((3,), 2.0))
