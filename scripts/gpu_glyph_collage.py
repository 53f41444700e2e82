"""The glyph-collage GSP experiment in one 9-minute GPU command (docs/gpu/gpu-machine.md,
"The glyph-collage run"): one configuration of ``refdml reproduce``'s ``gsp.glyph_collage`` at
``--scale large``, sized from the H200 run's measured train step, under a hard wall-clock
budget.

    python scripts/gpu_glyph_collage.py --out DIR                # on a GPU machine
    python scripts/gpu_glyph_collage.py --plan-only              # the sizing, no training
    python scripts/gpu_glyph_collage.py --dry-run --out DIR      # anywhere (CI): the CPU

``REFDML_GPU_GLYPH_COLLAGE=1 bash scripts/gpu_run.sh`` runs it on a GPU machine after the
install and smoke steps, in a call of its own (the default call is unchanged).

The configuration: the contrastive loss, GAP against GSP (the claim's core comparison),
seeds 0 and 1: two seeds are the fewest a paired interval can be drawn from, and with two
the bootstrap interval is the span of the two paired differences, so a verdict says only
whether both seeds agree in sign. Every other setting is the experiment's own at
``--scale large`` (read from ``refdml.reproduce`` when the script runs, so it follows any
change there), except ``epochs``: the most that fit the budget by :func:`plan_run`, from
the measured cost of a training step on the H200 (:data:`H200_COSTS`, each figure's source
beside it) and the number of training collages counted here. No validation grid
(``select``) is run: one configuration.

The budget guard. Tasks run in this process, one after the other, seed by seed (GAP, then
GSP, so that a cut run still has a paired seed, and seed 0, which carries the attention
maps, first). A seed's pair is not started when the plan, scaled by how far the finished
tasks ran over it, says it would not end before the deadline (``--budget-s`` less the time
kept for the report); a task still running at the deadline is stopped by an alarm. Finished
tasks are in ``DIR/cache`` (a rerun with the same ``--out`` loads them). The report is then
written from what finished: ``DIR/glyph_collage.json``, ``DIR/README.md`` with the figures
(attention maps of GSP's pooling weights, the class cell's share of the weight, bars,
curves, the glyphs), every file atomically.

``--dry-run``: the same code path on the CPU at toy size (40 glyph classes of 16 x 16,
a narrow trunk, one epoch), then a check that the report's files exist.

Exit status: 0 every task finished (and, dry run, every output exists); 1 a task failed,
was stopped or was not started for want of time, or an output is missing (the report is
written all the same); 2 bad arguments or no usable device.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import signal
import sys
import time
from pathlib import Path

EXPERIMENT_ID = "gsp.glyph_collage"
LOSS = "contrastive"
METHODS = ("gap", "gsp")            # the baseline first: a seed's pair in this order
SEEDS = 2
MODE = "quick"                      # only ``epochs`` differs between the modes; it is set here
SCALE = "large"
DEFAULT_OUT = "gpu_glyph_collage_out"
#: The embedding forward of evaluation and of the GSP metrics: refdml.reproduce's batch.
EVAL_BATCH = 512

#: Toy settings of the dry run (on top of the experiment's): small glyphs and classes,
#: a narrow trunk (strides 2, 2, 1: 8 x 8 local features of a 32 x 32 collage), one epoch.
DRY_RUN_SETTINGS = {"glyph_size": 16, "max_classes": 40, "instances_per_font": 1,
                    "collages_per_image": 1, "conv_channels": [8, 8, 8],
                    "conv_strides": [2, 2, 1], "local_dim": 16, "embedding_dim": 16,
                    "n_prototypes": 8, "transfer_repeats": 2, "epochs": 1}


@dataclasses.dataclass(frozen=True)
class Costs:
    """What the plan charges, in seconds. The measured figures are the H200 run of
    2026-11-28 (shared/gpu-runs/2026-11-28-h200/README.md); the others are assumptions,
    each with its reason in docs/gpu/gpu-machine.md, "The glyph-collage run"."""

    step_s: float           # one training step (batch 64), measured
    step_margin: float      # planning factor on it (assumed)
    warmup_s: float         # compilation and first calls, once per process
    forward_s: float        # one evaluation forward of EVAL_BATCH images (assumed)
    host_eval_s: float      # host work of one evaluation (retrieval metrics)
    host_final_s: float     # host work of GSP's cell weights and transfer MAP@R, per task
    data_s: float           # building one task's collages on the host
    report_s: float         # kept after the tasks for the report and figures
    safety: float           # the fraction of the time left for tasks that the plan fills

    @property
    def planned_step_s(self) -> float:
        return self.step_s * self.step_margin


#: bench_gpu.json of the H200 run: "digits-collage step, cuda float32", batch 64, median
#: of 9 = 27.6 ms. train.log of the same run: the tokens study's epochs took 24.5 s (the
#: untrained evaluation), 17.8 s, 1.6 s and 0.33 s, so about 43 s of compilation and first
#: calls before the steady state; 60 s are charged (the conv trunk's CuPy kernels compile
#: too). The 1.5 on the step: a glyph-collage step makes fewer launches than the
#: digits-collage step (CuPy stand-in, array path, batch 64: GSP 1,487 and GAP 635 against
#: 1,612) but four conv layers on 56 x 56 collages instead of three on 16 x 16; the step is
#: launch-bound (the H200 profile), so its arithmetic (about 3 GFLOP, 0.1 ms at the run's
#: measured 36 TFLOP/s) is not what the margin is for: host noise and the unmeasured rest.
#: An evaluation forward of 512 collages is charged a planned step (a third of a step's
#: launches, 8 times its images). Host figures: retrieval metrics of the 3,736 validation
#: and test collages took 0.09 s and building one task's collages 2.8 s on the project's
#: 2-core machine; 0.5 s, 2 s and 5 s are charged.
H200_COSTS = Costs(step_s=0.0276, step_margin=1.5, warmup_s=60.0, forward_s=0.0414,
                   host_eval_s=0.5, host_final_s=2.0, data_s=5.0, report_s=30.0, safety=0.9)

#: The default budget of the whole script (GPU run): what ``gpu_run.sh`` gives its
#: glyph-collage step (470 s) less 20 s for the interpreter's exit and the hand-over.
GPU_BUDGET_S = 450.0
DRY_RUN_BUDGET_S = 150.0


@dataclasses.dataclass(frozen=True)
class Plan:
    """The sizing of a run: ``epochs`` and the predicted seconds per task (``task_s``;
    the first task computed also pays ``warmup_s``)."""

    epochs: int
    fits: bool              # False: even one epoch is predicted past the budget
    n_train: int
    n_val: int
    n_test: int
    batch: int
    steps_per_epoch: int
    epoch_s: float          # one epoch of one task: its steps and one evaluation
    eval_s: float
    fixed_s: float          # warm-up, data, the untrained evaluations, GSP's final metrics
    available_s: float      # what the plan may fill: safety x (budget - report_s)
    task_s: dict            # method -> predicted seconds of one task (without warm-up)
    warmup_s: float

    @property
    def total_s(self) -> float:
        return self.warmup_s + SEEDS * sum(self.task_s.values())

    def lines(self, costs: Costs, budget_s: float) -> list[str]:
        """The sizing argument, in words and numbers."""
        return [
            f"training collages {self.n_train:,}, batch {self.batch} -> at most "
            f"{self.steps_per_epoch:,} steps an epoch (n_train // batch)",
            f"a step planned at {costs.planned_step_s * 1e3:.1f} ms (measured "
            f"{costs.step_s * 1e3:.1f} ms x margin {costs.step_margin:g}); an evaluation "
            f"({self.n_val:,} validation + {self.n_test:,} test collages) {self.eval_s:.2f} s",
            f"one epoch of one task {self.epoch_s:.1f} s; fixed costs {self.fixed_s:.1f} s "
            f"(warm-up {self.warmup_s:.0f} s, data, untrained evaluations, GSP's metrics)",
            f"budget {budget_s:.0f} s, less {costs.report_s:.0f} s for the report, times "
            f"{costs.safety:g}: {self.available_s:.0f} s for {SEEDS * len(self.task_s)} tasks",
            f"-> {self.epochs} epoch(s) a task ({self.epochs * self.steps_per_epoch:,} steps), "
            f"predicted {self.total_s:.0f} s"
            + ("" if self.fits else " (DOES NOT FIT: one epoch is over the budget)"),
        ]


def _forwards(n: int) -> int:
    return math.ceil(n / EVAL_BATCH)


def plan_run(*, n_train: int, n_val: int, n_test: int, batch: int, budget_s: float,
             costs: Costs = H200_COSTS, methods=METHODS, seeds: int = SEEDS) -> Plan:
    """The most epochs ``E >= 1`` with ``warmup + sum over tasks of task(E) <= available``.

    A task (one method, one seed) costs ``data + (E + 1) eval + E steps step`` and, for
    GSP, its final metrics (cell weights on the test split, transfer MAP@R on validation
    + test: their forwards and host work). ``eval`` is one embedding of the validation and
    the test split. ``steps = n_train // batch`` (an upper bound: the class-balanced
    sampler strands a few samples an epoch)."""
    for name, value in (("n_train", n_train), ("n_val", n_val), ("n_test", n_test),
                        ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} == {value!r}, must be an integer >= 1")
    if not (isinstance(budget_s, (int, float)) and math.isfinite(budget_s) and budget_s > 0):
        raise ValueError(f"budget_s == {budget_s!r}, must be a finite number > 0")
    step = costs.planned_step_s
    steps = n_train // batch
    eval_s = (_forwards(n_val) + _forwards(n_test)) * costs.forward_s + costs.host_eval_s
    final_s = ((_forwards(n_test) + _forwards(n_val + n_test)) * costs.forward_s
               + costs.host_final_s)
    epoch_s = steps * step + eval_s
    per_task_fixed = {m: costs.data_s + eval_s + (final_s if m == "gsp" else 0.0)
                      for m in methods}
    fixed_s = costs.warmup_s + seeds * sum(per_task_fixed.values())
    available = costs.safety * (budget_s - costs.report_s)
    n_tasks = seeds * len(methods)
    room = math.floor((available - fixed_s) / (n_tasks * epoch_s)) if epoch_s > 0 else 1
    epochs = max(1, room)
    task_s = {m: per_task_fixed[m] + epochs * epoch_s for m in methods}
    return Plan(epochs=epochs, fits=room >= 1, n_train=n_train, n_val=n_val, n_test=n_test,
                batch=batch, steps_per_epoch=steps, epoch_s=epoch_s, eval_s=eval_s,
                fixed_s=fixed_s, available_s=available, task_s=task_s,
                warmup_s=costs.warmup_s)


# --------------------------------------------------------------------------- the run
class BudgetExceeded(BaseException):
    """Raised by the alarm at the deadline: a BaseException, so that the runner's
    per-task ``except Exception`` (a failed task, the others go on) lets it through."""


def _on_alarm(signum, frame):
    raise BudgetExceeded()


def experiment(overrides: dict):
    """``gsp.glyph_collage`` cut to one configuration: GAP and GSP with ``LOSS``, the
    experiment's settings then ``overrides``, its comparisons among those runs, no grid."""
    from refdml.reproduce import EXPERIMENTS

    base = EXPERIMENTS[EXPERIMENT_ID]
    runs = {}
    for label, (method, settings) in base.runs.items():
        if method in METHODS and settings.get("loss") == LOSS:
            runs[label] = (method, {**settings, **overrides})
    comparisons = tuple(c for c in base.comparisons if c.run in runs and c.baseline in runs)
    if sorted(m for m, _ in runs.values()) != sorted(METHODS) or not comparisons:
        raise RuntimeError(f"{EXPERIMENT_ID} has no runs {METHODS} with loss {LOSS!r} compared "
                           f"with each other (runs: {sorted(base.runs)})")
    notes = (f"One configuration of {EXPERIMENT_ID} sized for one GPU command "
             f"(scripts/gpu_glyph_collage.py): loss {LOSS}, {' and '.join(METHODS)}, "
             f"{SEEDS} seeds (with two, the interval is the span of the two paired "
             f"differences), epochs {overrides.get('epochs')}.")
    return dataclasses.replace(base, runs=runs, comparisons=comparisons, select={},
                               seeds={**base.seeds, MODE: SEEDS}, notes=notes)


def count_collages(settings: dict) -> tuple[int, int, int, float]:
    """Training, validation and test collages of seed 0 at ``settings`` (as the study
    builds them), and the seconds it took."""
    from refdml.train.data import make_glyph_collages

    start = time.perf_counter()
    data = make_glyph_collages(
        rng=0, collages_per_image=settings["collages_per_image"],
        n_background=tuple(settings["n_background"]),
        families=tuple(settings.get("families", ())), size=settings["glyph_size"],
        max_classes=settings["max_classes"], instances_per_font=settings["instances_per_font"],
        eval_instances_per_font=settings["eval_instances_per_font"])
    return (data.train.images.shape[0], data.val.images.shape[0], data.test.images.shape[0],
            time.perf_counter() - start)


def _ordered(grid: dict) -> list:
    """The tasks seed by seed, each seed's in METHODS order."""
    by_method = {tasks[0].method: tasks for tasks in grid.values()}
    return [by_method[m][s] for s in range(SEEDS) for m in METHODS]


def run_guarded(tasks: list, plan: Plan, *, deadline: float, cache_dir: Path,
                clock=time.monotonic) -> tuple:
    """Run ``tasks`` in this process until ``deadline`` (a ``clock`` time); returns the
    merged :class:`~refdml.reproduce.Outcome` and a status row per task."""
    from refdml.reproduce import Outcome, run_tasks

    outcome, rows = Outcome(), []
    planned_done = measured_done = 0.0
    warm = False
    pairs = [tasks[i:i + len(METHODS)] for i in range(0, len(tasks), len(METHODS))]
    for index, pair in enumerate(pairs):
        cached = run_tasks(pair, workers=None, cache_dir=cache_dir, progress=False,
                           compute=False)
        _merge(outcome, cached)
        to_run = [t for t in pair if t not in cached.results]
        over = max(1.0, measured_done / planned_done) if planned_done else 1.0
        predicted = (sum(plan.task_s[t.method] for t in to_run)
                     + (plan.warmup_s if to_run and not warm else 0.0)) * over
        left = deadline - clock()
        # seed 0's pair always starts: a cut run with one paired seed beats none
        skip = (f"predicted {predicted:.0f} s for the seed's pair, {left:.0f} s left"
                if index > 0 and to_run and predicted > left else "")
        for task in pair:
            if task in cached.results:
                rows.append(_row(task, "cached", cached.results[task], plan))
                continue
            left = deadline - clock()
            if skip or left <= 0:
                rows.append(_row(task, "not started", None, plan,
                                 note=skip or "past the deadline"))
                continue
            start = clock()
            previous = signal.signal(signal.SIGALRM, _on_alarm)
            signal.setitimer(signal.ITIMER_REAL, left)
            try:
                one = run_tasks([task], workers=None, cache_dir=cache_dir, progress=False,
                                in_process=True)
            except BudgetExceeded:
                rows.append(_row(task, "stopped", None, plan,
                                 note=f"stopped at the deadline after {clock() - start:.0f} s"))
                continue
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
            _merge(outcome, one)
            if task in one.results:
                planned_done += plan.task_s[task.method] + (0.0 if warm else plan.warmup_s)
                measured_done += one.results[task]["seconds"]
                warm = True
            rows.append(_row(task, "computed" if task in one.results else "failed",
                             one.results.get(task), plan))
    return outcome, rows


def _merge(into, part) -> None:
    into.results.update(part.results)
    into.failures.update(part.failures)
    into.cached |= part.cached
    into.computed |= part.computed


def _row(task, status: str, result: dict | None, plan: Plan, note: str = "") -> dict:
    row = {"method": task.method, "seed": task.seed, "status": status,
           "planned_s": round(plan.task_s[task.method], 1), "seconds": None,
           "untrained_test_map_at_r": None, "test_map_at_r": None, "selected_epoch": None,
           "note": note}
    if result is not None:
        row["seconds"] = round(float(result["seconds"]), 1)
        curve = result.get("curves", {}).get("test_map_at_r") or [None]
        row["untrained_test_map_at_r"] = curve[0]
        row["test_map_at_r"] = result["metrics"].get("test_map_at_r")
        row["selected_epoch"] = result["metrics"].get("selected_epoch")
    return row


def _cell(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _run_section(run: dict) -> list[str]:
    """The README's section on the budget: the plan and each task's fate."""
    lines = ["", "## This run: the plan and the budget", ""]
    if run["dry_run"]:
        lines += ["**DRY RUN** on the CPU at toy size (scripts/gpu_glyph_collage.py "
                  "--dry-run): it checks the code path and the files, and is no result.", ""]
    lines += [f"Budget {run['budget_s']:.0f} s, tasks until {run['task_deadline_s']:.0f} s; "
              f"the whole script took {run['wall_s']:.0f} s. The plan "
              f"(docs/gpu/gpu-machine.md, \"The glyph-collage run\"):", ""]
    lines += [f"- {line}" for line in run["plan_lines"]]
    lines += ["", "| method | seed | status | planned s | seconds | untrained test MAP@R "
              "| test MAP@R | selected epoch | note |", "|---|---|---|---|---|---|---|---|---|"]
    for r in run["tasks"]:
        lines.append(f"| {r['method']} | {r['seed']} | {r['status']} | {r['planned_s']:.0f} | "
                     f"{_cell(r['seconds'], 1)} | {_cell(r['untrained_test_map_at_r'])} | "
                     f"{_cell(r['test_map_at_r'])} | {_cell(r['selected_epoch'], 0)} | "
                     f"{r['note']} |")
    return lines


# --------------------------------------------------------------------------- command line
def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--budget-s == {text!r}, must be a number of "
                                         "seconds > 0") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"--budget-s == {value!r}, must be a number of "
                                         "seconds > 0")
    return value


def _parser() -> argparse.ArgumentParser:
    from refdml._cli_support import at_least

    parser = argparse.ArgumentParser(
        prog="gpu_glyph_collage.py",
        description="gsp.glyph_collage (GAP vs GSP, contrastive, 2 seeds, --scale large) "
                    "sized for one 9-minute GPU command, under a wall-clock budget.",
        epilog="exit status: 0 every task finished; 1 a task failed, was stopped or not "
               "started, or an output is missing; 2 bad arguments or no usable device")
    parser.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                        help=f"results, report and task cache (default {DEFAULT_OUT})")
    parser.add_argument("--budget-s", type=_positive_seconds, default=None, metavar="SECONDS",
                        help=f"wall-clock budget of the whole script (default {GPU_BUDGET_S:g}; "
                             f"dry run {DRY_RUN_BUDGET_S:g}); the last "
                             f"{H200_COSTS.report_s:g} s are kept for the report")
    parser.add_argument("--epochs", type=at_least("--epochs"), default=None,
                        help="train this many epochs instead of the plan's")
    parser.add_argument("--plan-only", action="store_true",
                        help="print the plan (counting the collages) and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="the same code path on the CPU at toy size; checks the outputs")
    return parser


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    args = _parser().parse_args(argv)
    budget = args.budget_s or (DRY_RUN_BUDGET_S if args.dry_run else GPU_BUDGET_S)
    costs = H200_COSTS
    if budget <= costs.report_s:
        print(f"gpu_glyph_collage.py: error: --budget-s == {budget:g}, must exceed the "
              f"{costs.report_s:g} s kept for the report", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"gpu_glyph_collage.py: error: --out == {str(out)!r} is a file, not a folder",
              file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    if not args.plan_only:
        from refdml.reproduce._cli import _check_device

        problem = _check_device(device)
        if problem is not None:
            print(f"gpu_glyph_collage.py: error: {problem}", file=sys.stderr)
            return 2

    from refdml.reproduce import code_version

    overrides = {"loss": LOSS, **(DRY_RUN_SETTINGS if args.dry_run else {})}
    exp = experiment(overrides)
    settings = exp.run_settings(next(iter(exp.runs)), MODE, SCALE)
    n_train, n_val, n_test, data_s = count_collages(settings)
    batch = settings["n_classes_per_batch"] * settings["n_samples_per_class"]
    plan = plan_run(n_train=n_train, n_val=n_val, n_test=n_test, batch=batch,
                    budget_s=budget, costs=costs)
    plan_lines = plan.lines(costs, budget) + [
        f"(seed 0's collages built in {data_s:.1f} s here; {costs.data_s:g} s charged)"]
    epochs = args.epochs or (DRY_RUN_SETTINGS["epochs"] if args.dry_run else plan.epochs)
    if epochs != plan.epochs:
        plan = dataclasses.replace(plan, epochs=epochs, task_s={
            m: s + (epochs - plan.epochs) * plan.epoch_s for m, s in plan.task_s.items()})
        why = "--epochs" if args.epochs else "the dry run"
        plan_lines.append(f"epochs set to {epochs} by {why}: predicted {plan.total_s:.0f} s")
    if args.dry_run:
        plan_lines.insert(0, "dry run: the H200's costs applied to the toy sizes (the code "
                             "path, not a sizing)")
    kind = "DRY RUN on the CPU, toy size" if args.dry_run else f"{SCALE} scale on {device}"
    print(f"gpu_glyph_collage.py ({kind}): {EXPERIMENT_ID}, {LOSS}, {' vs '.join(METHODS)}, "
          f"{SEEDS} seeds, code version {code_version()}")
    print("\n".join(f"  plan: {line}" for line in plan_lines), flush=True)
    if args.plan_only:
        return 0

    from refdml.reproduce._report import evaluate_experiment, write_json, write_report

    exp = experiment({**overrides, "epochs": epochs})
    grid = exp.tasks(MODE, SEEDS, scale=SCALE, device=device)
    tasks = _ordered(grid)
    deadline = start + budget - costs.report_s
    outcome, rows = run_guarded(tasks, plan, deadline=deadline, cache_dir=out / "cache")
    for r in rows:
        print(f"  {r['method']} seed {r['seed']}: {r['status']}"
              + (f" in {r['seconds']:.1f} s (planned {r['planned_s']:.0f} s)"
                 if r["seconds"] is not None else "")
              + (f", test MAP@R {r['test_map_at_r']:.4f}" if r["test_map_at_r"] is not None
                 else "") + (f"; {r['note']}" if r["note"] else ""), flush=True)

    result = evaluate_experiment(exp, MODE, outcome, seeds=SEEDS, scale=SCALE, device=device)
    cpu = sum(outcome.results[t].get("cpu_seconds", 0.0) for t in outcome.computed)
    run_info = {"dry_run": args.dry_run, "budget_s": budget,
                "task_deadline_s": budget - costs.report_s, "epochs": epochs,
                "plan": dataclasses.asdict(plan), "plan_lines": plan_lines,
                "costs": dataclasses.asdict(costs), "tasks": rows}
    payload = {"mode": MODE, "scale": SCALE, "device": device,
               "wall_seconds": time.monotonic() - start,
               "task_cpu_seconds": cpu, "workers": "in this process (scripts/gpu_glyph_collage.py)",
               "code_version": code_version(), "experiments": [result],
               "tasks": {"computed": len(outcome.computed), "cached": len(outcome.cached),
                         "failed": len(outcome.failures),
                         "missing": sum(r["status"] in ("stopped", "not started") for r in rows)},
               "glyph_collage_run": run_info}
    out.mkdir(parents=True, exist_ok=True)
    readme = write_report(out, payload)
    run_info["wall_s"] = time.monotonic() - start
    write_json(out / "glyph_collage.json", payload)
    from refdml._io import write_text_atomic

    write_text_atomic(readme, readme.read_text(encoding="utf-8").rstrip("\n") + "\n"
                      + "\n".join(_run_section(run_info)) + "\n")
    print(f"  verdict {result['verdict']}: " + "; ".join(
        f"{c['name']}: {c['effect']:+.4f} [{c['low']:+.4f}, {c['high']:+.4f}] over {c['n']} "
        "seeds" for c in result["comparisons"] if c["n"]))
    print(f"report {readme}, JSON {out / 'glyph_collage.json'}; "
          f"{time.monotonic() - start:.0f} s in all")

    failed = [r for r in rows if r["status"] not in ("computed", "cached")]
    missing = []
    if args.dry_run:
        prefix = EXPERIMENT_ID.replace(".", "_")
        for name in ("README.md", "glyph_collage.json", f"{prefix}_attention.png",
                     f"{prefix}_cell_weights.png", f"{prefix}_curves.png"):
            if not (out / name).is_file():
                missing.append(name)
        if missing:
            print(f"dry run: missing outputs in {out}: {', '.join(missing)}", file=sys.stderr)
    if failed:
        print(f"{len(failed)} task(s) did not finish: "
              + ", ".join(f"{r['method']} seed {r['seed']} ({r['status']})" for r in failed),
              file=sys.stderr)
    return 1 if failed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
