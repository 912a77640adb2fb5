"""`cotangent train`: native against Cotangent on a byte-level language model (its flags, config
resolution, `--nproc` ranks)."""

from __future__ import annotations

import os
import sys
import tomllib

from cotangent.harness import schema
from cotangent.harness.data import DATA_ENV, embedded_corpus, load_wikitext2
from cotangent.harness.train import (
    TrainConfig,
    check_data_parallel_device,
    check_device,
    format_comparison,
    format_config,
    launcher_env,
    process_group,
    result_json,
    run_train,
    settings_of,
    tensorboard_writer_class,
    validate_config,
)


PROGRESS_EVERY_S = 20.0  # plain progress lines of `cotangent train` without a terminal
TENSORBOARD_HELP = (
    "also write every curve.jsonl row as TensorBoard scalars (tags: the curve's metric names, "
    "e.g. loss_bpb, lr, grad_norm, step_s, probe_bpb; global step: the row's step; float32) "
    "in DIR/<run directory name>/<arm>, one run per arm; needs the tensorboard extra: pip "
    "install 'cotangent[tensorboard]'. The records stay the evidence; the event files are "
    "never read back")


# The settings `cotangent train` takes as flags (`--batch-size` for batch_size); every setting
# can also come from --config and --set. Type, choices and help come from TrainConfig's fields.
TRAIN_FLAGS = ("model", "arms", "steps", "seed", "batch_size", "device", "precision", "compile",
               "eval_every", "val_bytes", "out")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="train one seed with the native and the Cotangent update phase",
        description="Train the same seed once per arm, interleaved (default: `native` = "
                    "clip_grad_norm_ + torch.optim.AdamW fused, and `cotangent` = "
                    "cotangent.AdamW), then compare final model hashes, update-phase and "
                    "whole-step time, and validation/test BPB. Settings come from the defaults, "
                    "then --config FILE (TOML: setting names, or tables [model], [optimizer], "
                    "[muon], [eval], [data] as in a run's config.toml), then the flags, then "
                    "--set key=value (a setting name or a dotted one, e.g. optimizer.lr); the "
                    "resolved config is printed and saved with each run.")
    p.add_argument("--config", default=None, help="TOML file of settings")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one setting (TOML value syntax; repeatable)")
    defaults, specs = settings_of(TrainConfig()), schema.specs(TrainConfig)
    for name in TRAIN_FLAGS:
        spec, default = specs[name], defaults[name]
        flag = "--" + name.replace("_", "-")
        text = spec.doc.replace("%", "%%")
        if spec.kinds == (bool,):
            p.add_argument(flag, action="store_true", default=None, help=text)
        elif spec.kinds == (tuple,):
            p.add_argument(flag, default=None,
                           help=f"comma-separated, from {', '.join(spec.choices)}: {text} "
                                f"(default {','.join(default)})")
        else:
            p.add_argument(flag, type=spec.kinds[0], default=None, choices=spec.choices,
                           help=f"{text} (default {default})")
    p.add_argument("--data-dir", default=None,
                   help=f"WikiText-2 directory (default: ${DATA_ENV}; if unset, an embedded "
                        "corpus of Python standard-library sources)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--progress-every", type=float, default=None, metavar="SECONDS",
                   help="print a plain progress line at most every SECONDS of training, and "
                        f"after the last step (default: {PROGRESS_EVERY_S:g} when stdout is not a "
                        "terminal; when stdout and stderr are both terminals a progress bar on "
                        "stderr instead; 0 = no lines)")
    p.add_argument("--tensorboard", default=None, metavar="DIR", help=TENSORBOARD_HELP)
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="data-parallel ranks on this machine: start N processes through "
                        "torch.distributed's elastic launcher (as torchrun --standalone "
                        "--nproc-per-node N), each training every arm wrapped in "
                        "DistributedDataParallel on its own batches (gloo on cpu, nccl with "
                        "one GPU per rank on cuda), torch threads per rank = cores // N unless "
                        "OMP_NUM_THREADS is set; only rank 0 prints and writes records; exits "
                        "non-zero unless every rank ends with the same hashes (default 1: this "
                        "process alone; under torchrun, which sets RANK, WORLD_SIZE, ..., leave "
                        "it out or give torchrun's --nproc-per-node)")


def resolve_train_config(args) -> TrainConfig:
    """Defaults < TOML file < flags < --set overrides, each value checked against its
    setting's description (`TrainConfig`, `cotangent.harness.schema`); the file may use
    setting names or section tables (`schema.nest_values`), `--set` a setting name or a dotted
    one (``optimizer.lr``); a comma-separated string is a list for a list setting
    (`--arms native,cotangent`).

    Raises:
        ValueError: one line: invalid TOML, `--set` without `=`, an unknown setting, one
            setting given twice in the file, or a value of the wrong type, range or choice.
    """
    values = {}
    if args.config:
        try:
            with open(args.config, "rb") as f:
                raw = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{args.config}: not valid TOML ({exc})") from None
        where = f"{args.config}: "
        values = _comma_lists(schema.nest_values(TrainConfig, raw, where=where))
        schema.check(TrainConfig, values, where=where)  # (its errors name the file)
    values.update({name: getattr(args, name) for name in TRAIN_FLAGS
                   if getattr(args, name) is not None})
    for item in args.set:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        value = _toml_value(text)  # (a bare string stays a string)
        values.update(schema.nest_values(TrainConfig, {key.strip(): value}, where="--set "))
    values = _comma_lists(values)
    return schema.build(TrainConfig, schema.check(TrainConfig, values))


def _comma_lists(values: dict) -> dict:
    """`values` with a comma-separated string given for a list setting read as its items."""
    specs = schema.specs(TrainConfig)
    return {key: [_toml_value(v.strip()) for v in value.split(",") if v.strip()]
            if key in specs and tuple in specs[key].kinds and isinstance(value, str) else value
            for key, value in values.items()}


def _toml_value(text: str):
    """`text` read as a TOML value (``0.9`` a float), else the string itself (``native``)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def check_tensorboard_dir(path: str | None) -> None:
    """Before anything is trained or written: raise ValueError (one line) when `--tensorboard`
    is given and the tensorboard package is missing, or its DIR is empty or a file."""
    if path is None:
        return
    tensorboard_writer_class()
    if not path.strip():
        raise ValueError("--tensorboard needs a directory, got an empty string")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--tensorboard {path} exists and is not a directory")


def run(args) -> int:
    check_tensorboard_dir(args.tensorboard)
    cfg = resolve_train_config(args)
    validate_config(cfg)
    check_device(cfg.device)
    if args.progress_every is not None and not 0 <= args.progress_every < float("inf"):
        raise ValueError("--progress-every must be a finite number >= 0, got "
                         f"{args.progress_every}")
    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc must be an integer >= 1, got {args.nproc}")
    env = launcher_env()
    if env is not None and args.nproc not in (None, env["LOCAL_WORLD_SIZE"]):
        raise ValueError(f"--nproc {args.nproc}, but the launcher started "
                         f"{env['LOCAL_WORLD_SIZE']} process(es) on this machine (RANK, "
                         "WORLD_SIZE, ... are set): leave --nproc out under torchrun")
    if env is None and args.nproc is not None and args.nproc > 1:
        check_data_parallel_device(cfg.device, args.nproc)
        return launch_ranks(args.nproc, args.argv)
    with process_group(env, cfg.device) as dp:
        return _train(args, cfg, rank0=dp is None or dp.rank == 0, data_parallel=dp)


def _train(args, cfg: TrainConfig, *, rank0: bool, data_parallel) -> int:
    """Load the data, train, print the comparison (rank 0 alone prints); the exit code is 0
    when every arm, and with data parallelism every rank, ends with the same model hash."""
    say = print if rank0 else _silent
    # Without a terminal (a pipe, a log file, a campaign job): plain lines, each flushed.
    interactive = sys.stdout.isatty()
    if not interactive and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    every = args.progress_every if args.progress_every is not None else (
        0.0 if interactive else PROGRESS_EVERY_S)
    data_dir = args.data_dir or os.environ.get(DATA_ENV)
    if data_dir:
        corpus = load_wikitext2(data_dir)
        say(f"data: {corpus.name} from {data_dir} "
            f"({', '.join(f'{s} {len(b):,} B' for s, b in corpus.splits.items())})")
    else:
        corpus = embedded_corpus()
        say(f"data: no WikiText-2 directory given (--data-dir or ${DATA_ENV}); using the "
            f"{corpus.note}")
    say("config:\n" + "\n".join("  " + line if line else ""
                                 for line in format_config(cfg).splitlines()))
    result = run_train(cfg, corpus, config_toml=format_config(cfg),
                       show_progress=rank0 and interactive and sys.stderr.isatty() and every == 0,
                       progress_every_s=every, log=say, data_parallel=data_parallel,
                       tensorboard=args.tensorboard)
    say(format_comparison(result))
    if args.json:
        say(result_json(result))
    return 0 if result["identical_final_hash"] and result.get("ranks_agree", True) else 1


def _exit_text(exitcode: int) -> str:
    """'exit code N', or 'killed by SIGNAME' for a negative exit code (a signal)."""
    if exitcode >= 0:
        return f"exit code {exitcode}"
    import signal

    try:
        return f"killed by {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"killed by signal {-exitcode}"


def _silent(*args, **kwargs) -> None:
    """`print` of the data-parallel ranks other than 0."""


def launch_ranks(nproc: int, argv: list[str]) -> int:
    """Run `python -m cotangent.harness.cli ARGV` as `nproc` data-parallel ranks on this
    machine through torch.distributed's elastic launcher (what `torchrun --standalone
    --nproc-per-node NPROC` does: a c10d rendezvous on a free local port, no restarts); the
    ranks inherit stdout and stderr. When one rank fails, the launcher stops the others.

    Returns:
        0 when every rank exits 0; else the exit code of the first rank to fail (128 + the
        signal number for a rank killed by a signal), after a one-line note on stderr that
        names every failed rank.
    """
    import tempfile
    import uuid

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with tempfile.TemporaryDirectory(prefix="cotangent-ranks-") as logs:
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                              run_id=uuid.uuid4().hex, rdzv_backend="c10d",
                              rdzv_endpoint="localhost:0", max_restarts=0,
                              logs_specs=DefaultLogsSpecs(log_dir=logs))
        try:
            elastic_launch(config, sys.executable)("-m", "cotangent.harness.cli", *argv)
        except ChildFailedError as exc:
            failed = ", ".join(f"rank {rank} {_exit_text(failure.exitcode)}"
                               for rank, failure in sorted(exc.failures.items()))
            print(f"cotangent: {len(exc.failures)} of {nproc} ranks failed: {failed}",
                  file=sys.stderr)
            code = exc.get_first_failure()[1].exitcode
            return code if code > 0 else 128 - code
        except SignalException as exc:
            print(f"cotangent: stopped by signal {exc.sigval.name}; the ranks were stopped "
                  "(run directories of an unfinished run keep their INCOMPLETE marker)",
                  file=sys.stderr)
            return 128 + int(exc.sigval)
    return 0
