"""``refdml train`` and ``scripts/train_*.py``: flags and a TOML config over :func:`build_run`.

Precedence: a flag given on the command line > the TOML file (``--config``) > the study's
defaults (:data:`refdml.train.runs.KEYS`). The effective config is recorded in
``<out>/config.json`` under ``"run"``. Exit statuses: 0 done (or stopped early), 1 the run
diverged (:class:`~refdml.train.TrainingDiverged`) or failed while training (an error
raised by the model or objective, a file that cannot be written), 2 bad arguments, a bad
config, a run folder that cannot be resumed or an unavailable device. Every error is one
line on stderr naming the flag or config key (no traceback).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from refdml._cli_support import OneLineParser, input_file_problem, output_folder_problem

__all__ = [
    "DESCRIPTION",
    "EPILOG",
    "HELP",
    "add_arguments",
    "add_train_arguments",
    "load_toml",
    "main_for_study",
    "run",
    "run_from_args",
]

HELP = ("train a study (tokens, digits-collage, glyphs, glyph-collage, features) with "
        "refdml.train")
DESCRIPTION = ("Train one of the studies of refdml.train with hand-written backward "
               "passes: flags override the --config TOML, which overrides the study's "
               "defaults (docs/train.md, 'Running a training'). Writes config.json (the "
               "effective config), log.jsonl, checkpoint.npz and best.npz to --out (default "
               "runs/<study>-<UTC time>). Exit "
               "status 0 done, 1 the run diverged, 2 bad arguments, config or device.")
EPILOG = None

#: The folder of the run folders ``refdml train`` makes when ``--out`` is not given.
DEFAULT_OUT = "runs"


def default_out(study: str, now: float | None = None) -> str:
    """``runs/<study>-<UTC time YYYYmmdd-HHMMSS>``: the run folder of a ``refdml train``
    without ``--out`` (``now``: seconds since the epoch; None: the current time)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
    return str(Path(DEFAULT_OUT) / f"{study}-{stamp}")


def load_toml(path: str) -> dict[str, Any]:
    """The TOML file at ``path`` as a dict (tomllib, or the tomli backport on Python 3.10)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the tomli backport, in the "train" extra
        try:
            import tomli as tomllib
        except ImportError as exc:
            from refdml.exceptions import MissingExtraError

            raise MissingExtraError("train", "tomli") from exc
    with open(path, "rb") as handle:
        return tomllib.load(handle)


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    if value >= 2**63:   # an epoch count or seed NumPy holds in an int64
        raise argparse.ArgumentTypeError(f"{value} must be < 2**63")
    return value


def _error(prog: str, message: str) -> int:
    """One line on stderr, argparse's way; the exit status of bad arguments."""
    print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def add_train_arguments(parser: argparse.ArgumentParser, *, study: str | None) -> None:
    """The flags of ``refdml train`` (``--study`` only when ``study`` is None)."""
    from refdml.train.runs import STUDIES

    if study is None:
        parser.add_argument("--study", required=True, choices=STUDIES, help="which study to train")
    parser.add_argument("--config", metavar="FILE.toml",
                        help="TOML file of config keys (docs/train.md); flags override it")
    parser.add_argument("--epochs", type=_nonnegative_int, help="training epochs (after epoch 0)")
    parser.add_argument("--out", metavar="DIR",
                        help="output folder: config.json, log.jsonl, checkpoint.npz, best.npz "
                             f"(default {DEFAULT_OUT}/<study>-<UTC time YYYYmmdd-HHMMSS>)")
    parser.add_argument("--seed", type=_nonnegative_int, help="seed of data, init, batches (>= 0)")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="cpu (NumPy) or cuda (CuPy)")
    parser.add_argument("--dtype", choices=("float32", "float64"), help="of parameters and data")
    parser.add_argument("--reference", action="store_true", default=None,
                        help="run the float64 NumPy reference operators (needs --dtype float64)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its checkpoint.npz (bit-for-bit)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                        help="no tqdm bar")
    parser.add_argument("--capture", action="store_true", default=None,
                        help="--device cuda: record the step once per shape as a CUDA graph and "
                             "replay it (config key capture)")
    if study in (None, "features"):
        parser.add_argument("--features", metavar="PATH",
                            help="features study: .npz with 'features' (N, n, d) and 'labels' (N,)")


def run_from_args(args: argparse.Namespace, *, study: str | None = None,
                  prog: str = "refdml train") -> int:
    """Build the run from the flags and the TOML, train it, print a summary; exit status."""
    from refdml.train.runs import KEYS, DeviceUnavailable, _check_value, build_run
    from refdml.train.trainer import TrainingDiverged, _check_out_dir

    study = study or args.study
    if args.out is None:
        if args.resume:
            return _error(prog, "--resume needs --out, the folder of the run to continue")
        args.out = default_out(study)
        print(f"{prog}: no --out given: writing the run to {args.out}", flush=True)
    try:   # a name too long, a loop of links too (refdml._cli_support.path_problem)
        out = _check_out_dir(args.out, "--out")
    except (TypeError, ValueError) as exc:
        return _error(prog, str(exc))
    problem = output_folder_problem("--out", args.out)   # /proc, a read-only mount: before work
    if problem is not None:
        return _error(prog, problem)
    config: dict[str, Any] = {}
    if args.config is not None:
        problem = input_file_problem("--config", args.config)
        if problem is not None:
            return _error(prog, problem)
        try:
            config = load_toml(args.config)
        except OSError as exc:
            return _error(prog, f"--config {args.config!r} cannot be read: {exc}")
        except Exception as exc:  # tomllib.TOMLDecodeError (no common import on 3.10)
            return _error(prog, f"--config {args.config} is not valid TOML: {exc}")
    features = getattr(args, "features", None)
    if features is not None:
        if study != "features":
            return _error(prog, f"--features applies to --study features, not to {study!r}")
        problem = input_file_problem("--features", features)
        if problem is not None:
            return _error(prog, problem)
    for flag in ("epochs", "seed", "device", "dtype", "reference", "progress", "capture",
                 "features"):
        value = getattr(args, flag, None)
        if value is not None:
            if flag in config:   # overridden by the flag, but a bad value is still refused
                try:
                    _check_value(flag, KEYS[flag], config[flag])
                except (TypeError, ValueError) as exc:
                    return _error(prog, f"bad config (in {args.config}): {exc}")
            config[flag] = str(Path(value)) if flag == "features" else value
    # config.json without checkpoint.npz: a run killed before its first checkpoint, which
    # --resume starts again (Trainer.resume checks the config first)
    if args.resume and not ((out / "checkpoint.npz").is_file() or (out / "config.json").is_file()):
        return _error(prog, f"--resume: {out / 'checkpoint.npz'} does not exist")
    if not args.resume and (out / "log.jsonl").is_file():
        return _error(prog, f"--out {out} already holds a run (log.jsonl); pass --resume to "
                            "continue it or choose another folder")
    try:
        run = build_run(study, config, out_dir=out)
    except (DeviceUnavailable, ImportError) as exc:   # no GPU; a study's missing package
        return _error(prog, str(exc))
    except (TypeError, ValueError, KeyError, OSError) as exc:
        where = f" (in {args.config} or the flags)" if args.config else ""
        return _error(prog, f"bad config{where}: {exc}")
    except MemoryError as exc:   # sizes (dim, n_prototypes, ...) beyond this machine
        where = f" (in {args.config} or the flags)" if args.config else ""
        return _error(prog, f"bad config{where}: its arrays do not fit in memory: {exc}")
    if args.resume:
        try:
            run.trainer.resume()
        except (TypeError, ValueError, OSError) as exc:   # a damaged or missing run file
            return _error(prog, f"--resume: {exc}")
    try:
        rows = run.trainer.fit()
    except TrainingDiverged as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except (TypeError, ValueError, FloatingPointError, OSError, MemoryError) as exc:
        # raised while training (e.g. an objective whose scores overflow float32 after a
        # huge step, a full disk): the run failed, its last checkpoint stays in --out
        epoch = run.trainer.epoch + 1 if run.trainer.started else 0
        print(f"{prog}: error: training stopped in epoch {epoch}: "
              f"{' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    trainer = run.trainer
    for row in rows:
        loss = "-" if row["train_loss"] is None else f"{row['train_loss']:.4f}"
        print(f"epoch {row['epoch']:>3}  loss {loss:>8}  val MAP@R {row['val_map_at_r']:.4f}  "
              f"test MAP@R {row.get('test_map_at_r', float('nan')):.4f}  {row['seconds']:.2f} s")
    stop = " (early stop)" if trainer.stopped_early else ""
    print(f"{study}: {trainer.epoch} epoch(s){stop}; best val MAP@R {trainer.best_metric:.4f} "
          f"at epoch {trainer.best_epoch}; outputs in {out}")
    try:
        from refdml.train.plots import write_run_figures

        figures = write_run_figures(run, out)
    except ImportError as exc:  # matplotlib missing: the run itself is complete
        print(f"no figures: {exc}", file=sys.stderr)
    else:
        print("figures: " + ", ".join(str(path) for path in figures))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``refdml train`` (:func:`add_train_arguments` with ``--study``)."""
    add_train_arguments(parser, study=None)


def run(args: argparse.Namespace) -> int:
    """Run ``refdml train``: :func:`run_from_args` with the study of ``--study``."""
    return run_from_args(args)


def main_for_study(study: str, argv: list[str] | None = None) -> int:
    """Entry point of ``scripts/train_<study>.py``: ``refdml train``'s flags less ``--study``."""
    parser = OneLineParser(
        prog=f"train_{study.replace('-', '_')}.py",
        description=f"Train the {study} study (same flags as `refdml train --study {study}`).")
    add_train_arguments(parser, study=study)
    return run_from_args(parser.parse_args(argv), study=study, prog=parser.prog)
