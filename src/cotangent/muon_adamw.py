"""`cotangent.MuonAdamW`: the Muon + AdamW optimizer of nanochat.

The arithmetic reproduced is that of nanochat's `MuonAdamW` (github.com/karpathy/nanochat,
`nanochat/optims.py`, itself adapted from modded-nanogpt), written here op for op:

- AdamW groups (embeddings, head, scalars), one parameter at a time: ``p.mul_(1 - lr * wd)``,
  ``exp_avg.lerp_(g, 1 - beta1)``, ``exp_avg_sq.lerp_(g.square(), 1 - beta2)``, bias
  corrections ``1 - beta ** step``, ``denom = (exp_avg_sq / bias2).sqrt() + eps``,
  ``p.add_(exp_avg / denom, alpha=-(lr / bias1))``; the effective weight decay is
  ``weight_decay * p.wd_mul`` when a parameter carries a `wd_mul` attribute.
- Muon groups: the 2-D parameters grouped by shape (groups in sorted shape order, members in
  the order given), each group stepped as one (n, rows, cols) stack: Nesterov momentum by lerp
  (``buf.lerp_(g, 1 - m)``, ``g = g.lerp_(buf, m)``); Polar Express orthogonalization
  (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932; the coefficients for 5 iterations,
  safety factor 2e-2, cushion 2) in bfloat16, on the transpose of tall matrices, after dividing
  by ``norm * 1.02 + 1e-6`` (Frobenius norm per matrix); NorMuon-style second-moment scaling
  along the reduced dimension (columns when rows >= cols, else rows) that keeps the update's
  norm; cautious weight decay (decay only where update and parameter have the same sign);
  lr scaled by ``sqrt(max(1, rows / cols))``.
- Hyperparameters reach the step functions as 0-D float32 CPU tensors (filled before each call)
  so that a compiled step does not recompile when a scheduler changes them.

The step is the published one: each Muon group's gradients are read where autograd left them
(``torch.stack([p.grad ...])``, which is also what the Nesterov blend writes into), its
parameters stacked, stepped as one (n, rows, cols) stack and copied back with
``torch._foreach_copy_``; parameters and gradients stay where they are. (An earlier packed path
kept each group's parameters and gradients in one flat buffer to skip the stack and the copy
back; measured on a 2-core CPU it saved 1.5-3% of the step, 0.4-0.8 ms in 170-1230 ms, and it
copied every gradient in the backward instead, so it is gone.)

With ``compile=True`` both step functions run under ``torch.compile(dynamic=False,
fullgraph=True)``, one compiled variant per distinct (shape, dtype, reduced dim) Muon group and
per AdamW parameter shape; a call that would exceed Dynamo's recompile limit raises instead of
silently falling back to eager (`cotangent._compat.compiled_strictly`). The compiled functions
are shared by every MuonAdamW in the process (Dynamo counts variants per function), so several
optimizers together can need more than the default limit of 8: run their steps inside
``with recompile_room(opt_a, opt_b, ...):``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cotangent import _compat

POLAR_EXPRESS_COEFFICIENTS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def adamw_step(p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step_t: Tensor,
               lr_t: Tensor, beta1_t: Tensor, beta2_t: Tensor, eps_t: Tensor,
               wd_t: Tensor) -> None:
    """One AdamW update of one parameter, in place (decoupled decay first).

    Args: `p`, `grad`, `exp_avg`, `exp_avg_sq` of one shape and dtype; the hyperparameters
    as 0-D float32 CPU tensors (`step_t` the 1-based step count)."""
    p.mul_(1 - lr_t * wd_t)
    exp_avg.lerp_(grad, 1 - beta1_t)
    exp_avg_sq.lerp_(grad.square(), 1 - beta2_t)
    bias1 = 1 - beta1_t ** step_t
    bias2 = 1 - beta2_t ** step_t
    denom = (exp_avg_sq / bias2).sqrt() + eps_t
    p.add_(exp_avg / denom, alpha=-(lr_t / bias1))


def muon_step(grads: Tensor, params: Tensor, momentum_buffer: Tensor,
              second_momentum_buffer: Tensor, momentum_t: Tensor, lr_t: Tensor, wd_t: Tensor,
              beta2_t: Tensor, ns_steps: int, red_dim: int) -> None:
    """One Muon update of a stack of equal-shape matrices, in place on `params` and the buffers.

    Args:
        grads, params, momentum_buffer: (n, rows, cols), one dtype; `grads` (a stacked copy)
            receives the Nesterov blend, as in the published code.
        second_momentum_buffer: (n, rows, 1) when rows >= cols (red_dim -1), else (n, 1, cols)
            (red_dim -2).
        momentum_t, lr_t, wd_t, beta2_t: 0-D float32 CPU tensors (lr already scaled by
            sqrt(max(1, rows / cols))).
        ns_steps: Polar Express iterations (at most 5).
    """
    momentum = momentum_t.to(grads.dtype)
    momentum_buffer.lerp_(grads, 1 - momentum)
    g = grads.lerp_(momentum_buffer, momentum)
    # Polar Express, in bfloat16, on the wide orientation
    x = g.bfloat16()
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
    for a, b, c in POLAR_EXPRESS_COEFFICIENTS[:ns_steps]:
        gram = x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    g = x.mT if tall else x
    # NorMuon: per-row (or per-column) second moment, rescaled to keep the update's norm
    beta2 = beta2_t.to(g.dtype)
    v_mean = g.float().square().mean(dim=red_dim, keepdim=True)
    reduced = g.size(red_dim)
    v_norm = (v_mean.sum(dim=(-2, -1), keepdim=True) * reduced).sqrt()
    second_momentum_buffer.lerp_(v_mean.to(dtype=second_momentum_buffer.dtype), 1 - beta2)
    step_size = second_momentum_buffer.clamp_min(1e-10).rsqrt()
    scaled_sq_sum = (v_mean * reduced) * step_size.float().square()
    v_norm_new = scaled_sq_sum.sum(dim=(-2, -1), keepdim=True).sqrt()
    g = g * (step_size * (v_norm / v_norm_new.clamp_min(1e-10))).to(g.dtype)
    # cautious weight decay, then the update
    lr = lr_t.to(g.dtype)
    wd = wd_t.to(g.dtype)
    mask = (g * params) >= 0
    params.sub_(lr * g + lr * wd * params * mask)


_COMPILED: dict[str, object] = {}


def _compiled(name: str):
    if name not in _COMPILED:
        fn = {"muon": muon_step, "adamw": adamw_step}[name]
        _COMPILED[name] = torch.compile(fn, dynamic=False, fullgraph=True)
    return _COMPILED[name]


def recompile_room(*optimizers: MuonAdamW):
    """Context manager: Dynamo's recompile limit raised (inside the block) to at least the
    compiled variants the given optimizers need together (`MuonAdamW.compiled_variants()` of
    those built with ``compile=True``)."""
    needed = sum(o.compiled_variants() for o in optimizers if o.compile)
    return _compat.recompile_limit_at_least(needed)


def muon_groups(muon_params: list[Tensor]) -> list[list[Tensor]]:
    """The published grouping: one group per distinct shape, in sorted shape order, members in
    the order given."""
    return [[p for p in muon_params if p.shape == shape]
            for shape in sorted({p.shape for p in muon_params})]


class MuonAdamW(torch.optim.Optimizer):
    """Muon for 2-D matrices, AdamW for the rest, as nanochat's `MuonAdamW` (module docstring).

    Args:
        adamw_groups: list of dicts, each with "params" and optionally "lr"; one AdamW param
            group each, in order.
        muon_params: iterable of 2-D tensors (Muon); grouped by shape.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: AdamW defaults.
        muon_lr, muon_momentum, muon_ns_steps (1..5), muon_beta2 (None: 0.0),
        muon_weight_decay: Muon settings (cautious weight decay).
        compile: run the step functions under torch.compile (see the module docstring).

    Each param group carries ``kind`` ("adamw" or "muon"); Muon groups follow the AdamW groups.
    State: AdamW parameters hold ``step`` (int), ``exp_avg``, ``exp_avg_sq``; each Muon group's
    first parameter holds the group's ``momentum_buffer`` (n, rows, cols) and
    ``second_momentum_buffer``, as in the published code, so its state dicts load here.

    Raises:
        ValueError: a Muon parameter that is not 2-D, an AdamW group without "params", a
            parameter in two param groups (torch's check; one listed twice within a group gets
            torch's duplicate-parameter warning, as with native optimizers), `muon_ns_steps`
            outside 1..5, or (compile) more compiled variants than Dynamo's recompile limit.
        RuntimeError (at `step`): a Muon parameter without a gradient (the published code
            stacks every member's gradient); raised before anything is updated.
    """

    def __init__(self, adamw_groups: list[dict], muon_params, adamw_lr: float = 1e-3,
                 adamw_betas: tuple[float, float] = (0.9, 0.999), adamw_eps: float = 1e-8,
                 adamw_weight_decay: float = 0.01, muon_lr: float = 0.02,
                 muon_momentum: float = 0.95, muon_ns_steps: int = 5,
                 muon_beta2: float | None = 0.95, muon_weight_decay: float = 0.0, *,
                 compile: bool = False) -> None:
        muon_params = list(muon_params)
        for i, p in enumerate(muon_params):
            if p.ndim != 2:
                raise ValueError(f"Muon parameter {i} has shape {tuple(p.shape)}; Muon takes "
                                 "2-D matrices only (put it in an AdamW group)")
        if not 1 <= muon_ns_steps <= len(POLAR_EXPRESS_COEFFICIENTS):
            raise ValueError(f"muon_ns_steps must be in 1..{len(POLAR_EXPRESS_COEFFICIENTS)} "
                             f"(Polar Express coefficients), got {muon_ns_steps}")
        groups = []
        for i, group in enumerate(adamw_groups):
            if not isinstance(group, dict) or "params" not in group:
                raise ValueError(f"adamw_groups[{i}] must be a dict with 'params'")
            groups.append(dict(params=list(group["params"]), lr=group.get("lr", adamw_lr),
                               kind="adamw", betas=adamw_betas, eps=adamw_eps,
                               weight_decay=adamw_weight_decay))
        for members in muon_groups(muon_params):
            groups.append(dict(params=members, lr=muon_lr, kind="muon", momentum=muon_momentum,
                               ns_steps=muon_ns_steps, beta2=muon_beta2,
                               weight_decay=muon_weight_decay))
        self.compile = compile
        self._group_defaults = {
            "adamw": dict(lr=adamw_lr, betas=adamw_betas, eps=adamw_eps,
                          weight_decay=adamw_weight_decay),
            "muon": dict(lr=muon_lr, momentum=muon_momentum, ns_steps=muon_ns_steps,
                         beta2=muon_beta2, weight_decay=muon_weight_decay)}
        super().__init__(groups, dict(lr=adamw_lr))
        f32 = dict(dtype=torch.float32, device="cpu")
        self._adamw_t = {k: torch.tensor(0.0, **f32)
                         for k in ("step", "lr", "beta1", "beta2", "eps", "wd")}
        self._muon_t = {k: torch.tensor(0.0, **f32) for k in ("momentum", "lr", "wd", "beta2")}
        if compile and self.compiled_variants() > _compat.recompile_limit():
            raise ValueError(
                f"compile=True needs {self.compiled_variants()} compiled variants (Muon group "
                "shapes + AdamW parameter shapes), more than Dynamo's recompile limit "
                f"({_compat.recompile_limit()}): raise torch._dynamo.config.recompile_limit "
                "first, or step inside cotangent.muon_adamw.recompile_room(optimizer)")
        self._initialized = True

    def add_param_group(self, param_group: dict) -> None:
        """Add a group: ``kind`` "adamw" (default) or "muon" (2-D parameters of one shape),
        its missing settings taken from the constructor's (`adamw_*` or `muon_*`).

        Raises:
            ValueError: an unknown kind, or a Muon group whose parameters are not 2-D
                matrices of one shape (nothing added)."""
        kind = param_group.setdefault("kind", "adamw")
        if kind not in ("adamw", "muon"):
            raise ValueError(f"param group kind must be 'adamw' or 'muon', got {kind!r}")
        if hasattr(self, "_group_defaults"):  # (always: set before torch's __init__ adds
            # the constructor's groups, so they are checked and filled here too)
            if kind == "muon":
                params = param_group["params"]
                params = [params] if isinstance(params, Tensor) else list(params)
                if not params or any(
                        p.ndim != 2 or (p.shape, p.dtype, p.device)
                        != (params[0].shape, params[0].dtype, params[0].device) for p in params):
                    raise ValueError("a Muon param group takes 2-D matrices of one shape, dtype "
                                     "and device")
                steps = param_group.get("ns_steps", self._group_defaults["muon"]["ns_steps"])
                if not 1 <= steps <= len(POLAR_EXPRESS_COEFFICIENTS):
                    raise ValueError(f"ns_steps must be in 1..{len(POLAR_EXPRESS_COEFFICIENTS)}"
                                     f" (Polar Express coefficients), got {steps}")
                param_group["params"] = params
            for key, value in self._group_defaults[kind].items():
                param_group.setdefault(key, value)
        super().add_param_group(param_group)
        if not getattr(self, "_initialized", False):
            return  # during __init__: checked at its end
        if self.compile and self.compiled_variants() > _compat.recompile_limit():
            self.param_groups.pop()
            raise ValueError(
                f"with this group compile=True needs {self.compiled_variants()} compiled "
                f"variants, more than Dynamo's recompile limit "
                f"({_compat.recompile_limit()}); raise "
                "torch._dynamo.config.recompile_limit first")

    def __getstate__(self):
        raise TypeError("cotangent.MuonAdamW cannot be pickled or copied (its hyperparameter "
                        "tensors and settings are not in the optimizer's pickled state); "
                        "save and load optimizer.state_dict() instead")

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every group (AdamW parameters without a gradient are skipped)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):  # validate before any update
            if group["kind"] != "muon":
                continue
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    raise RuntimeError(f"parameter {i} of param group {gi} (Muon group of "
                                       f"shape {tuple(p.shape)}) has no gradient; MuonAdamW "
                                       "steps every member of a Muon group (nothing was "
                                       "updated)")
        for gi, group in enumerate(self.param_groups):
            if group["kind"] == "adamw":
                self._adamw_group(group)
            elif group["params"]:
                self._muon_group(group)
        return loss

    def _adamw_group(self, group: dict) -> None:
        beta1, beta2 = group["betas"]
        fn = _compiled("adamw") if self.compile else adamw_step
        t = self._adamw_t
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            t["step"].fill_(state["step"])
            t["lr"].fill_(group["lr"])
            t["beta1"].fill_(beta1)
            t["beta2"].fill_(beta2)
            t["eps"].fill_(group["eps"])
            t["wd"].fill_(group["weight_decay"] * getattr(p, "wd_mul", 1.0))
            with _compat.compiled_strictly(self.compile):
                fn(p, p.grad, state["exp_avg"], state["exp_avg_sq"], t["step"], t["lr"],
                   t["beta1"], t["beta2"], t["eps"], t["wd"])

    def _muon_group(self, group: dict) -> None:
        params = group["params"]
        rows, cols = params[0].shape
        state = self.state[params[0]]
        like = dict(dtype=params[0].dtype, device=params[0].device)
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros(len(params), rows, cols, **like)
        if "second_momentum_buffer" not in state:
            shape = (len(params), rows, 1) if rows >= cols else (len(params), 1, cols)
            state["second_momentum_buffer"] = torch.zeros(shape, **like)
        red_dim = -1 if rows >= cols else -2
        t = self._muon_t
        t["momentum"].fill_(group["momentum"])
        t["beta2"].fill_(group["beta2"] if group["beta2"] is not None else 0.0)
        t["lr"].fill_(group["lr"] * max(1.0, rows / cols) ** 0.5)
        t["wd"].fill_(group["weight_decay"])
        fn = _compiled("muon") if self.compile else muon_step
        with _compat.compiled_strictly(self.compile):
            stacked_grads = torch.stack([p.grad for p in params])
            stacked_params = torch.stack(params)
            fn(stacked_grads, stacked_params, state["momentum_buffer"],
               state["second_momentum_buffer"], t["momentum"], t["lr"], t["wd"], t["beta2"],
               group["ns_steps"], red_dim)
            _compat.foreach_copy_(params, list(stacked_params.unbind(0)))

    def compiled_variants(self) -> int:
        """Number of distinct compiled step variants this optimizer needs (compile=True):
        one per Muon group (shape, dtype, device, steps) and per AdamW parameter shape/dtype."""
        muon = {(tuple(g["params"][0].shape), g["params"][0].dtype, g["params"][0].device,
                 g["ns_steps"]) for g in self.param_groups if g["kind"] == "muon" and g["params"]}
        adamw = {(tuple(p.shape), p.dtype, p.device) for g in self.param_groups
                 if g["kind"] == "adamw" for p in g["params"]}
        return len(muon) + len(adamw)


