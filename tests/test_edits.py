"""Every edit a real training loop makes to the optimizer from outside, native vs Cotangent.

Native AdamW reads `param_groups` and `state[p]` afresh at every step. Each test applies the same
edit to a native `torch.optim.AdamW` (through `cotangent.ReferenceUpdate`, the one oracle) and to
`cotangent.AdamW`, then compares every parameter, gradient and state entry byte for byte
(`cotangent.verify.first_difference`). Where native itself fails (a popped moment, a moment of
another shape), Cotangent must raise a clear error before anything is modified.
Holds for: CPU, torch 2.13.0, float32 parameters, for-loop / foreach / fused AdamW.
"""

from __future__ import annotations

import copy
from collections import Counter, defaultdict

import pytest
import torch
import torch.nn as nn

import cotangent
from bitwise import assert_same_bits, assert_same_update, assert_step_refused

from cases import HP, IMPLS, lockstep, mlp, square


def pair(make=mlp, *, groups=None, max_norm=0.05, impl="fused", **kw):
    """(native model, native reference, our model, our optimizer) from one initial state."""
    m1 = make()
    m2 = copy.deepcopy(m1)
    opts = dict(HP, **IMPLS[impl], **kw)
    if groups:  # both clip the param groups in order (the clip order must be stated)
        opts.setdefault("clip_order", "param_groups")
    ref = cotangent.ReferenceUpdate(groups(m1) if groups else m1.parameters(),
                                    max_norm=max_norm, **copy.deepcopy(opts))
    opt = cotangent.AdamW(groups(m2) if groups else m2.parameters(), max_norm=max_norm,
                          **copy.deepcopy(opts))
    return m1, ref, m2, opt


def train(m1, ref, m2, opt, steps, what, *, edit=None):
    """`cases.lockstep` with `edit(step, (model, optimizer))` applied to each side after the
    backward, before the step."""
    return lockstep(m1, ref, m2, opt, steps, what, edit=edit)


def square_loss(m, x):
    return square(m, x, 0)


def snapshot(opt, p) -> dict:
    return {k: v.clone() for k, v in opt.state[p].items()}


# ------------------------------------------------------------------ 1. state edited from outside

@pytest.mark.parametrize("impl", list(IMPLS))
def test_state_rolled_back_by_assigning_saved_clones(impl):
    """Issue input 1(a): save clones after 3 steps, 2 more steps, assign them back, step."""
    m1, ref, m2, opt = pair(impl=impl)
    saved = {}

    def edit(step, side):
        model, o = side
        p = model[0].weight
        if step == 3:
            saved[id(o)] = snapshot(o, p)
        if step == 5:
            o.state[p] = saved[id(o)]

    train(m1, ref, m2, opt, 7, f"rollback {impl}", edit=edit)
    assert int(opt.state[m2[0].weight]["step"]) == 5  # 3, +1 after the rollback, +1
    assert int(opt.state[m2[3].weight]["step"]) == 7


@pytest.mark.parametrize("impl", list(IMPLS))
def test_whole_optimizer_state_rolled_back(impl):
    """Checkpoint rollback through a wrapper: every parameter's state replaced at once, by
    assignment to the same defaultdict and by `update()` of each entry dict."""
    m1, ref, m2, opt = pair(impl=impl)
    saved = {}

    def edit(step, side):
        model, o = side
        if step == 2:
            saved[id(o)] = {p: snapshot(o, p) for p in model.parameters()}
        if step == 4:
            for p in model.parameters():
                o.state[p] = copy.deepcopy(saved[id(o)][p])
        if step == 6:
            for p in model.parameters():
                o.state[p].update(copy.deepcopy(saved[id(o)][p]))

    train(m1, ref, m2, opt, 8, f"whole rollback {impl}", edit=edit)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_state_values_zeroed_in_place_restart_the_step_count(impl):
    """Issue input 1(b): every value of the first weight's state zeroed in place after 3 steps;
    native's next step count is 1 (a merged range must not copy a neighbour's count back)."""
    m1, ref, m2, opt = pair(impl=impl)

    def edit(step, side):
        model, o = side
        if step == 3:
            for v in o.state[model[0].weight].values():
                v.zero_()

    train(m1, ref, m2, opt, 5, f"zeroed state {impl}", edit=edit)
    assert int(opt.state[m2[0].weight]["step"]) == 2
    assert int(opt.state[m2[0].bias]["step"]) == 5


@pytest.mark.parametrize("how", ["assign tensor", "assign float64", "in place", "via .data",
                                 "via numpy", "+= in place", "assign int64"])
@pytest.mark.parametrize("impl", ["fused", "for-loop"])
def test_step_count_edited_every_way(impl, how):
    """Issue input 1(c) and its siblings: `state[p]["step"]` replaced (other dtypes too) or
    written in place (also through `.data` and numpy, which bump no version counter)."""
    if impl == "fused" and how == "assign int64":
        pytest.skip("native fused AdamW rejects an integer step")
    m1, ref, m2, opt = pair(impl=impl)

    def edit(step, side):
        model, o = side
        if step != 3:
            return
        st = o.state[model[3].bias]
        if how == "assign tensor":
            st["step"] = torch.tensor(0.0)
        elif how == "assign float64":
            st["step"] = torch.tensor(1.0, dtype=torch.float64)
        elif how == "assign int64":
            st["step"] = torch.tensor(1)
        elif how == "in place":
            st["step"].fill_(1.0)
        elif how == "via .data":
            st["step"].data.fill_(1.0)
        elif how == "via numpy":
            st["step"].numpy()[...] = 1.0
        else:
            st["step"] += 10

    train(m1, ref, m2, opt, 6, f"step {how} {impl}", edit=edit)


@pytest.mark.parametrize("how", ["del", "clear", "pop", "assign empty", "new defaultdict",
                                 "clear all"])
def test_state_dropped_starts_the_parameter_afresh(how):
    m1, ref, m2, opt = pair(impl="for-loop")

    def edit(step, side):
        model, o = side
        if step != 2:
            return
        p = model[0].weight
        if how == "del":
            del o.state[p]
        elif how == "clear":
            o.state[p].clear()
        elif how == "pop":
            o.state.pop(p)
        elif how == "assign empty":
            o.state[p] = {}
        elif how == "clear all":
            o.state.clear()
        else:
            o.state = defaultdict(dict)

    train(m1, ref, m2, opt, 5, f"state {how}", edit=edit)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_moment_replaced_or_repointed_is_followed(impl):
    """`state[p]["exp_avg"] = t`, `state[p]["exp_avg_sq"].data = t`, and an extra user key."""
    m1, ref, m2, opt = pair(impl=impl)

    def edit(step, side):
        model, o = side
        st = o.state[model[0].weight]
        if step == 2:
            st["exp_avg"] = torch.full_like(st["exp_avg"], 0.01)
            st["ema_note"] = torch.ones(1)  # libraries keep their own keys in state
        if step == 3:
            st["exp_avg_sq"].data = torch.full_like(st["exp_avg_sq"], 1e-4)

    train(m1, ref, m2, opt, 5, f"moment replaced {impl}", edit=edit)


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq", "step"])
def test_popped_state_entry_is_a_clear_error_before_anything_changes(key):
    """Native raises KeyError inside step(); Cotangent raises a message naming the parameter,
    with nothing modified, and steps again once the entry is back."""
    m1, ref, m2, opt = pair(impl="foreach")
    train(m1, ref, m2, opt, 2, "before")
    for m, o in ((m1, ref), (m2, opt)):
        o.zero_grad()
        square_loss(m, torch.ones(4, 8)).backward()
    value = opt.state[m2[3].weight].pop(key)
    ref.optimizer.state[m1[3].weight].pop(key)
    with pytest.raises(KeyError):
        ref.step()
    params = [p.detach().clone() for p in m2.parameters()]
    grads = [p.grad.clone() for p in m2.parameters()]
    with pytest.raises(RuntimeError, match=f"parameter 4 .*has no '{key}' entry"):
        opt.step()
    for p, before, g in zip(m2.parameters(), params, grads):
        assert_same_bits(p, before, "parameter after the refused step")
        assert_same_bits(p.grad, g, "gradient after the refused step")
    opt.state[m2[3].weight][key] = value
    opt.step()  # usable again


@pytest.mark.parametrize("bad", ["broadcastable shape", "other shape", "other dtype",
                                 "python number step"])  # (a (1,) step runs, as native's:
# test_inputs.test_a_one_element_step_tensor_runs_as_native_runs_it)
def test_wrong_state_tensor_is_a_clear_error(bad):
    m1, ref, m2, opt = pair(impl="for-loop")
    train(m1, ref, m2, opt, 2, "before")
    st = opt.state[m2[0].weight]  # a (16, 8) weight
    if bad == "broadcastable shape":
        st["exp_avg"] = torch.zeros(1, 8)
    elif bad == "other shape":
        st["exp_avg"] = torch.zeros(8, 16)
    elif bad == "other dtype":
        st["exp_avg_sq"] = torch.zeros(16, 8, dtype=torch.float64)
    else:  # a python number step
        st["step"] = 2.0
    opt.zero_grad()
    square_loss(m2, torch.ones(4, 8)).backward()
    before = [p.detach().clone() for p in m2.parameters()]
    with pytest.raises(RuntimeError, match="parameter 0 "):
        opt.step()
    for p, b in zip(m2.parameters(), before):
        assert_same_bits(p, b, "parameter after the refused step")


def test_fused_moment_of_another_shape_is_refused_where_native_fused_reads_it_flat():
    """A break-it review's input, a known difference (docs/bitwise.md): a (16, 8) parameter's
    `exp_avg` replaced by an (8, 16) tensor. Native fused AdamW steps on (it reads the moment's
    memory flat); cotangent.AdamW(fused=True) refuses at step(), nothing modified."""
    m1, ref, m2, opt = pair(impl="fused")
    train(m1, ref, m2, opt, 2, "before")
    for m, o in ((m1, ref.optimizer), (m2, opt)):
        st = o.state[m[0].weight]
        st["exp_avg"] = st["exp_avg"].reshape(8, 16).clone()
        o.zero_grad()
        square_loss(m, torch.ones(4, 8)).backward()
    ref.optimizer.step()  # native fused: no error
    assert_step_refused(opt, m2.parameters(), "parameter 0 ")


def test_amsgrad_switched_on_mid_run_is_a_clear_error_like_native():
    m1, ref, m2, opt = pair(impl="for-loop")
    train(m1, ref, m2, opt, 2, "before")
    for o in (ref.optimizer, opt):
        o.param_groups[0]["amsgrad"] = True
    for m, o in ((m1, ref), (m2, opt)):
        o.zero_grad()
        square_loss(m, torch.ones(4, 8)).backward()
    with pytest.raises(KeyError):
        ref.step()
    with pytest.raises(RuntimeError, match="max_exp_avg_sq"):
        opt.step()


@pytest.mark.parametrize("edit_name", ["weight decay 0 -> 0.1", "fused switched on",
                                       "lr float -> tensor", "betas cycled", "maximize on",
                                       "amsgrad off"])
def test_hyperparameter_edits_mid_run(edit_name):
    start = dict(weight_decay=0.0) if edit_name.startswith("weight") else {}
    if edit_name == "amsgrad off":
        start = dict(amsgrad=True)
    m1, ref, m2, opt = pair(impl="for-loop", **start)

    def edit(step, side):
        _, o = side
        if step != 2:
            return
        for g in o.param_groups:
            if edit_name.startswith("weight"):
                g["weight_decay"] = 0.1
            elif edit_name == "fused switched on":
                g["fused"], g["foreach"] = True, False
            elif edit_name == "lr float -> tensor":
                g["lr"] = torch.tensor(g["lr"])
            elif edit_name == "betas cycled":  # OneCycleLR with cycle_momentum does this
                g["betas"] = (0.85, g["betas"][1])
            elif edit_name == "maximize on":
                g["maximize"] = True
            else:
                g["amsgrad"] = False

    train(m1, ref, m2, opt, 5, edit_name, edit=edit)


@pytest.mark.parametrize("single_pass", ["on", "0"])
def test_amsgrad_switched_off_and_on_again_reads_the_kept_maximum(single_pass, monkeypatch):
    """amsgrad on, off at step 2 (with every ``exp_avg`` replaced by a clone, so that the state
    is checked again without amsgrad), on again at step 4: native keeps ``max_exp_avg_sq`` in
    the state all along and reads it again. Natively run calls (``COTANGENT_SINGLE_PASS=0``)
    used to raise TypeError there, from the remembered check of a parameter last checked
    without amsgrad (found 2026-12-04)."""
    monkeypatch.setenv("COTANGENT_SINGLE_PASS", single_pass)
    m1, ref, m2, opt = pair(impl="for-loop", amsgrad=True)

    def edit(step, side):
        if step in (2, 4):
            for g in side[1].param_groups:
                g["amsgrad"] = step == 4
        if step == 2:
            for st in side[1].state.values():
                st["exp_avg"] = st["exp_avg"].clone()

    train(m1, ref, m2, opt, 6, "amsgrad off, then on", edit=edit)
    assert all("max_exp_avg_sq" in st for st in opt.state.values())


@pytest.mark.parametrize("edit", ["amsgrad on, no max_exp_avg_sq", "del exp_avg", "del step",
                                  "exp_avg resized by set_", "exp_avg_sq resized by .data"])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_state_broken_after_a_remembered_check_is_refused_before_anything_changes(impl, edit):
    """Natively run calls (float64) remember the state they checked; an entry deleted or a
    moment resized in place afterwards is refused like a fresh check, before anything changes
    (it used to get past the remembered check and fail mid-update; found 2026-12-04)."""
    p = nn.Parameter(torch.randn(3, 4, dtype=torch.float64))
    opt = cotangent.AdamW([p], lr=1e-2, **IMPLS[impl])
    p.grad = torch.ones_like(p)
    opt.step()
    opt.step()
    st = opt.state[p]
    if edit.startswith("amsgrad"):
        opt.param_groups[0]["amsgrad"] = True
    elif edit.startswith("del"):
        del st[edit.split()[1]]
    elif "set_" in edit:
        st["exp_avg"].set_(torch.zeros(13, dtype=torch.float64))
    else:
        st["exp_avg_sq"].data = torch.zeros(12, dtype=torch.float64)
    before = {k: v.clone() for k, v in st.items()}, p.detach().clone(), p.grad.clone()
    with pytest.raises(RuntimeError, match="state"):
        opt.step()
    assert_same_bits(p, before[1], "parameter")
    assert_same_bits(p.grad, before[2], "gradient")
    for k, v in before[0].items():
        assert_same_bits(st[k], v, k)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_a_state_dict_loaded_between_the_clip_and_the_step_clips_once(impl):
    """Native: ``clip_grad_norm_``, ``load_state_dict``, ``step``: one clip. Loading used to
    drop the record of the clip apart, so the step clipped again (found 2026-12-04)."""
    m1, ref, m2, opt = pair(impl=impl)
    train(m1, ref, m2, opt, 2, "before")
    for m, o in ((m1, ref), (m2, opt)):
        o.zero_grad()
        square_loss(m, torch.ones(4, 8)).backward()
    norm = torch.nn.utils.clip_grad_norm_(m1.parameters(), 0.05)
    ours = opt.clip_grad_norm_()
    ref.optimizer.load_state_dict(copy.deepcopy(ref.optimizer.state_dict()))
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    ref.optimizer.step()
    opt.step()
    assert_same_bits(norm, ours, "total norm")
    for (name, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        assert_same_bits(p1.grad, p2.grad, f"{name} gradient")
        assert_same_bits(p1, p2, name)


def test_clipping_settings_edited_mid_run():
    """`max_norm` switched on, `norm_type` changed: the clipper is rebuilt and recalibrated."""
    m1, ref, m2, opt = pair(impl="foreach", max_norm=None)

    def edit(step, side):
        _, o = side
        target = ref if o is ref.optimizer else o
        if step == 2:
            target.max_norm = 0.05
        if step == 4:
            target.norm_type = 1.0

    train(m1, ref, m2, opt, 6, "clipping edited", edit=edit)
    assert opt.last_total_norm is not None


# ------------------------------------------------------------------ 2. parameters replaced

def _grow(old: nn.Parameter, rows: int) -> nn.Parameter:
    """Densification: a parameter with `rows` more rows (new rows zero)."""
    extra = torch.zeros((rows,) + tuple(old.shape[1:]), dtype=old.dtype)
    return nn.Parameter(torch.cat([old.detach(), extra]))


def _densify(o, old: nn.Parameter, new: nn.Parameter, move_state: bool) -> None:
    """The point-cloud / Gaussian-splatting optimizer surgery: swap the Parameter inside its
    group, move its state to the new key with moments extended by zeros."""
    for group in o.param_groups:
        for i, p in enumerate(group["params"]):
            if p is old:
                group["params"][i] = new
    st = o.state.pop(old, None)
    if move_state and st:
        rows = new.shape[0] - old.shape[0]
        o.state[new] = {k: (torch.cat([v, torch.zeros((rows,) + tuple(v.shape[1:]),
                                                      dtype=v.dtype)]) if v.dim() else v.clone())
                        for k, v in st.items()}


class Cloud(nn.Module):
    """A point set whose size changes: `points` (N, 8) are summed into the prediction."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.points = nn.Parameter(torch.randn(6, 8))
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        return self.head(x + self.points.mean(dim=0))


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("change", ["grow, state moved", "grow, fresh state",
                                    "same shape swap, state moved"])
def test_parameter_replaced_inside_a_param_group(impl, change):
    m1, ref, m2, opt = pair(Cloud, impl=impl)

    def edit(step, side):
        model, o = side
        if step != 2:
            return
        old = model.points
        new = (nn.Parameter(old.detach().clone()) if change.startswith("same")
               else _grow(old, 3))
        _densify(o, old, new, move_state="moved" in change)
        model.points = new

    # the model changes before the step-2 backward, so that it runs on the new parameter
    lockstep(m1, ref, m2, opt, 5, f"{change} {impl}", edit=edit, edit_before_backward=True)
    assert m2.points.shape[0] == (6 if change.startswith("same") else 9)
    assert int(opt.state[m2.points]["step"]) == (5 if "moved" in change else 3)


def test_param_list_replaced_and_parameter_removed():
    m1, ref, m2, opt = pair(impl="foreach")

    def edit(step, side):
        model, o = side
        if step == 2:  # a new list object with the same parameters minus the last bias
            o.param_groups[0]["params"] = list(model.parameters())[:-1]
        if step == 4:
            o.param_groups[0]["params"].append(model[3].bias)

    train(m1, ref, m2, opt, 6, "param list edits", edit=edit)


def test_parameter_swapped_between_groups():
    def groups(m):
        return [{"params": [m[0].weight, m[0].bias]},
                {"params": [m[3].weight, m[3].bias], "lr": 1e-2, "weight_decay": 0.0}]

    m1, ref, m2, opt = pair(groups=groups, impl="for-loop")

    def edit(step, side):
        _, o = side
        if step == 2:
            moved = o.param_groups[0]["params"].pop()
            o.param_groups[1]["params"].insert(0, moved)

    train(m1, ref, m2, opt, 4, "swap between groups", edit=edit)


# ------------------------------------------------------------------ state moved between params

@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("how", ["swap dicts", "swap tensors", "rotate dicts"])
def test_state_moved_between_parameters(impl, how):
    """`state[a], state[b] = state[b], state[a]` (layers permuted): each holds the other's
    tensors, which are views of the flat buffers; every entry is read before any is copied."""
    m1, ref, m2, opt = pair(impl=impl)

    def edit(step, side):
        model, o = side
        if step != 2:
            return
        a, b = model[0].bias, model[1].bias  # 16 elements each, like model[1].weight
        if how == "swap dicts":
            o.state[a], o.state[b] = o.state[b], o.state[a]
        elif how == "swap tensors":
            sa, sb = o.state[a], o.state[b]
            sa["exp_avg"], sb["exp_avg"] = sb["exp_avg"], sa["exp_avg"]
        else:  # a rotation through three parameters of one length
            o.state[a], o.state[b], o.state[model[1].weight] = (
                o.state[b], o.state[model[1].weight], o.state[a])

    train(m1, ref, m2, opt, 5, f"{how} {impl}", edit=edit)


@pytest.mark.parametrize("shared", ["one exp_avg_sq for two", "one step for all",
                                    "another parameter's moment"])
def test_state_tensor_shared_between_parameters_is_followed_like_native(shared):
    """Native updates a state tensor shared by two entries once per entry, in its own order;
    Cotangent reads the same tensors (the single pass refuses shared memory: native runs)."""
    m1, ref, m2, opt = pair(impl="for-loop")

    def share(step, side):
        m, o = side
        if step != 2:
            return
        st = o.state
        if shared == "one exp_avg_sq for two":
            st[m[0].bias]["exp_avg_sq"] = st[m[1].bias]["exp_avg_sq"]
        elif shared == "one step for all":
            step_t = torch.tensor(2.0)
            for p in m.parameters():
                st[p]["step"] = step_t
        else:
            st[m[1].bias]["exp_avg"] = st[m[0].bias]["exp_avg_sq"]

    train(m1, ref, m2, opt, 4, f"shared state: {shared}", edit=share)
    assert opt.update_path()["path"] == "native"


@pytest.mark.parametrize("impl", list(IMPLS))
def test_coupled_weight_decay_in_a_group_is_honoured(impl):
    """A group with `decoupled_weight_decay=False` (Adam's L2 decay) at construction and one
    switched mid-run: native honours it per group."""
    def groups(m):
        return [{"params": list(m[0].parameters()), "decoupled_weight_decay": False},
                {"params": list(m[1].parameters()) + list(m[3].parameters())}]

    m1, ref, m2, opt = pair(groups=groups, impl=impl)

    def edit(step, side):
        if step == 2:
            side[1].param_groups[1]["decoupled_weight_decay"] = False

    train(m1, ref, m2, opt, 4, f"coupled decay {impl}", edit=edit)


def test_integer_step_with_fused_fails_like_native():
    m1, ref, m2, opt = pair(impl="fused")
    train(m1, ref, m2, opt, 1, "before")
    errors = []
    for m, o in ((m1, ref.optimizer), (m2, opt)):
        o.state[m[0].bias]["step"] = torch.tensor(1)
        o.zero_grad()
        square_loss(m, torch.ones(4, 8)).backward()
        with pytest.raises(RuntimeError) as error:
            o.step()
        errors.append(str(error.value))
    assert errors[0] == errors[1]


def test_non_leaf_tensor_appended_to_a_group_is_skipped_like_native():
    """A non-leaf tensor appended to a group by hand never gets a ``.grad``: native skips it
    at every step, and so does Cotangent (nothing refuses it, nothing moves)."""
    m1, ref, m2, opt = pair(impl="for-loop")
    w = nn.Parameter(torch.ones(3))
    for o in (ref.optimizer, opt):
        o.param_groups[0]["params"].append(w * 2)
    ptrs = [p.data_ptr() for p in m2.parameters()]
    with pytest.warns(UserWarning, match="not a leaf Tensor"):
        train(m1, ref, m2, opt, 3, "non-leaf in a group")
    assert [p.data_ptr() for p in m2.parameters()] == ptrs
    for o in (ref.optimizer, opt):  # the step itself reads the non-leaf's .grad, and warns
        with pytest.warns(UserWarning, match="not a leaf Tensor"):
            o.step()


@pytest.mark.parametrize("key,value", [("maximize", 0), ("maximize", 1), ("maximize", None),
                                       ("maximize", "np.bool_"), ("amsgrad", 0),
                                       ("amsgrad", None), ("amsgrad", "np.bool_")])
def test_fused_with_a_flag_that_is_not_a_bool_fails_like_native(key, value):
    """Native's fused kernel takes ``maximize`` and ``amsgrad`` as bools only (its argument
    parser raises TypeError for 0, 1, None or a numpy bool, after the clip and the steps'
    increment); the single pass would read them as truthy: native's call runs instead, with
    native's error and bytes (found by a break-it review). (A truthy amsgrad over state made
    without it is native's KeyError, Cotangent's RuntimeError: `test_popped_state_entry_*`.)"""
    if value == "np.bool_":
        np = pytest.importorskip("numpy")
        value = np.bool_(key == "maximize")
    m1, ref, m2, opt = pair(impl="fused")
    train(m1, ref, m2, opt, 2, "before")
    for m, o in ((m1, ref.optimizer), (m2, opt)):
        o.param_groups[0][key] = value
        o.zero_grad()
        square_loss(m, torch.ones(4, 8)).backward()
    errors = []
    for o in (ref, opt):
        with pytest.raises(TypeError) as error:
            o.step()
        errors.append(str(error.value))
    assert errors[0] == errors[1]
    assert_same_update(m1.parameters(), ref.optimizer.state, m2.parameters(), opt.state,
                       f"{key}={value!r}")


@pytest.mark.parametrize("key", ["betas", "lr", "eps", "maximize", "decoupled_weight_decay"])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_a_setting_deleted_from_a_group_is_natives_key_error_before_anything_changes(impl, key):
    """Native reads every setting of a group at each step (a deleted one: KeyError); so does
    Cotangent, before anything is modified (``decoupled_weight_decay`` used to be read with a
    default; found by a break-it review)."""
    m1, ref, m2, opt = pair(impl=impl)
    train(m1, ref, m2, opt, 3, "before")
    for m, o in ((m1, ref.optimizer), (m2, opt)):
        del o.param_groups[0][key]
        o.zero_grad()
        square_loss(m, torch.ones(4, 8)).backward()
    with pytest.raises(KeyError, match=key):
        ref.step()
    before = [(p.detach().clone(), p.grad.clone(), snapshot(opt, p)) for p in m2.parameters()]
    with pytest.raises(KeyError, match=key):
        opt.step()
    for p, (data, grad, state) in zip(m2.parameters(), before):
        assert_same_bits(p.detach(), data, "parameter")
        assert_same_bits(p.grad, grad, "gradient")
        for k, v in state.items():
            assert_same_bits(opt.state[p][k], v, k)


# ------------------------------------------------------------------ 5. the replayed step

def _set_group(side, **values):
    for g in side[1].param_groups:
        g.update(values)


def _clip_settings(ref, **values):
    def edit(side):
        target = ref if side[1] is ref.optimizer else side[1]
        for k, v in values.items():
            setattr(target, k, v)
    return edit


def _first_gradient(side, make):
    p = next(side[0].parameters())
    p.grad = make(p.grad)


# name -> (edit(side, ref) made on both sides before step 4, whether step 4 may be replayed):
# each edit to an input of the last step's decisions either keeps the decisions (replayed) or
# sends the step to the full one; native's bytes either way
REPLAY_EDITS = {
    "lr halved (a schedule: the same float32 class)":
        (lambda side, ref: _set_group(side, lr=side[1].param_groups[0]["lr"] * 0.5), True),
    "lr to 0.0 (another class)": (lambda side, ref: _set_group(side, lr=0.0), False),
    "betas": (lambda side, ref: _set_group(side, betas=(0.8, 0.99)), False),
    "betas as a list": (lambda side, ref: _set_group(side, betas=[0.9, 0.95]), True),
    "eps": (lambda side, ref: _set_group(side, eps=1e-6), False),
    "weight decay to 0": (lambda side, ref: _set_group(side, weight_decay=0.0), False),
    "maximize": (lambda side, ref: _set_group(side, maximize=True), False),
    "max_norm": (lambda side, ref: _clip_settings(ref, max_norm=0.07)(side), False),
    "max_norm to -0.0": (lambda side, ref: _clip_settings(ref, max_norm=-0.0)(side), False),
    "norm_type 1": (lambda side, ref: _clip_settings(ref, norm_type=1.0)(side), False),
    "a gradient dropped": (lambda side, ref: setattr(next(side[0].parameters()), "grad", None),
                           False),
    "a gradient replaced by a transposed copy": (lambda side, ref: _first_gradient(
        side, lambda g: g.t().contiguous().t()), False),
    "a gradient replaced by a contiguous copy": (lambda side, ref: _first_gradient(
        side, lambda g: g.clone()), True),
    "two parameters sharing a gradient": (lambda side, ref: setattr(
        side[0][3].bias, "grad", side[0][0].bias.grad[:8]), False),
    "a moment replaced by a clone": (lambda side, ref: side[1].state[side[0][0].weight].update(
        exp_avg=side[1].state[side[0][0].weight]["exp_avg"].clone()), True),
    "a step tensor made float64": (lambda side, ref: side[1].state[side[0][0].weight].update(
        step=side[1].state[side[0][0].weight]["step"].double()), False),
    "the state dict replaced": (lambda side, ref: setattr(side[1], "state", defaultdict(
        dict, {k: dict(v) for k, v in side[1].state.items()})), True),
    "a parameter's data replaced": (lambda side, ref: setattr(
        side[0][0].bias, "data", side[0][0].bias.data.clone()), True),
}


@pytest.mark.parametrize("name", list(REPLAY_EDITS))
@pytest.mark.parametrize("impl", list(IMPLS))
def test_the_replayed_step_follows_every_edit_like_native(impl, name):
    """From the third step on a step replays the last one's decisions in one C++ call
    (`cotangent.replay`); an edit of anything those decisions read sends that step to the
    full one, an edit they do not depend on keeps the replay. Native's bytes at every step
    either way (CPU, float32, torch 2.13.0)."""
    make, replayed = REPLAY_EDITS[name]
    m1, ref, m2, opt = pair(impl=impl)
    seen = []

    def edit(step, side):
        if step == 4:
            make(side, ref)

    lockstep(m1, ref, m2, opt, 6, f"{name} ({impl})", edit=edit,
             after_step=lambda step: seen.append(opt.update_path()["replayed"]))
    assert seen[2:4] == [True, True], seen  # (the third and fourth steps: replayed)
    assert seen[4] == replayed, seen


@pytest.mark.parametrize("impl", list(IMPLS))
def test_the_replayed_step_follows_switches_threads_and_float_modes(impl, monkeypatch):
    """Replays decline, nothing modified, where the switch is off, the thread count or the
    float modes changed; native's bytes throughout."""
    m1, ref, m2, opt = pair(impl=impl)
    seen = []
    threads = torch.get_num_threads()

    def edit(step, side):
        if side[1] is not opt:
            return
        if step == 3:
            monkeypatch.setenv("COTANGENT_SINGLE_PASS", "0")
        elif step == 4:
            monkeypatch.delenv("COTANGENT_SINGLE_PASS")
            torch.set_num_threads(1)
        elif step == 6:
            torch.set_num_threads(threads)
            torch.set_flush_denormal(True)
        elif step == 8:
            torch.set_flush_denormal(False)

    try:
        lockstep(m1, ref, m2, opt, 10, f"switches ({impl})", edit=edit,
                 after_step=lambda step: seen.append(opt.update_path()["replayed"]))
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)
    assert seen[2] and not seen[3] and not seen[4] and seen[5], seen
    # (flushing set on this thread alone: its team computes under two modes, native's path)
    assert seen[6:] == [False, False, False, True], seen


# COTANGENT_SINGLE_PASS written after a plan was made -> whether the single pass stays on: the
# replay follows the variable's text as planned, so any new text sends the step to the full
# one, which reads it (`switched_on`) and plans anew where the pass ran
SWITCH_VALUES = {"1": True, "yes": True, " ON ": True, "0": False, "off": False,
                 "FALSE": False, " no ": False}


@pytest.mark.parametrize("value", list(SWITCH_VALUES))
@pytest.mark.parametrize("impl", list(IMPLS))
def test_the_replayed_step_reads_the_switch_as_the_full_step(impl, value, monkeypatch):
    """Whatever is written into ``COTANGENT_SINGLE_PASS`` between steps, the next step runs
    as the full step would (the pass where the variable leaves it on, native's calls where it
    switches it off) and native's bytes throughout (CPU, float32, torch 2.13.0)."""
    monkeypatch.delenv("COTANGENT_SINGLE_PASS", raising=False)
    m1, ref, m2, opt = pair(impl=impl)
    paths = []

    def edit(step, side):
        if step == 3 and side[1] is opt:
            monkeypatch.setenv("COTANGENT_SINGLE_PASS", value)

    lockstep(m1, ref, m2, opt, 6, f"switch {value!r} ({impl})", edit=edit,
             after_step=lambda step: paths.append(opt.update_path()))
    assert [p["replayed"] for p in paths[:3]] == [False, False, True], paths
    assert not paths[3]["replayed"], paths[3]  # (the full step reads the new text)
    on = SWITCH_VALUES[value]
    assert [p["path"] for p in paths[3:]] == ["single-pass" if on else "native"] * 3, paths
    assert [p["replayed"] for p in paths[4:]] == [on, on], paths


FORKED_CHILD = """
import copy, json, sys
import torch, torch.multiprocessing as mp
import cotangent
from bitwise import same_bits
from cases import HP, lockstep, mlp, square
m1 = mlp()
m2 = copy.deepcopy(m1)
ref = cotangent.ReferenceUpdate(m1.parameters(), max_norm=0.05, foreach=True, **HP)
opt = cotangent.AdamW(m2.parameters(), max_norm=0.05, foreach=True, **HP)
lockstep(m1, ref, m2, opt, 3, "before the fork")
planned = opt.update_path()["replayed"]
for m, o in ((m1, ref), (m2, opt)):
    o.zero_grad()
    square(m, torch.ones(4, 8), 0).backward()

def child(queue):
    ref.step()
    opt.step()
    pairs = list(zip(m1.parameters(), m2.parameters()))
    same = all(same_bits(a, b) and same_bits(a.grad, b.grad) for a, b in pairs)
    same = same and all(same_bits(ref.optimizer.state[a][k], opt.state[b][k])
                        for a, b in pairs for k in ("exp_avg", "exp_avg_sq", "step"))
    path = opt.update_path()
    queue.put(dict(same=same, replayed=path["replayed"], path=path["path"]))

ctx = mp.get_context("fork")
queue = ctx.SimpleQueue()
proc = ctx.Process(target=child, args=(queue,))
proc.start()
proc.join(timeout=90)
if proc.is_alive():
    proc.kill()
    sys.exit("the forked child did not finish within 90 s")
print(json.dumps(dict(queue.get(), planned=planned, exitcode=proc.exitcode)))
"""


def test_a_forked_child_does_not_replay_its_parents_plan():
    """A process forked after the parent's step made a plan (the Hogwild / A3C pattern) steps
    natively (the kernel's OpenMP runtime is the parent's): the plan is not replayed, and the
    child's step gives native's bytes (CPU, float32, foreach, torch 2.13.0). Run in a fresh
    interpreter, gradients from the parent's backward, foreach only: with plain torch, a
    backward or a fused AdamW step in a forked child hangs here, and so does a foreach step
    once the parent has run torch's own OpenMP regions (as earlier tests of this session do)."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", FORKED_CHILD], capture_output=True, text=True,
                          timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == dict(same=True, replayed=False, path="native", planned=True, exitcode=0), got


@pytest.mark.parametrize("mode_kind", ["function", "dispatch"])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_a_torch_mode_active_at_the_step_sees_natives_ops(impl, mode_kind):
    """A `TorchFunctionMode` or `TorchDispatchMode` active during `step()` (a profiler's, a
    flop counter's, or one that computes otherwise) sees native's ops: the single pass, its
    C++ norms and readers, and the replay stand aside, native's calls run through the mode,
    and the bytes are native's."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Functions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    m1, ref, m2, opt = pair(impl=impl)
    lockstep(m1, ref, m2, opt, 3, f"{mode_kind} mode, before ({impl})")
    assert opt.update_path()["replayed"]
    for m, o in ((m1, ref), (m2, opt)):
        o.zero_grad()
        square_loss(m, torch.randn(4, 8, generator=torch.Generator().manual_seed(7))).backward()
    mode = Functions() if mode_kind == "function" else Ops()
    with mode:
        ref.step()
    natives = list(seen)
    seen.clear()
    with mode:
        opt.step()
    path = opt.update_path()
    assert path["path"] == "native" and not path["replayed"], path
    assert_same_update(m1.parameters(), ref.optimizer.state, m2.parameters(), opt.state,
                       f"{mode_kind} mode ({impl})")
    if mode_kind == "dispatch":  # the same ATen ops as native's clip and step, no other
        assert Counter(seen) == Counter(natives), (Counter(seen) - Counter(natives),
                                                   Counter(natives) - Counter(seen))
    want = {"fused": "fused_adamw", "foreach": "foreach_lerp", "for-loop": "lerp_"}[impl]
    assert any(want in name for name in seen), sorted(set(seen))[:20]
