"""pipeline.checkpoint.dcp: a DCP item (one ``torch.save``d tensor) read straight into its
destination only when its own pickle says it is that tensor, whole; everything else goes DCP's
way (``torch.load(weights_only=True)``), which still refuses what it always refused."""

from __future__ import annotations

import io
import pickle
from types import SimpleNamespace

import pytest
import torch

from pipeline.checkpoint import dcp as cd


def _item(obj: object) -> cd.Slice:
    """``obj`` saved as DCP saves an item, inside a larger stream (as in a shard file)."""
    buf = io.BytesIO()
    buf.write(b"x" * 1000)  # the items before it
    start = buf.tell()
    torch.save(obj, buf)
    length = buf.tell() - start
    buf.write(b"y" * 77)  # and after it
    buf.seek(0)
    return cd.Slice(buf, start, length)


def _whole(t: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(storage_offsets=[0] * t.dim(), lengths=list(t.shape))


@pytest.mark.parametrize("saved", [torch.randn(33, 17), torch.randn(8, 4).to(torch.bfloat16),
                                   torch.tensor(2.5), torch.arange(10, dtype=torch.int64)],
                         ids=["fp32", "bf16", "scalar", "int64"])
def test_a_whole_contiguous_item_is_read_into_its_destination(saved: torch.Tensor) -> None:
    target = torch.full_like(saved, 7)
    address = target.data_ptr()
    assert cd.read_item_into(_item(saved), _whole(saved), target)
    assert torch.equal(target, saved) and target.data_ptr() == address


def test_anything_else_is_left_to_torch_load() -> None:
    t = torch.randn(6, 5)
    # Another dtype or shape than the destination's, a slice of the item, a stored transpose
    # (compact, not row-major), a view of a larger storage, a destination that is not
    # contiguous: nothing is read into the destination.
    cases = [
        (_item(t), _whole(t), torch.zeros(6, 5, dtype=torch.float64)),
        (_item(t), _whole(t), torch.zeros(5, 6)),
        (_item(t), SimpleNamespace(storage_offsets=[2, 0], lengths=[4, 5]), torch.zeros(4, 5)),
        (_item(t.t().contiguous().t()), _whole(t), torch.zeros(6, 5)),
        (_item(t[2:]), SimpleNamespace(storage_offsets=[0, 0], lengths=[4, 5]), torch.zeros(4, 5)),
        (_item(t), _whole(t), torch.zeros(5, 6).t()),
        (_item({"not": "a tensor"}), _whole(t), torch.zeros(6, 5)),
    ]
    for f, req, target in cases:
        before = target.clone()
        assert not cd.read_item_into(f, req, target)
        assert torch.equal(target, before)


class _Evil:
    def __reduce__(self) -> tuple:
        return (print, ("pwned",))


def test_a_foreign_pickle_is_never_unpickled_by_the_fast_path() -> None:
    f = _item(_Evil())
    assert cd._meta_tensor(b"not a pickle") is None
    assert not cd.read_item_into(f, _whole(torch.zeros(1)), torch.zeros(1))
    f.seek(0)
    with pytest.raises(pickle.UnpicklingError):  # and DCP's way refuses it as before
        torch.load(f, weights_only=True)


def _adamw(amsgrad: bool = False) -> torch.optim.AdamW:
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2, bias=False))
    model[0].bias.requires_grad_(False)  # a frozen parameter gets no state
    return torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1, amsgrad=amsgrad)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_a_fresh_adamws_state_for_a_load_is_the_one_its_first_step_makes(amsgrad: bool) -> None:
    """``adamw_state_for_load`` replaces torch's ``_init_optim_state`` (a whole step on zero
    gradients) before a DCP load: the same keys, shapes, dtypes and devices per parameter,
    the parameters untouched, so DCP plans the same reads."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    from pipeline.train.engines import adamw_state_for_load

    ours, theirs = _adamw(amsgrad), _adamw(amsgrad)
    params = [p.detach().clone() for g in ours.param_groups for p in g["params"]]
    assert adamw_state_for_load(ours)
    _init_optim_state(theirs)
    mine = [ours.state.get(p) for g in ours.param_groups for p in g["params"]]
    ref = [theirs.state.get(p) for g in theirs.param_groups for p in g["params"]]

    def shape(st: dict | None) -> dict | None:
        return None if st is None else {k: (v.shape, v.dtype, v.device) for k, v in st.items()}

    assert [shape(s) for s in mine] == [shape(s) for s in ref]
    assert sum(s is None for s in mine) == 1  # the frozen bias
    after = [p for g in ours.param_groups for p in g["params"]]
    assert all(torch.equal(a, b) for a, b in zip(params, after, strict=True))
    assert not adamw_state_for_load(ours)  # state already there: left as it is
    assert not adamw_state_for_load(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1))
