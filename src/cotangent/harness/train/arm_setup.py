"""One arm of a `cotangent train` run: its model, optimizer and update phase (`Arm`)."""

from __future__ import annotations


import torch

import cotangent
from cotangent.harness import records
from cotangent.harness.factorial import BatchedNormsOnly
from cotangent.harness.model import build_model, shard_fsdp2
from cotangent.harness.packed import PackedAdamW
from cotangent.harness.train import config, distributed


class Arm:
    """One arm's model, optimizer and update phase.

    With `data_parallel`, `forward` is the model wrapped in `DistributedDataParallel` (after
    the optimizer is built over the unwrapped model's parameters); `model` stays the unwrapped
    model, which the clip, the evaluation and the hashes use.

    A study arm (`STUDY_ARMS`) has `aggregator` (P, A, AP, PA; else None) and, after each
    update phase, its diagnostics in `occurrence` (`OCCURRENCE_KEYS`; None for U and S).
    `lr_group` is the param group whose lr the curve records (a study arm's first Muon group).
    """

    def __init__(self, name: str, cfg: config.TrainConfig, device: torch.device,
                 data_parallel: distributed.DataParallel | None = None) -> None:
        if name not in config.TRAIN_ARMS:
            raise ValueError(f"unknown arm {name!r}; known: {', '.join(config.TRAIN_ARMS)}")
        if name == "cotangent-zero1" and data_parallel is None:
            raise ValueError("the cotangent-zero1 arm shards the optimizer state over ranks: "
                             "run it data-parallel (--nproc N or torchrun)")
        if name in config.FSDP2_ARMS and data_parallel is None:
            raise ValueError(f"the {name} arm shards the model over ranks (fully_shard): run "
                             "it data-parallel (--nproc N or torchrun)")
        config.check_study_arms([name], cfg.model.name)
        # (also for an Arm built without the CLI)
        config.check_fsdp2_arms([name], cfg.model.compile)
        self.name = name
        self.fsdp2 = False
        self.update = None
        self.aggregator = None
        self.occurrence: dict | None = None
        self.lr_group = 0
        if name in config.STUDY_ARMS:
            if data_parallel is not None:
                raise ValueError(f"the study arms ({', '.join(config.STUDY_ARMS)}) run in one "
                                 "process, not data-parallel")
            self._build_study(name, cfg, device)
            self.forward = self.model
            if cfg.model.compile:  # (after the optimizer is built, as for the bitwise arms)
                self.forward = torch.compile(self.forward)
            return
        self.model = build_model(cfg.model.name, cfg.seed).to(device)
        self.init_sha256 = records.model_sha256(self.model)
        self.fsdp2 = name in config.FSDP2_ARMS
        if self.fsdp2:  # every parameter a DTensor, this rank's shard local
            shard_fsdp2(self.model)
        params = list(self.model.parameters())
        self.forward = self.model
        o = cfg.optimizer
        kw = dict(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, fused=True)
        if name in ("native", "native-fsdp2"):
            self.update = cotangent.ReferenceUpdate(params, max_norm=o.max_norm, **kw)
            self.optimizer = self.update.optimizer
        elif name == "batched-norms-only":
            self.update = BatchedNormsOnly(params, max_norm=o.max_norm, **kw)
            self.optimizer = self.update.optimizer
        else:
            # cotangent-zero1: each rank keeps the AdamW state of its share (ZeRO-1);
            # packing-only / packed: the packed design without / with batched norms
            if name in ("packing-only", "packed"):
                self.optimizer = PackedAdamW(
                    params, max_norm=o.max_norm, batched_norms=name == "packed", **kw)
            else:
                self.optimizer = cotangent.AdamW(
                    params, max_norm=o.max_norm,
                    shard="zero1" if name == "cotangent-zero1" else None, **kw)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: config.lr_factor(s, cfg.steps))
        if data_parallel is not None and not self.fsdp2:  # gradients averaged in backward
            self.forward = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[device.index] if device.type == "cuda" else None)
        if cfg.model.compile:  # after packing: PackedAdamW moves parameter storage
            self.forward = torch.compile(self.forward)

    def _build_study(self, name: str, cfg: config.TrainConfig, device: torch.device) -> None:
        """The study arm's model variant, aggregator, MuonAdamW and schedule."""
        from cotangent.occurrence import OccurrenceAggregator

        sharing, mode = config.STUDY_ARMS[name]
        self.model = build_model(cfg.model.name, cfg.seed, sharing=sharing).to(device)
        self.init_sha256 = records.model_sha256(self.model)
        muon_params = self.model.matrix_parameters()
        if mode is not None:  # its pooled leaves join the optimizer
            self.aggregator = OccurrenceAggregator(self.model.occurrence_groups(), mode)
            muon_params += self.aggregator.pooled_leaves()
        m = cfg.muon
        self.optimizer = cotangent.MuonAdamW(
            [{"params": [self.model.tok_emb.weight], "lr": m.embedding_lr},
             {"params": [self.model.head.weight], "lr": m.head_lr}],
            muon_params, adamw_betas=m.adamw_betas, adamw_eps=m.adamw_eps,
            adamw_weight_decay=m.adamw_weight_decay, muon_lr=m.lr, muon_momentum=m.momentum,
            muon_ns_steps=m.ns_steps, muon_beta2=m.beta2, muon_weight_decay=m.weight_decay,
            compile=m.compile)
        self.lr_group = next(i for i, g in enumerate(self.optimizer.param_groups)
                             if g["kind"] == "muon")
        # every group's lr: its own peak (initial_lr) * lr_factor, as for the bitwise arms
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: config.lr_factor(s, cfg.steps))

    def eval_parallel(self, dp: distributed.DataParallel | None
                      ) -> distributed.DataParallel | None:
        """What `evaluate_bpb` gets as `data_parallel` for this arm: `dp`, except for an FSDP2
        arm, whose sharded forward (its all-gathers) must run alike on every rank: there every
        rank evaluates every window (None)."""
        return None if self.fsdp2 else dp

    def state_sha256(self) -> str:
        """The model's SHA-256 now (`records.model_sha256`); an FSDP2 arm's over its full
        parameters, each gathered from every rank (a collective: every rank calls it)."""
        if not self.fsdp2:
            return records.model_sha256(self.model)
        from cotangent import dtensor

        return records.state_sha256({k: v.full_tensor() if dtensor.is_dtensor(v) else v
                                     for k, v in self.model.state_dict().items()})

    def study_record(self) -> dict | None:
        """metadata.json's `study` entry (None for a bitwise arm)."""
        if self.name not in config.STUDY_ARMS:
            return None
        sharing, mode = config.STUDY_ARMS[self.name]
        groups = self.optimizer.param_groups
        muon = [p for g in groups if g["kind"] == "muon" for p in g["params"]]
        return {"sharing": sharing, "occurrence_mode": mode,
                "optimizer": "cotangent.MuonAdamW(compile="
                             f"{bool(self.optimizer.compile)})",
                "muon_groups": [list(g["params"][0].shape) for g in groups
                                if g["kind"] == "muon"],
                "muon_tensors": len(muon), "muon_parameters": sum(p.numel() for p in muon),
                "pooled_leaves": 0 if self.aggregator is None
                else len(self.aggregator.pooled_leaves()),
                "gradient_clipping": None,
                "update_phase": "gradient norm (recorded, not clipped)"
                                + (", aggregator.before_step" if self.aggregator else "")
                                + ", MuonAdamW.step"
                                + (", aggregator.after_step" if self.aggregator else "")
                                + ", zero_grad(set_to_none=True)"}

    def update_phase(self) -> torch.Tensor:
        """Clip, step, zero_grad; returns the total gradient norm before clipping.

        A study arm: the L2 norm of every gradient the backward gave (replicas and shared
        leaves as they are, before any aggregation; nothing is clipped), then
        `aggregator.before_step()`, the MuonAdamW step, `aggregator.after_step()` (its
        diagnostics in `occurrence`) and zero_grad."""
        if self.name in config.STUDY_ARMS:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            total = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            if self.aggregator is not None:
                self.aggregator.before_step()
            self.optimizer.step()
            if self.aggregator is not None:
                self.occurrence = self.aggregator.after_step()
            self.optimizer.zero_grad(set_to_none=True)
            return total
        if self.update is not None:
            total = self.update.step()
        else:
            self.optimizer.step()
            total = self.optimizer.last_total_norm
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def check_sync(self, row: dict) -> None:
        """Raise OccurrenceSyncError unless the step of curve row `row` left a replicated
        core's replicas equal (sync_error exactly 0.0); nothing for the other arms."""
        if self.aggregator is None:
            return
        error = row["sync_error"]
        if not error == 0.0:
            raise config.OccurrenceSyncError(
                f"arm {self.name}: the replicas of the recurrent core differ after update "
                f"{row['step']} (sync_error {error!r}, max |replica - replica 0|; must be 0.0): "
                "the run is stopped, its records stay INCOMPLETE")
