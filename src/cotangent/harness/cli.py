"""cotangent: a bitwise-exact fast update phase (gradient clipping + AdamW) for PyTorch.

Commands: `train` (native vs Cotangent on a byte-level language model), `bench` (update-phase
benchmark), `calibrate` (show the bitwise calibration verdicts), `verify` (the built-in bitwise
suite), `data` (fetch or inspect WikiText-2), `campaign freeze|run|status` (paired-seed
campaigns), `analyze` (their statistics), `audit` (re-check them, standard library only),
`report` (figures and report)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tomllib

from cotangent.harness import schema
from cotangent.harness.data import DATA_ENV, embedded_corpus, load_wikitext2
from cotangent.harness.model import MODEL_CONFIGS
from cotangent.harness.train import (
    OccurrenceSyncError,
    TrainConfig,
    check_data_parallel_device,
    check_device,
    end_rank_process,
    format_comparison,
    format_config,
    launcher_env,
    process_group,
    result_json,
    run_train,
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


def _train_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="train one seed with the native and the Cotangent update phase",
        description="Train the same seed once per arm, interleaved (default: `native` = "
                    "clip_grad_norm_ + torch.optim.AdamW fused, and `cotangent` = "
                    "cotangent.AdamW), then compare final model hashes, update-phase and "
                    "whole-step time, and validation/test BPB. Settings come from the defaults, "
                    "then --config FILE (TOML, keys = the fields below), then the flags, then "
                    "--set key=value; the resolved config is printed and saved with each run.")
    p.add_argument("--config", default=None, help="TOML file of settings")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one setting (TOML value syntax; repeatable)")
    defaults, specs = TrainConfig(), schema.specs(TrainConfig)
    for name in TRAIN_FLAGS:
        spec, default = specs[name], getattr(defaults, name)
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
    """Defaults < TOML file < flags < --set overrides, each value checked against its field's
    description (`TrainConfig`, `cotangent.harness.schema`); a comma-separated string is a list
    for a list setting (`--arms native,cotangent`).

    Raises:
        ValueError: one line: invalid TOML, `--set` without `=`, an unknown setting, or a value
            of the wrong type, range or choice.
    """
    values = {}
    if args.config:
        try:
            with open(args.config, "rb") as f:
                values.update(tomllib.load(f))
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{args.config}: not valid TOML ({exc})") from None
    values.update({name: getattr(args, name) for name in TRAIN_FLAGS
                   if getattr(args, name) is not None})
    for item in args.set:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            values[key.strip()] = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            values[key.strip()] = text  # a bare string
    specs = schema.specs(TrainConfig)
    for key, value in values.items():
        if key in specs and tuple in specs[key].kinds and isinstance(value, str):
            values[key] = [v.strip() for v in value.split(",") if v.strip()]
    return TrainConfig(**schema.check(TrainConfig, values))


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


def cmd_train(args) -> int:
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
    say("config:\n  " + format_config(cfg).replace("\n", "\n  "))
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


def _bench_parser(sub) -> None:
    from cotangent.harness.bench import BATCH_SIZE, IMPLS, METHODS, SEQ_LEN, SHAPES
    from cotangent.harness.bench_muon import MATRIX_SETS as MUON_MATRIX_SETS

    p = sub.add_parser(
        "bench", help="update-phase benchmark: native vs Cotangent, with a bandwidth floor",
        description="Time the update phase (clip_grad_norm_ + AdamW step + zero_grad vs "
                    "cotangent.AdamW step + zero_grad) after a real forward + backward, per "
                    "shape and native AdamW implementation, interleaved in one process; "
                    "medians, bitwise check per row, memory, and a 10-pass floor.")
    p.add_argument("--shapes", default=None,
                   help=f"comma-separated, from {', '.join(SHAPES)} (default: all)")
    p.add_argument("--impls", default=None,
                   help=f"comma-separated, from {', '.join(IMPLS)} (default: all)")
    p.add_argument("--repeats", type=int, default=20, help="timed repeats per arm (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="discarded repeats per arm (default 3)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "mps"])
    p.add_argument("--method", default=None, choices=METHODS,
                   help="how each repeat gets its gradients: real-backward (default: a "
                        "forward + backward of the model, as a training loop) or "
                        "synthetic-grads (torch.autograd.backward(params, grads) with fixed "
                        "gradients: no model compute, caches warmer than in training)")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"real-backward: sequences per forward (default {BATCH_SIZE})")
    p.add_argument("--seq-len", type=int, default=None,
                   help=f"real-backward: tokens per sequence, at most the model's context "
                        f"(default {SEQ_LEN})")
    p.add_argument("--distributed", type=int, default=None, metavar="N",
                   help="instead: the update phase under DistributedDataParallel on N CPU "
                        "ranks (gloo): native DDP, cotangent DDP, ZeroRedundancyOptimizer and "
                        "cotangent ZeRO-1 (default shapes: "
                        "many-small,transformer-small,causal-conv,gated-gqa; --impls default "
                        "fused)")
    p.add_argument("--fsdp2", action="store_true",
                   help="with --distributed N: FSDP2 (fully_shard per block and the root) "
                        "instead of DDP: native clip + AdamW on the DTensor parameters against "
                        "cotangent.AdamW, after a real forward and backward")
    p.add_argument("--muon", action="store_true",
                   help="instead: cotangent.Muon vs torch.optim.Muon on sets of equal-shape "
                        "matrices (--shapes picks matrix sets from "
                        f"{', '.join(MUON_MATRIX_SETS)}; default all)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def cmd_bench(args) -> int:
    from cotangent.harness import bench

    gradient_options = (args.method, args.batch_size, args.seq_len)
    if (args.muon or args.distributed is not None) and gradient_options != (None,) * 3:
        raise ValueError("--method, --batch-size and --seq-len apply to the plain bench only "
                         "(not --muon or --distributed)")
    if args.method == "synthetic-grads" and (args.batch_size, args.seq_len) != (None, None):
        raise ValueError("--batch-size and --seq-len apply to --method real-backward only")
    if args.muon:
        return _bench_muon(args)
    if args.fsdp2 and args.distributed is None:
        raise ValueError("--fsdp2 needs --distributed N (the number of CPU ranks)")
    if args.distributed is not None:
        return _bench_distributed(args)
    shapes, impls = _bench_choices(args, bench.SHAPES, tuple(bench.IMPLS))
    check_device(args.device)
    method = args.method or bench.METHODS[0]
    batch_size = bench.BATCH_SIZE if args.batch_size is None else args.batch_size
    seq_len = bench.SEQ_LEN if args.seq_len is None else args.seq_len
    print(f"update-phase benchmark on {args.device}: {len(shapes)} shapes x {len(impls)} native "
          f"implementations, {args.repeats} repeats (+{args.warmup} warm-up), interleaved; "
          f"{bench.method_line(method, batch_size, seq_len)}")
    result = bench.run_bench(shapes, impls, repeats=args.repeats, warmup=args.warmup,
                             method=method, batch_size=batch_size, seq_len=seq_len,
                             device=args.device)
    print(result["table"])
    missed = [t for t in result["targets"] if not t["met"]]
    print(f"targets met: {len(result['targets']) - len(missed)}/{len(result['targets'])}")
    for t in missed:
        print(f"  missed: {t['target']} ({t['shape']}, {t['native_impl']}): {t['field']} = "
              f"{t['value']:.3f} > {t['bound']}" if isinstance(t["value"], float) else
              f"  missed: {t['target']} ({t['shape']}, {t['native_impl']}): {t['value']}")
    if args.json:
        print(bench.result_json(result))
    return 0 if all(r["bitwise"] for r in result["rows"]) else 1


def _bench_choices(args, shapes_default, impls_default) -> tuple[list[str], list[str]]:
    """--shapes and --impls as lists, checked against the benchmark's shapes and
    implementations (ValueError naming the valid ones)."""
    from cotangent.harness import bench

    shapes = [s for s in (args.shapes or ",".join(shapes_default)).split(",") if s]
    impls = [i for i in (args.impls or ",".join(impls_default)).split(",") if i]
    bad_shapes = [s for s in shapes if s not in bench.SHAPES]
    if bad_shapes:
        raise ValueError(f"unknown shape(s) {', '.join(bad_shapes)} in --shapes; valid: "
                         f"{', '.join(bench.SHAPES)}")
    bad_impls = [i for i in impls if i not in bench.IMPLS]
    if bad_impls:
        raise ValueError(f"unknown implementation(s) {', '.join(bad_impls)} in --impls; valid: "
                         f"{', '.join(bench.IMPLS)}")
    if not shapes or not impls:
        raise ValueError("--shapes and --impls must each name at least one")
    if args.repeats < 1 or args.warmup < 0:
        raise ValueError("--repeats must be >= 1 and --warmup >= 0")
    return shapes, impls


def _bench_distributed(args) -> int:
    """`cotangent bench --distributed N`: four arms under DDP on N CPU ranks."""
    from cotangent.harness import bench, bench_distributed

    shapes, impls = _bench_choices(args, bench_distributed.DISTRIBUTED_SHAPES, ("fused",))
    if args.distributed < 1:
        raise ValueError(f"--distributed needs at least 1 rank, got {args.distributed}")
    if args.device != "cpu":
        raise ValueError("--distributed runs on cpu (gloo) only")
    print(f"distributed update-phase benchmark: {args.distributed} CPU ranks, {len(shapes)} "
          f"shapes x {len(impls)} native implementations, {args.repeats} repeats "
          f"(+{args.warmup} warm-up), arms interleaved")
    result = bench_distributed.run_distributed_bench(
        args.distributed, shapes, impls, repeats=args.repeats, warmup=args.warmup,
        fsdp2=args.fsdp2)
    print(result["table"])
    if args.json:
        print(bench.result_json(result))
    return 0 if all(r["bitwise"] for r in result["rows"]) else 1


def _bench_muon(args) -> int:
    """`cotangent bench --muon`: the Muon rows, cotangent.Muon vs torch.optim.Muon, one per
    matrix set named in --shapes (default all; harness/bench_muon.py)."""
    from cotangent.harness import bench_muon

    if args.distributed is not None or args.impls or args.device != "cpu":
        raise ValueError("--muon runs on cpu in one process; --distributed, --impls and "
                         "--device do not apply")
    if args.repeats < 1 or args.warmup < 0:
        raise ValueError("--repeats must be >= 1 and --warmup >= 0")
    names = [s for s in (args.shapes or "").split(",") if s]
    unknown = [n for n in names if n not in bench_muon.MATRIX_SETS]
    if unknown:
        raise ValueError(f"unknown shape(s) {', '.join(unknown)} in --shapes; valid with "
                         f"--muon: {', '.join(bench_muon.MATRIX_SETS)}")
    sets = names or list(bench_muon.MATRIX_SETS)
    print(bench_muon.muon_bench_header(sets, args.repeats, args.warmup))
    result = bench_muon.run_muon_bench(sets, repeats=args.repeats, warmup=args.warmup)
    print(result["table"])
    if args.json:
        print(bench_muon.muon_result_json(result))
    return 0 if bench_muon.muon_bench_ok(result) else 1


def _calibrate_parser(sub) -> None:
    p = sub.add_parser(
        "calibrate", help="run and show the bitwise calibration probes for a model",
        description="Build the model, pack it with cotangent.AdamW for each native AdamW "
                    "implementation, run the calibration probes its layout needs, and list "
                    "those verdicts (cached in memory and in the user cache file); verdicts "
                    "cached for other models are not listed.")
    p.add_argument("--model", default="transformer-small", choices=sorted(MODEL_CONFIGS))
    p.add_argument("--json", action="store_true", help="print the verdicts as one JSON list "
                   "as the last line")


@contextlib.contextmanager
def _calibration_keys_used():
    """Collect the key of every calibration verdict looked up or recorded inside the block
    (the probes a layout needs, whether they ran now or came from the cache)."""
    from cotangent import calibration

    used: set[str] = set()
    lookup, record = calibration.lookup, calibration.record

    def traced_lookup(key, *a, **k):
        used.add(key)
        return lookup(key, *a, **k)

    def traced_record(key, *a, **k):
        used.add(key)
        return record(key, *a, **k)

    calibration.lookup, calibration.record = traced_lookup, traced_record
    try:
        yield used
    finally:
        calibration.lookup, calibration.record = lookup, record


def calibration_key(row: dict) -> str:
    """The cache key of one `cotangent.calibration.table()` row."""
    return row["key"]


def cmd_calibrate(args) -> int:
    import torch

    import cotangent
    from cotangent import calibration
    from cotangent.harness.model import build_model

    from cotangent import singlepass

    singlepass.forget_verdicts()  # every verdict the layout uses comes through the cache
    with _calibration_keys_used() as used:
        for flags in ({"fused": True}, {"foreach": True}, {"foreach": False}):
            model = build_model(args.model, 0)
            params = list(model.parameters())
            opt = cotangent.AdamW(params, max_norm=1.0, **flags)
            torch.autograd.backward(params, [torch.zeros_like(p) for p in params])
            opt.step()  # the probes of the calls it makes run here
            path = opt.update_path()
            print(f"{args.model} {flags}: {len(params)} tensors; update path {path['path']} "
                  f"({path['single_pass']} by the single pass, {path['native']} native"
                  + (f": {'; '.join(path['single_pass_notes'])}" if path["single_pass_notes"]
                     else "") + ")")
    every = calibration.table()
    rows = [r for r in every if calibration_key(r) in used]
    path = calibration.cache_path()
    if path is None:
        print("cache: off (memory only)")
    elif path.is_file():
        print(f"cache: {path}")
    else:
        print(f"cache: {path} could not be written: verdicts stay in memory for this process")
    print(f"{len(rows)} verdicts used by {args.model} ({len(every) - len(rows)} others known "
          "to this process or the cache, not listed):")
    for r in rows:
        print(f"  {'yes' if r['verdict'] else 'no ':<4}{r['kind']:<20}{' '.join(r['args'])}  "
              f"[{r['machine']}, torch {r['torch']}, {r['threads']} threads]")
    if args.json:
        print(json.dumps(rows))
    return 0


def _verify_parser(sub) -> None:
    p = sub.add_parser(
        "verify", help="prove native == Cotangent bit for bit on the built-in model suite",
        description="Run native (clip_grad_norm_ + torch.optim.AdamW fused) and each Cotangent "
                    "configuration side by side on the four research model families (tiny "
                    "widths unless --full-width) in FP32 and BF16 autocast, comparing loss, "
                    "every gradient, the clip norm, every parameter and both moments byte for "
                    "byte after every update; exits non-zero on the first difference.")
    p.add_argument("--steps", type=int, default=4, help="updates per case (default 4)")
    p.add_argument("--full-width", action="store_true", help="the real model widths (slow)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile case")
    p.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON")


def cmd_verify(args) -> int:
    from cotangent.harness.verify_suite import run_suite, write_report

    if args.steps < 1:
        raise ValueError("--steps must be >= 1")
    if args.json is not None and (not args.json or not os.path.isdir(
            os.path.dirname(os.path.abspath(args.json)))):
        raise ValueError(f"--json {args.json!r}: not a file path in an existing directory")
    print("verify: native vs cotangent, byte for byte, on CPU")
    result = run_suite(steps=args.steps, full_width=args.full_width,
                       compile_check=not args.no_compile)
    failed = [c for c in result["cases"] if not c["passed"]]
    print(f"{len(result['cases']) - len(failed)}/{len(result['cases'])} cases identical, "
          f"{result['steps']} update steps, {result['checks']} tensor comparisons")
    for case in failed:
        print(f"FAILED {case['model']} {case['precision']} {case['arm']}: {case['first_failure']}")
    if args.json:
        write_report(result, args.json)
    return 0 if result["passed"] else 1


def _data_parser(sub) -> None:
    p = sub.add_parser("data", help="fetch or inspect the WikiText-2 files")
    dsub = p.add_subparsers(dest="data_command", required=True)
    f = dsub.add_parser("fetch", help="download WikiText-2 (tokenized v1), verifying SHA-256")
    f.add_argument("dataset", choices=["wikitext-2"])
    f.add_argument("--dest", default="data/wikitext-2", help="directory to write (default "
                   "data/wikitext-2)")
    f.add_argument("--base-url", default=None, help="where the three files are (default: the "
                   "public pytorch/examples copy); file:// URLs work")
    i = dsub.add_parser("info", help="show which corpus would be used, from where, and hashes")
    i.add_argument("--data-dir", default=None, help=f"default: ${DATA_ENV}")


def cmd_data(args) -> int:
    from cotangent.harness import data

    if args.data_command == "fetch":
        if args.base_url is not None and not args.base_url.strip():
            raise ValueError("--base-url is empty")
        data.fetch_wikitext2(args.dest, args.base_url or data.WIKITEXT2_URL)
        print(f"use it with: cotangent train --data-dir {args.dest}")
        return 0
    print("\n".join(data.describe_corpus(args.data_dir or os.environ.get(DATA_ENV))))
    return 0


def _campaign_parser(sub) -> None:
    p = sub.add_parser(
        "campaign", help="paired-seed campaigns: freeze a protocol, run its jobs",
        description="A protocol (TOML; see protocols/) is frozen with its SHA-256 and the code "
                    "and data fingerprints before any job runs; `run` then executes every job "
                    "(one model, seed and arm of `cotangent train`) in the frozen order, each in "
                    "a fresh process, and can be resumed after a crash or Ctrl-C.")
    csub = p.add_subparsers(dest="campaign_command", required=True)
    f = csub.add_parser("freeze", help="validate a protocol and freeze it into a campaign dir")
    f.add_argument("protocol", help="protocol TOML file")
    f.add_argument("--out", default=None, help="campaign directory (default campaigns/<name>)")
    f.add_argument("--data-dir", default=None,
                   help=f"WikiText-2 directory (default ${DATA_ENV}; if unset, the embedded "
                        "corpus)")
    r = csub.add_parser("run", help="run (or resume) every unfinished job of a campaign")
    r.add_argument("campaign", help="campaign directory written by `campaign freeze`")
    r.add_argument("--data-dir", default=None,
                   help="where the data are now (default: the frozen path); hashes must match")
    r.add_argument("--retry-failed", action="store_true",
                   help="run failed jobs again as new attempts (their failures stay recorded)")
    r.add_argument("--max-jobs", type=int, default=None, help="stop after this many jobs")
    r.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="every job also writes its curve as TensorBoard scalars under DIR "
                        "(`cotangent train --tensorboard DIR`: DIR/<run directory name>/<arm>); "
                        "needs the tensorboard extra: pip install 'cotangent[tensorboard]'")
    s = csub.add_parser("status", help="count done, failed and pending jobs")
    s.add_argument("campaign")


def cmd_campaign(args) -> int:
    from pathlib import Path

    from cotangent.harness import campaign

    if args.campaign_command == "freeze":
        campaign.freeze(args.protocol, args.out, args.data_dir or os.environ.get(DATA_ENV))
        return 0
    if args.campaign_command == "status":
        print("\n".join(campaign.status_lines(Path(args.campaign))))
        return 0
    if args.max_jobs is not None and args.max_jobs < 1:
        raise ValueError("--max-jobs must be >= 1")
    check_tensorboard_dir(args.tensorboard)
    counts = campaign.run_campaign(Path(args.campaign), data_dir=args.data_dir,
                                   retry_failed=args.retry_failed, max_jobs=args.max_jobs,
                                   tensorboard=args.tensorboard)
    if counts["pending"] == 0:
        print(f"next: cotangent analyze {args.campaign}")
    return 0 if counts["failed"] == 0 else 1


def _analyze_parser(sub) -> None:
    p = sub.add_parser(
        "analyze", help="paired statistics of a finished campaign",
        description="Per pair: time-to-target (censored when not reached), fixed-budget "
                    "training-time and update-phase reductions, test BPB difference, identical "
                    "final hash; paired Student-t intervals at the protocol's level, "
                    "non-inferiority, 2x2 factorial contrasts, seed-bootstrap cross-check. "
                    "Writes RUNS/analysis/{results.json,pairs.csv,runs.csv,manifest.json}.")
    p.add_argument("runs", metavar="RUNS", help="campaign directory")


def cmd_analyze(args) -> int:
    from pathlib import Path

    from cotangent.harness.analysis import analyze, format_results

    print(format_results(analyze(Path(args.runs))))
    return 0


def _audit_parser(sub) -> None:
    p = sub.add_parser(
        "audit", help="re-check a campaign's records and statistics (standard library only)",
        description="Verify every record's SHA-256 against the manifests, the job set against "
                    "the frozen protocol, shared init/schedule hashes, step-time sums, and "
                    "recompute every interval; the same as "
                    "`python3 src/cotangent/harness/audit.py RUNS`.")
    p.add_argument("runs", metavar="RUNS", help="campaign directory (after `cotangent analyze`)")


def cmd_audit(args) -> int:
    from cotangent.harness import audit

    return audit.main([args.runs])


def _memory_parser(sub) -> None:
    from cotangent.harness.memory_cli import DEMO_VARIANTS

    p = sub.add_parser(
        "memory", help="saved-tensor storage audit: activations that pin whole storages",
        description="Run one forward (+ loss) under torch.autograd.graph.saved_tensors_hooks "
                    "and list what autograd saves for backward, by storage: bytes, bytes its "
                    "saved views reference, pinned storages (less than half referenced) and "
                    "their remedies, size classes. --compare VARIANT audits a second variant "
                    "of the demo stack and prints the signed change per size class.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", default=None, choices=sorted(MODEL_CONFIGS),
                      help="a harness model (random bytes, batch --batch)")
    what.add_argument("--demo", action="store_true",
                      help="a stack of gated blocks whose 32-channel gate slice is saved "
                           f"(variants: {', '.join(DEMO_VARIANTS)})")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--compile", dest="compiled", action="store_true", default=False,
                      help="audit torch.compile(model) (inductor)")
    mode.add_argument("--eager", dest="compiled", action="store_false", help="(default)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                   help="demo: parameter and input dtype; model: bf16 autocast (default fp32)")
    p.add_argument("--variant", default=None, choices=DEMO_VARIANTS,
                   help="demo gate variant (default slice)")
    p.add_argument("--compare", default=None, choices=DEMO_VARIANTS, metavar="VARIANT",
                   help=f"demo: also audit this variant and print the difference "
                        f"({', '.join(DEMO_VARIANTS)})")
    p.add_argument("--batch", type=int, default=4, help="B (default 4)")
    p.add_argument("--context", type=int, default=None, help="demo T (default 256)")
    p.add_argument("--width", type=int, default=None, help="demo d (default 256)")
    p.add_argument("--layers", type=int, default=None, help="demo gated blocks (default 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def cmd_memory(args) -> int:
    import torch

    from cotangent.harness import memory_cli

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    demo_only = {"--variant": args.variant, "--compare": args.compare,
                 "--context": args.context, "--width": args.width, "--layers": args.layers}
    if args.model is not None and any(v is not None for v in demo_only.values()):
        given = [k for k, v in demo_only.items() if v is not None]
        raise ValueError(f"{', '.join(given)}: demo settings; use them with --demo")
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    try:
        if args.model is not None:
            report = memory_cli.run_model(args.model, batch=args.batch, compiled=args.compiled,
                                          dtype=dtype)
        else:
            shape = dict(batch=args.batch, context=args.context or 256,
                         width=args.width or 256, layers=args.layers or 2,
                         compiled=args.compiled, dtype=dtype)
            if min(shape["context"], shape["width"], shape["layers"]) < 1:
                raise ValueError("--context, --width and --layers must be >= 1")
            if shape["width"] < memory_cli.GATE_CHANNELS:
                raise ValueError(f"--width must be at least the {memory_cli.GATE_CHANNELS} "
                                 "gate channels")
            variant = args.variant or "slice"
            report = memory_cli.run_demo(variant, **shape)
            if args.compare is not None:
                print(f"baseline: demo variant {variant}")
                print(report.table())
                other = memory_cli.run_demo(args.compare, **shape)
                report.compare(other)
                print(f"\nvariant: {args.compare}")
                report = other
    except (RuntimeError, MemoryError) as exc:  # e.g. sizes beyond this machine's memory
        raise ValueError(f"the audited forward failed: {str(exc).splitlines()[0]}") from None
    print(report.table())
    if args.json:
        print(report.to_json())
    return 0


def _report_parser(sub) -> None:
    p = sub.add_parser(
        "report", help="figures and a Markdown/HTML report of an analysed campaign",
        description="Writes RUNS/report/: four PNG figures (five when the campaign ran the "
                    "four arms of the 2x2 factorial), report.md, a self-contained report.html "
                    "and a manifest.")
    p.add_argument("runs", metavar="RUNS", help="campaign directory (after `cotangent analyze`)")


def cmd_report(args) -> int:
    from pathlib import Path

    from cotangent.harness.report import build_report

    build_report(Path(args.runs))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cotangent", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _bench_parser(sub)
    _calibrate_parser(sub)
    _verify_parser(sub)
    _data_parser(sub)
    _campaign_parser(sub)
    _analyze_parser(sub)
    _audit_parser(sub)
    _memory_parser(sub)
    _report_parser(sub)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv  # `train --nproc N` starts its ranks with these arguments
    try:
        return {"train": cmd_train, "bench": cmd_bench, "calibrate": cmd_calibrate,
                "verify": cmd_verify, "data": cmd_data, "campaign": cmd_campaign,
                "analyze": cmd_analyze, "audit": cmd_audit, "report": cmd_report,
                "memory": cmd_memory}[args.command](args)
    except KeyboardInterrupt:
        print("cotangent: interrupted (run directories of an unfinished run keep their "
              "INCOMPLETE marker)", file=sys.stderr)
        return 130
    except (OSError, ValueError) as exc:
        print(f"cotangent: error: {exc}", file=sys.stderr)
        return 2
    except OccurrenceSyncError as exc:  # a study arm's replicas diverged: the run failed
        print(f"cotangent: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    exit_code = main()
    if "LOCAL_RANK" in os.environ:  # started by torchrun or `train --nproc` as one rank
        end_rank_process(exit_code)
    sys.exit(exit_code)
