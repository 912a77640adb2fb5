"""Paired-seed campaigns: a protocol is frozen before any outcome exists, then run job by job.

A protocol (TOML) names models, arms (the first is the baseline), seeds, steps, probe cadence,
the quality target, the confidence level, the non-inferiority margin and a block design; any
other `cotangent train` setting goes in its `[train]` table. One *block* is one (model, seed):
every arm trains that seed once. One *job* is one (model, seed, arm) run of `cotangent train`
with that single arm, in a fresh Python process, one at a time, so the arms of a block never
share a process or compete for the cores.

Designs (the order of the arms inside each block):
    ab-ba   two arms; half the blocks run A then B, the other half B then A (balanced pairs).
    latin   any number k of arms; block i runs the arms rotated by i mod k (a cyclic Latin
            square: every arm takes every position equally often when the block count is a
            multiple of k).
The blocks are shuffled with `shuffle_seed` (`random.Random`), then the orientations are dealt
out so that each model's blocks stay balanced. The job list is computed once, at freeze time,
and stored in `freeze.json`.

Decision rules (optional): prospective pass/fail rules, declared in the protocol and so frozen
(hashed with it) before any run, evaluated per model by `cotangent analyze`, re-evaluated by
`cotangent audit` and shown by `cotangent report`. They are decision rules on point estimates,
not significance tests.

    [[decision_rules]]
    name = "practical"          # unique: letters, digits, '_' or '-'
    kind = "practical"          # a free label (optional)
    description = "cotangent beats native by 0.003 BPB at <= 1.10x its training time, or ..."
    any_of = [                  # passes when a clause holds; a clause, when all its conditions do
      ["bpb(cotangent) <= bpb(native) - 0.003",
       "training_s(cotangent) <= 1.10 * training_s(native)"],
      ["bpb(cotangent) <= bpb(native) + 0.001",
       "training_s(cotangent) <= 0.90 * training_s(native)"],
    ]
    # or `all_of = [...]`: one clause

A condition is one comparison (<=, <, >=, >; no chains) of two expressions built from numbers,
+ - * /, unary minus, parentheses, min(...), max(...) and metric(ARM), ARM a protocol arm as a
bare name or quoted (`bpb("cotangent-zero1")`, since '-' is minus). Metrics per model and arm
over its done seeds: bpb = mean test BPB, training_s / update_s = median seconds, peak_mib =
median peak resident memory / 1024 (summary.json `peak_rss_kib`; each job is its own process).
The parser and evaluator (stdlib `ast`, whitelisted nodes, never `eval`) are in
`cotangent.harness.audit`, the one implementation that the harness imports and the audit runs.

Campaign directory:
    protocol.toml            the protocol, byte for byte as frozen
    freeze.json              its SHA-256, the code and data fingerprints, the job list
    jobs/<job>/attempt-<n>/  job.toml (the config given to `cotangent train`), log.txt (its
                             output), status.json (running | done | failed | interrupted) and
                             the run records `<time>-<model>-seed<s>/<arm>/`
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import random
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from cotangent.harness import audit
from cotangent.harness import records, schema
from cotangent.harness.data import DATA_ENV
from cotangent.harness.model import MODEL_CONFIGS
from cotangent.harness.schema import setting
from cotangent.harness.train import (
    TRAIN_ARMS,
    TrainConfig,
    check_device,
    format_config,
    tensorboard_writer_class,
    train_config,
    validate_config,
)

DESIGNS = ("ab-ba", "latin")
FREEZE = "freeze.json"
PROTOCOL = "protocol.toml"
STATES = ("running", "done", "failed", "interrupted")
# Settings a protocol sets at its top level (or per job); `[train]` may not set them.
_JOB_FIELDS = ("model", "seed", "arms", "steps", "eval_every", "out")


@dataclass(frozen=True, kw_only=True)
class Protocol:
    """A parsed, validated campaign protocol (see the module docstring). Each key's type, bounds
    or choices and meaning are declared once (`cotangent.harness.schema`) and checked by
    `parse_protocol`; `[train]` is checked against `TrainConfig`'s own declarations."""

    name: str = setting("the campaign's name (its default directory)",
                        pattern=r"(?!\.\.?$)[A-Za-z0-9._-]+",
                        want="a directory name of letters, digits, '.', '_' or '-'")
    description: str = setting("free text", "")
    models: tuple[str, ...] = setting("models, each trained in every block", min_items=1,
                                      distinct=True, choices=tuple(sorted(MODEL_CONFIGS)))
    arms: tuple[str, ...] = setting("arms of every block; the first is the baseline",
                                    min_items=2, distinct=True, choices=TRAIN_ARMS)
    seeds: tuple[int, ...] = setting("one block per model and seed", min_items=2,
                                     distinct=True)
    steps: int = setting("optimizer updates per job", low=1, high=10**7)
    eval_every: int = setting("probe cadence in updates; the time-to-target resolution", low=1,
                              high=10**7)
    target_bpb: float | dict[str, float] = setting(
        "quality target on the probe BPB: one number, or one per model (parse_protocol "
        "stores a table)", low=0.0, low_open=True,
        want="a positive number, or a table with one positive number per model")
    level: float = setting("two-sided confidence level of every interval, e.g. 0.95", low=0.5,
                           high=1.0, high_open=True)
    margin_bpb: float = setting("non-inferiority margin on candidate - baseline test BPB",
                                low=0.0, low_open=True,
                                want="a positive number of bits per byte")
    design: str = setting("order of the arms inside each block", "latin", choices=DESIGNS)
    shuffle_seed: int = setting("random.Random seed of the block order", 0)
    bootstrap_resamples: int = setting("resamples of every bootstrap interval", 10_000, low=1,
                                       high=10**6)
    train: dict = setting("further TrainConfig settings shared by every job, by setting name "
                          "or in section tables ([train.optimizer] lr = ...); parse_protocol "
                          "stores them by setting name",
                          default_factory=dict, want="a table of cotangent train settings")
    decision_rules: tuple = setting(
        "prospective decision rules, evaluated per model by `cotangent analyze` (parse_protocol "
        "stores them normalised by cotangent.harness.audit.check_decision_rules)", (),
        want="an array of tables ([[decision_rules]])")

    def job_config(self, job: dict, out: str) -> TrainConfig:
        """The `cotangent train` configuration of one job (a single arm)."""
        return train_config(**{**self.train, "model": job["model"], "seed": job["seed"],
                               "arms": (job["arm"],), "steps": self.steps,
                               "eval_every": self.eval_every, "out": out})


def parse_protocol(text: str, source: str = "protocol") -> Protocol:
    """Parse and validate a protocol's TOML text.

    Raises:
        ValueError: one line naming `source` and the bad key: invalid TOML, a missing or
            unknown key, a value of the wrong type or range (per `Protocol`'s field
            declarations), an arm count the design cannot balance, a probe cadence beyond the
            steps, a target table without one entry per model, a `[train]` setting
            `cotangent train` would refuse, or a decision rule `check_decision_rules` refuses
            (named, with the problem).
    """
    where = f"{source}: "
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{where}not valid TOML ({exc})") from None
    values = schema.check(Protocol, raw, where=where, noun="key", complete=True)
    protocol = Protocol(**values)
    protocol = replace(protocol, target_bpb=_target_per_model(protocol, where),
                       train=_check_train_table(protocol.train, where))
    try:
        rules = audit.check_decision_rules(protocol.decision_rules, protocol.arms)
    except ValueError as exc:
        raise ValueError(f"{where}{exc}") from None
    protocol = replace(protocol, decision_rules=tuple(rules))
    _check_protocol_relations(protocol, where)
    _check_job_configs(protocol, where)
    return protocol


def _bad(where: str, key: str, want: str, value) -> ValueError:
    shown = list(value) if isinstance(value, tuple) else value
    return ValueError(f"{where}{key} must be {want}, got {shown!r}")


def _target_per_model(protocol: Protocol, where: str) -> dict[str, float]:
    """target_bpb as a table with one number per model (a single number applies to all)."""
    target = protocol.target_bpb
    if not isinstance(target, dict):
        return {m: target for m in protocol.models}
    if set(target) != set(protocol.models):
        raise _bad(where, "target_bpb", schema.describe(schema.specs(Protocol)["target_bpb"]),
                   target)
    return {m: target[m] for m in protocol.models}


def _check_train_table(train: dict, where: str) -> dict:
    """The `[train]` table by setting name (`schema.nest_values`: section tables such as
    ``[train.optimizer]`` become setting names), checked against TrainConfig's declarations
    (lists become tuples); the keys the protocol itself sets (`_JOB_FIELDS`) are refused."""
    train = schema.nest_values(TrainConfig, train, where=f"{where}[train] ")
    for key in train:
        if key in _JOB_FIELDS:
            raise ValueError(f"{where}[train] may not set {key} (the protocol sets it)")
    allowed = [name for name in schema.specs(TrainConfig) if name not in _JOB_FIELDS]
    return schema.check(TrainConfig, train, where=f"{where}[train] ", allowed=allowed)


def _check_protocol_relations(protocol: Protocol, where: str) -> None:
    """What no single key can say: the probe cadence within the steps, ab-ba's two arms."""
    if protocol.eval_every > protocol.steps:
        raise _bad(where, "eval_every", f"at most steps ({protocol.steps}), or no probe would "
                                        "run", protocol.eval_every)
    if protocol.design == "ab-ba" and len(protocol.arms) != 2:
        raise _bad(where, "arms", "exactly two arms for design ab-ba (use latin for more)",
                   protocol.arms)


def _check_job_configs(protocol: Protocol, where: str) -> None:
    """Every job's `cotangent train` configuration passes `validate_config`."""
    for model in protocol.models:
        for seed in protocol.seeds:
            for arm in protocol.arms:
                try:
                    validate_config(protocol.job_config(
                        {"model": model, "seed": seed, "arm": arm}, "runs"))
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"{where}{exc}") from None


def balance_note(protocol: Protocol) -> str | None:
    """Why the design is not balanced (each arm in each position equally often), or None."""
    k = len(protocol.arms)
    if len(protocol.seeds) % k:
        return (f"{len(protocol.seeds)} seeds per model for {k} arms: the arm order cannot be "
                f"balanced (use a multiple of {k} seeds)")
    return None


def plan_jobs(protocol: Protocol) -> list[dict]:
    """The frozen job order: shuffled blocks, arms inside a block in the design's order.

    Each job: {id, index, block, position, model, seed, arm}; `position` is the arm's place
    inside its block (0 = first).
    """
    blocks = [(m, s) for m in protocol.models for s in protocol.seeds]
    rng = random.Random(protocol.shuffle_seed)
    rng.shuffle(blocks)
    k = len(protocol.arms)
    rotation: dict[str, int] = {}
    offsets = {}
    for model in protocol.models:
        # Deal the rotations 0..k-1 round-robin over this model's blocks, in a shuffled order.
        count = sum(1 for m, _ in blocks if m == model)
        deal = [i % k for i in range(count)]
        rng.shuffle(deal)
        offsets[model] = deal
        rotation[model] = 0
    jobs = []
    for b, (model, seed) in enumerate(blocks):
        shift = offsets[model][rotation[model]]
        rotation[model] += 1
        order = protocol.arms[shift:] + protocol.arms[:shift]
        for position, arm in enumerate(order):
            index = len(jobs)
            jobs.append({"id": f"{index:03d}-{model}-seed{seed}-{arm}", "index": index,
                         "block": b, "position": position, "model": model, "seed": seed,
                         "arm": arm})
    return jobs


def sha256_file(path: Path) -> str:
    """SHA-256 (hex) of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _load_corpus(data_dir: str | None):
    from cotangent.harness.data import embedded_corpus, load_wikitext2

    return load_wikitext2(data_dir) if data_dir else embedded_corpus()


def build_fingerprint() -> dict:
    """What must not change between freeze and run: Cotangent's sources and the torch build."""
    import torch

    return {"cotangent_sha256": records.source_sha256(), "torch": torch.__version__,
            "torch_git": torch.version.git_version}


def machine_fingerprint() -> dict:
    """What the timings depend on besides the code: thread count, CPU vector ISA and model."""
    import torch

    return {"threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_model": records.cpu_model()}


def data_fingerprint(corpus) -> dict:
    """Corpus name and the SHA-256 of each split."""
    return {"name": corpus.name,
            "splits": {s: src.sha256 for s, src in sorted(corpus.sources.items())}}


def freeze(protocol_path: str, out: str | None, data_dir: str | None, *, log=print) -> Path:
    """`cotangent campaign freeze`: validate the protocol, plan the jobs and write the campaign
    directory's `protocol.toml` (the exact bytes) and `freeze.json`, before any job runs.

    Raises:
        ValueError: a bad protocol, or `out` already exists and is not empty.
        OSError: the protocol or the data cannot be read.
    """
    raw = Path(protocol_path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{protocol_path}: not UTF-8 text ({exc})") from None
    protocol = parse_protocol(text, protocol_path)
    campaign = Path(out) if out else Path("campaigns") / protocol.name
    if campaign.exists() and not campaign.is_dir():
        raise ValueError(f"{campaign} exists and is not a directory")
    if campaign.exists() and any(campaign.iterdir()):
        raise ValueError(f"{campaign} already exists and is not empty: a frozen campaign is "
                         "never re-frozen; pick another --out")
    check_device(protocol.train.get("device", "cpu"))
    corpus = _load_corpus(data_dir)
    jobs = plan_jobs(protocol)
    balance = balance_note(protocol)
    frozen = {
        "protocol_sha256": hashlib.sha256(raw).hexdigest(),
        "protocol_source": str(protocol_path),
        "frozen_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "code": build_fingerprint(),
        "machine": machine_fingerprint(),
        "data": data_fingerprint(corpus),
        "balanced": balance is None,
        "data_dir": None if data_dir is None else os.path.abspath(data_dir),
        "environment": records.environment(),
        "jobs": jobs,
    }
    campaign.mkdir(parents=True, exist_ok=True)
    records.write_atomic(campaign / PROTOCOL, text)
    if sha256_file(campaign / PROTOCOL) != frozen["protocol_sha256"]:
        raise OSError(f"{campaign / PROTOCOL}: written bytes differ from {protocol_path}")
    records.write_json(campaign / FREEZE, frozen)
    log(f"froze {protocol.name}: {len(jobs)} jobs ({len(protocol.models)} models x "
        f"{len(protocol.seeds)} seeds x {len(protocol.arms)} arms, design {protocol.design}) in "
        f"{campaign}\nprotocol SHA-256 {frozen['protocol_sha256']}\ncode SHA-256 "
        f"{frozen['code']['cotangent_sha256']} (torch {frozen['code']['torch']})\ndata: "
        f"{corpus.name}, " + ", ".join(f"{s} {h[:12]}" for s, h in
                                      frozen["data"]["splits"].items()))
    if protocol.decision_rules:
        log("decision rules, frozen with the protocol: "
            + ", ".join(r["name"] for r in protocol.decision_rules))
    if balance is not None:
        log(f"warning: {balance}")
    return campaign


def load_frozen(campaign: Path) -> tuple[Protocol, dict]:
    """Read a campaign's frozen protocol and check it against `freeze.json`.

    Raises:
        ValueError: not a campaign directory, the protocol's bytes no longer match the frozen
            SHA-256, or the stored job list differs from the protocol's plan.
    """
    freeze_path, protocol_path = campaign / FREEZE, campaign / PROTOCOL
    if not freeze_path.is_file() or not protocol_path.is_file():
        raise ValueError(f"{campaign}: not a frozen campaign (no {FREEZE} / {PROTOCOL}); run "
                         "`cotangent campaign freeze PROTOCOL` first")
    frozen = records.read_json(freeze_path)
    for key, kind in (("protocol_sha256", str), ("code", dict), ("machine", dict),
                      ("data", dict), ("environment", dict), ("jobs", list),
                      ("data_dir", (str, type(None)))):
        if key not in frozen or not isinstance(frozen[key], kind):
            raise ValueError(f"{freeze_path}: {key!r} is missing or of the wrong type")
    digest = sha256_file(protocol_path)
    if digest != frozen.get("protocol_sha256"):
        raise ValueError(f"{protocol_path}: SHA-256 {digest} differs from the frozen "
                         f"{frozen.get('protocol_sha256')}: the protocol changed after freezing")
    protocol = parse_protocol(protocol_path.read_bytes().decode("utf-8"), str(protocol_path))
    if plan_jobs(protocol) != frozen.get("jobs"):
        raise ValueError(f"{freeze_path}: its job list is not the protocol's plan (edited?)")
    return protocol, frozen


def attempt_dirs(job_dir: Path) -> list[Path]:
    """A job directory's attempt-<n> directories, in attempt order."""
    if not job_dir.is_dir():
        return []
    found = [p for p in job_dir.iterdir() if p.is_dir() and p.name.startswith("attempt-")
             and p.name[8:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[8:]))


def read_status(attempt: Path) -> dict | None:
    """An attempt's status.json, or None when it was never written."""
    path = attempt / "status.json"
    if not path.is_file():
        return None
    status = records.read_json(path)
    if status.get("state") not in STATES:
        raise ValueError(f"{path}: state {status.get('state')!r} is not one of "
                         f"{', '.join(STATES)}")
    if status["state"] == "done" and not isinstance(status.get("run_dir"), str):
        raise ValueError(f"{path}: a done attempt without its run_dir")
    return status


def completed_run(attempt: Path, job: dict) -> Path | None:
    """The finished run directory of this attempt (summary written, no INCOMPLETE marker)."""
    found = [p.parent for p in attempt.glob(f"*/{job['arm']}/summary.json")
             if not (p.parent / "INCOMPLETE").exists()]
    return found[0] if len(found) == 1 else None


def job_state(campaign: Path, job: dict) -> tuple[str, Path | None]:
    """('done' | 'failed' | 'pending', the deciding attempt). A job is finished once an
    attempt is done or failed; the latest such attempt decides (a failed job retried with
    `--retry-failed` keeps its failed attempt as evidence). Interrupted attempts do not count."""
    for attempt in reversed(attempt_dirs(campaign / "jobs" / job["id"])):
        status = read_status(attempt)
        if status and status["state"] in ("done", "failed"):
            return status["state"], attempt
    return "pending", None


def _utc(timestamp: float | None = None) -> str:
    when = datetime.now(timezone.utc) if timestamp is None else datetime.fromtimestamp(
        timestamp, timezone.utc)
    return when.isoformat(timespec="milliseconds")


def _write_status(attempt: Path, job: dict, n: int, state: str, **extra) -> dict:
    status = {"job": job["id"], "attempt": n, "state": state, **extra}
    records.write_json(attempt / "status.json", status)
    return status


def _settle_unfinished(campaign: Path, job: dict, frozen: dict, log) -> None:
    """Attempts left 'running' (or without a status) by a runner that died: record them as
    interrupted, or as done when the run had in fact finished, so nothing is lost or hidden."""
    for attempt in attempt_dirs(campaign / "jobs" / job["id"]):
        status = read_status(attempt)
        if status is not None and status["state"] != "running":
            continue
        n = int(attempt.name[8:])
        run = completed_run(attempt, job)
        if run is not None and _fingerprint_mismatch(run, frozen) is not None:
            run = None
        base = dict(status or {})
        base.pop("state", None), base.pop("job", None), base.pop("attempt", None)
        # When it stopped: the last time anything in the attempt was written.
        stamps = [p.stat().st_mtime for p in attempt.rglob("*")] + [attempt.stat().st_mtime]
        base.setdefault("started_utc", _utc(min(stamps)))
        ended = _utc(max(stamps))
        if run is not None:
            _write_status(attempt, job, n, "done", **base, ended_utc=ended,
                          run_dir=run.relative_to(campaign).as_posix(),
                          note="finished before the runner stopped; recorded on resume")
            log(f"{job['id']}: attempt {n} had finished before the runner stopped: recorded as "
                "done")
        else:
            _write_status(attempt, job, n, "interrupted", **base, ended_utc=ended,
                          reason="the runner stopped before this attempt finished (ended_utc: "
                                 "its last file write)")
            log(f"{job['id']}: attempt {n} was interrupted (runner stopped); it stays as evidence "
                "and the job runs again as a new attempt")


def _format_s(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s"


def run_campaign(campaign: Path, *, data_dir: str | None = None, retry_failed: bool = False,
                 max_jobs: int | None = None, log=print, tensorboard: str | None = None) -> dict:
    """`cotangent campaign run`: run every pending job in the frozen order, one at a time, each
    in a fresh process (`python -m cotangent.harness.cli train --config job.toml`).

    Refuses to start when the protocol, code or data fingerprints differ from the frozen ones.
    Resumable: finished jobs (done or failed) are never re-run (failed ones only with
    `retry_failed`, as a new attempt); an attempt cut short by Ctrl-C or a dead runner is
    recorded as interrupted and the job gets a new attempt. `max_jobs` stops after that many
    jobs (for tests and partial sessions). `tensorboard`: a directory; every job also writes
    its curve as TensorBoard scalars there (`cotangent train --tensorboard DIR`, DIR made
    absolute here; an extra output, not a record: the campaign's records, fingerprints and
    audit do not depend on it). Returns counts {total, done, failed, pending}.

    Raises:
        ValueError: not a frozen campaign, or a fingerprint mismatch (the message says which),
            or `tensorboard` given without the tensorboard package (before any job starts).
        KeyboardInterrupt: after recording the running attempt as interrupted.
    """
    # The real path: a job starts in it, so relative paths must be computed from it.
    campaign = Path(campaign).resolve()
    if tensorboard is not None:
        tensorboard_writer_class()  # the jobs would each fail on it
        tensorboard = os.path.abspath(tensorboard)  # the jobs run in the campaign directory
    protocol, frozen = load_frozen(campaign)
    code = build_fingerprint()
    if code != frozen["code"]:
        diff = [k for k in code if code[k] != frozen["code"].get(k)]
        raise ValueError(f"code differs from the frozen campaign ({', '.join(diff)}: now "
                         + ", ".join(f"{code[k]}" for k in diff) + "; frozen "
                         + ", ".join(f"{frozen['code'].get(k)}" for k in diff)
                         + "): results would not be comparable; freeze a new campaign")
    data_dir = data_dir if data_dir is not None else frozen["data_dir"]
    data = data_fingerprint(_load_corpus(data_dir))
    if data != frozen["data"]:
        raise ValueError(f"data in {data_dir or 'the embedded corpus'} differ from the frozen "
                         f"fingerprints ({data} vs {frozen['data']})")
    machine = machine_fingerprint()
    if machine != frozen["machine"]:
        raise ValueError(f"this machine differs from the frozen campaign's ({machine} vs "
                         f"{frozen['machine']}): timings would not be comparable; set the same "
                         "thread count (OMP_NUM_THREADS) or freeze a new campaign")
    check_device(protocol.train.get("device", "cpu"))
    (campaign / "jobs").mkdir(exist_ok=True)
    with campaign_lock(campaign) as lock_fd:
        return _run_jobs(campaign, protocol, frozen, data_dir, retry_failed, max_jobs,
                         lock_fd, log, tensorboard)


@contextlib.contextmanager
def campaign_lock(campaign: Path):
    """Hold the campaign's lock (an flock on `.lock`, a file that is never removed, so every
    holder locks the same inode); yields its file descriptor.

    Raises:
        ValueError: a runner, a job it started, or an analysis holds it.
    """
    with open(Path(campaign) / ".lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"{campaign}: another `cotangent campaign run`, or a job it "
                             "started, or an analysis is still running") from None
        yield lock.fileno()


def _run_jobs(campaign: Path, protocol: Protocol, frozen: dict, data_dir: str | None,
              retry_failed: bool, max_jobs: int | None, lock_fd: int, log,
              tensorboard: str | None = None) -> dict:
    jobs = frozen["jobs"]
    for job in jobs:
        _settle_unfinished(campaign, job, frozen, log)
    states = {job["id"]: job_state(campaign, job)[0] for job in jobs}
    total = len(jobs)
    finished = sum(s != "pending" for s in states.values())
    if retry_failed:
        retry = [j for j in jobs if states[j["id"]] == "failed"]
        if retry:
            log(f"retrying {len(retry)} failed job(s) as new attempts: "
                + ", ".join(j["id"] for j in retry))
        for job in retry:
            states[job["id"]] = "pending"
            finished -= 1
    log(f"campaign {protocol.name}: {total} jobs, {finished} finished, "
        f"{total - finished} to run")
    durations: list[float] = []
    ran = 0
    for job in jobs:
        if states[job["id"]] != "pending":
            continue
        if max_jobs is not None and ran >= max_jobs:
            break
        state, wall_s = _run_one(campaign, protocol, job, data_dir, frozen, lock_fd, log,
                                 tensorboard)
        states[job["id"]] = state
        ran += 1
        finished += 1
        durations.append(wall_s)
        eta = sum(durations) / len(durations) * (total - finished)
        log(f"[{finished}/{total}] {job['id']}: {state} in {wall_s:.1f} s; "
            f"ETA {_format_s(eta)}")
    counts = {"total": total, "done": sum(s == "done" for s in states.values()),
              "failed": sum(s == "failed" for s in states.values()),
              "pending": sum(s == "pending" for s in states.values())}
    failed = [j for j, s in states.items() if s == "failed"]
    log(f"campaign {protocol.name}: {counts['done']} done, {counts['failed']} failed, "
        f"{counts['pending']} pending" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return counts


def job_command(campaign: Path, attempt: str, data_dir: str | None) -> list[str]:
    """The fresh process of one job, run with the campaign directory as working directory."""
    command = [sys.executable, "-m", "cotangent.harness.cli", "train", "--config",
               f"{attempt}/job.toml"]
    if data_dir:
        command += ["--data-dir", os.path.relpath(os.path.abspath(data_dir), campaign)]
    return command


def _fingerprint_mismatch(run: Path, frozen: dict) -> str | None:
    """Why a finished run does not count (it used other code or data than the frozen), or
    None when its metadata carries the frozen fingerprints."""
    meta = records.read_json(run / "metadata.json")
    data = {s: v["sha256"] for s, v in sorted(meta["data"]["splits"].items())}
    if data != frozen["data"]["splits"]:
        return "the run read other data than the frozen fingerprints"
    if meta["environment"]["code_sha256"] != frozen["code"]["cotangent_sha256"]:
        return "the run used other code than the frozen fingerprint"
    return None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the job gets SIGKILL when the runner dies, so no orphan keeps training."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _run_one(campaign: Path, protocol: Protocol, job: dict, data_dir: str | None,
             frozen: dict, lock_fd: int, log,
             tensorboard: str | None = None) -> tuple[str, float]:
    job_dir = campaign / "jobs" / job["id"]
    n = len(attempt_dirs(job_dir)) + 1
    attempt = job_dir / f"attempt-{n}"
    attempt.mkdir(parents=True, exist_ok=False)
    rel = attempt.relative_to(campaign).as_posix()
    records.write_atomic(attempt / "job.toml",
                         format_config(protocol.job_config(job, rel)) + "\n")
    command = job_command(campaign, rel, data_dir)
    if tensorboard is not None:
        command += ["--tensorboard", tensorboard]
    started = _utc()
    _write_status(attempt, job, n, "running", started_utc=started, command=command)
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # The job reads exactly the frozen data: its --data-dir, or (none) the embedded corpus,
    # never a directory that happens to be in the environment.
    env.pop(DATA_ENV, None)
    with open(attempt / "log.txt", "w", encoding="utf-8") as out:
        # The child inherits the campaign lock (pass_fds), so while it lives no other runner
        # can start, even if this one is killed; on Linux it also dies with this runner.
        proc = subprocess.Popen(command, cwd=campaign, stdout=out, stderr=subprocess.STDOUT,
                                env=env, pass_fds=(lock_fd,),
                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        _write_status(attempt, job, n, "running", started_utc=started, command=command,
                      pid=proc.pid)
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            # The child got the same SIGINT from the terminal; give it time to stop cleanly.
            try:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                proc.kill()
                proc.wait()
            run = completed_run(attempt, job)
            common = dict(started_utc=started, command=command, ended_utc=_utc(),
                          wall_s=time.perf_counter() - t0, returncode=proc.returncode)
            if run is not None and _fingerprint_mismatch(run, frozen) is None:
                _write_status(attempt, job, n, "done", **common,
                              run_dir=run.relative_to(campaign).as_posix(),
                              note="finished as Ctrl-C arrived")
            else:
                _write_status(attempt, job, n, "interrupted", **common,
                              reason="Ctrl-C (KeyboardInterrupt)")
                log(f"{job['id']}: interrupted; it runs again as attempt {n + 1} when you "
                    f"resume (`cotangent campaign run {campaign}`)")
            raise
    wall_s = time.perf_counter() - t0
    run = completed_run(attempt, job)
    common = dict(started_utc=started, command=command, ended_utc=_utc(), wall_s=wall_s,
                  returncode=rc)
    mismatch = _fingerprint_mismatch(run, frozen) if run is not None else None
    if rc == 0 and run is not None and mismatch is None:
        _write_status(attempt, job, n, "done", **common,
                      run_dir=run.relative_to(campaign).as_posix())
        return "done", wall_s
    tail = (attempt / "log.txt").read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
    reason = (f"exit status {rc}" if rc != 0 else mismatch if mismatch is not None
              else "exit status 0 but no finished run record")
    _write_status(attempt, job, n, "failed", **common, reason=reason, log_tail=tail)
    log(f"{job['id']}: FAILED ({reason}); log: {attempt / 'log.txt'}")
    return "failed", wall_s


def runner_active(campaign: Path) -> bool:
    """True while a `campaign run` (or a job it started) holds the campaign's lock."""
    path = Path(campaign) / ".lock"
    if not path.exists():
        return False
    with open(path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(lock, fcntl.LOCK_UN)
    return False


def _attempt_label(status: dict | None, active: bool) -> str:
    """How `campaign status` shows one attempt. A 'running' attempt (or one without a status)
    while no runner holds the lock was cut short: its runner, and with it its job, is gone, so
    it is shown as interrupted; the next `campaign run` records it so."""
    if status is None:
        return "without status" if active else "interrupted (no status: the runner stopped)"
    if status["state"] != "running":
        return status["state"]
    pid = f"pid {status['pid']}" if "pid" in status else "no pid yet"
    if active:
        return f"running ({pid})"
    return (f"interrupted (was running, {pid}; the runner stopped; recorded as interrupted by "
            "the next `cotangent campaign run`)")


def status_lines(campaign: Path) -> list[str]:
    """`cotangent campaign status`: state counts, then every job that is not done with the
    states of its attempts (running, interrupted, failed); with no runner active, an attempt
    still marked running is shown as interrupted."""
    campaign = Path(campaign)
    protocol, frozen = load_frozen(campaign)
    active = runner_active(campaign)
    lines, counts = [], {"done": 0, "failed": 0, "pending": 0}
    for job in frozen["jobs"]:
        state, _ = job_state(campaign, job)
        counts[state] += 1
        if state == "done":
            continue
        attempts = [(a.name, read_status(a)) for a in attempt_dirs(campaign / "jobs" / job["id"])]
        detail = ", ".join(f"{name} {_attempt_label(st, active)}" for name, st in attempts)
        lines.append(f"  {state:<8}{job['id']}" + (f": {detail}" if detail else ""))
    head = (f"campaign {protocol.name}: {len(frozen['jobs'])} jobs: {counts['done']} done, "
            f"{counts['failed']} failed, {counts['pending']} pending; "
            + ("a runner is active" if active else "no runner active"))
    return [head] + lines
