"""The reference is pure NumPy/SciPy; Numba and CuPy load only where a kernel runs (issue 45).

Each check runs in a child interpreter, where a meta-path finder refuses the modules a test
names, as if they were not installed (tests/_hidden_modules.py, as the extras' tests do):

- with ``numba`` (and ``llvmlite``, ``numba_cuda``, ``cupy``) refused, every operator of the
  reference runs, and so do ``refdml.gradcheck``, ``refdml.catalog``, ``refdml conform`` on a
  NumPy implementation, ``refdml verify --quick`` on a few claims and ``refdml gradcheck``;
  the fast path runs its array path under ``"auto"``, and asking for a CPU twin is one
  clear error naming the extra to install;
- with everything installed, ``import refdml.gpu``, ``refdml.gpu.families`` and
  ``refdml.train``, and a NumPy training step, load neither ``numba.cuda`` nor CuPy.
"""

from __future__ import annotations

import json
import subprocess
import textwrap

from _hidden_modules import child_argv

NO_NUMBA = "numba,llvmlite,numba_cuda,cupy,cupyx"


def _child(body: str, blocked: str, *args: str) -> dict:
    """Run ``body`` with ``blocked`` refused (``json`` imported for it); its last stdout line, as JSON."""
    done = subprocess.run(child_argv("import json\n" + textwrap.dedent(body), blocked, *args),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_reference_runs_without_numba():
    report = _child("""
        import numpy as np
        import refdml.coresets, refdml.crossbatch, refdml.distances, refdml.gsp
        import refdml.histogram, refdml.kcenter, refdml.losses, refdml.metrics
        import refdml.normalize, refdml.ot, refdml.prototypes

        rng = np.random.default_rng(0)
        features, prototypes = rng.standard_normal((2, 5, 3)), rng.standard_normal((4, 3))
        (pooled, z), ctx = refdml.gsp.gsp_pool_forward(features, prototypes, mu=0.3,
                                                       inverse_temperature=5.0)
        grads = refdml.gsp.gsp_pool_backward(ctx, rng.standard_normal(pooled.shape),
                                             rng.standard_normal(z.shape))
        clouds = rng.standard_normal((3, 5, 2))
        divergence = refdml.ot.pairwise_sinkhorn_divergence(clouds, eps=0.5)
        points = rng.standard_normal((60, 4))
        picks = refdml.kcenter.greedy_k_center(points, 5, rng=0)
        metrics = refdml.metrics.retrieval_metrics(points, rng.integers(0, 4, 60))
        print(json.dumps({
            "finite": bool(np.all(np.isfinite(grads.features)) and np.all(np.isfinite(divergence))),
            "picks": len(picks.indices), "map": metrics["mean_average_precision_at_r"],
            "numba": sorted(m for m in sys.modules if m.split(".")[0] in ("numba", "llvmlite")),
        }))
    """, NO_NUMBA)
    assert report["finite"] and report["picks"] == 5 and 0.0 <= report["map"] <= 1.0
    assert report["numba"] == []


def test_gradcheck_catalogue_and_conform_run_without_numba():
    report = _child("""
        from refdml.catalog import all_operators, get
        from refdml.conformance import check_implementation

        names = ("normalize.l2_normalize", "gsp.pool", "ot.sinkhorn_divergence",
                 "losses.multi_similarity")
        checks = {name: bool(get(name).check(rng=0).passed(get(name).rtol, get(name).atol))
                  for name in names}
        spec = get("losses.multi_similarity")
        conform = check_implementation(spec.forward, spec.name, framework="numpy",
                                       backward=spec.backward, search=False).passed
        print(json.dumps({"checks": checks, "conform": bool(conform),
                          "entries": len(all_operators()),
                          "numba": sorted(m for m in sys.modules if m.startswith("numba"))}))
    """, NO_NUMBA)
    assert all(report["checks"].values()), report["checks"]
    assert report["conform"] and report["entries"] > 40
    assert report["numba"] == []


def test_the_commands_run_without_numba():
    report = _child("""
        import contextlib, io
        from refdml.cli import main

        codes = {}
        for argv in (["verify", "--quick", "--only", "gsp.prop4.2", "asap.eq4.2"],
                     ["gradcheck", "--only", "normalize.l2_normalize", "gsp.pool"]):
            with contextlib.redirect_stdout(io.StringIO()):
                codes[argv[0]] = main(argv)
        print(json.dumps({"codes": codes, "numba": "numba" in sys.modules}))
    """, NO_NUMBA)
    assert report == {"codes": {"verify": 0, "gradcheck": 0}, "numba": False}


def test_the_fast_path_without_numba_runs_its_array_path_and_names_the_extra():
    report = _child("""
        import numpy as np
        from refdml.exceptions import MissingExtraError
        from refdml.gpu import use_kernels
        from refdml.gpu.ot import pairwise_sinkhorn_divergence

        clouds = np.random.default_rng(0).standard_normal((3, 5, 2))
        auto = pairwise_sinkhorn_divergence(clouds, eps=0.5)      # "auto" would pick the twin
        with use_kernels("array"):
            array = pairwise_sinkhorn_divergence(clouds, eps=0.5)
        try:
            with use_kernels("cpu"):
                pairwise_sinkhorn_divergence(clouds, eps=0.5)
            refused = None
        except MissingExtraError as exc:
            refused = str(exc)
        print(json.dumps({"same": bool(np.array_equal(auto, array)), "refused": refused}))
    """, NO_NUMBA)
    assert report["same"]
    assert report["refused"] == ('needs the "fast" extra (numba is not installed): '
                                 'pip install "refdml[fast]"')


def test_importing_the_fast_path_and_training_loads_no_cuda_and_no_cupy():
    report = _child("""
        import numpy as np
        import refdml.gpu, refdml.gpu.families, refdml.train
        from refdml.gpu.gsp import gsp_pool_forward

        rng = np.random.default_rng(0)
        gsp_pool_forward(rng.standard_normal((2, 5, 3)), rng.standard_normal((4, 3)), mu=0.3,
                         inverse_temperature=5.0)
        loaded = sorted(m for m in sys.modules
                        if m.startswith(("numba.cuda", "numba_cuda", "cupy", "cupyx"))
                        or m.endswith("._cuda") or m == "refdml.gpu._support.cuda")
        print(json.dumps(loaded))
    """, "")
    assert report == []


def test_the_reference_gradcheck_and_catalogue_import_no_numba_where_it_is_installed():
    report = _child("""
        import numpy as np
        import refdml.gsp, refdml.metrics, refdml.kcenter, refdml.ot
        from refdml.catalog import get
        from refdml.conformance import check_implementation

        spec = get("gsp.pool")
        passed = spec.check(rng=0).passed(spec.rtol, spec.atol)
        conform = check_implementation(spec.forward, spec.name, framework="numpy",
                                       backward=spec.backward, search=False).passed
        print(json.dumps({"passed": bool(passed and conform),
                          "numba": sorted(m for m in sys.modules if m.startswith("numba"))}))
    """, "")
    assert report == {"passed": True, "numba": []}


def test_every_family_runs_its_array_path_without_numba_as_the_reference_does():
    # With Numba refused, "auto" runs each kernel family's array path: on NumPy float64 it
    # gives the reference's results (k-center's picks and radii and the retrieval metrics
    # exactly: the same operations in the same order; the others to rounding).
    report = _child("""
        import numpy as np
        import refdml.gsp, refdml.kcenter, refdml.losses, refdml.metrics, refdml.ot
        import refdml.gpu.gsp, refdml.gpu.kcenter, refdml.gpu.losses, refdml.gpu.metrics
        import refdml.gpu.ot

        rng = np.random.default_rng(0)
        points = rng.standard_normal((60, 4))
        labels = rng.integers(0, 5, 60)
        features, prototypes = rng.standard_normal((2, 5, 3)), rng.standard_normal((4, 3))
        clouds = rng.standard_normal((3, 5, 2))
        gsp = [refdml.gsp.gsp_pool_forward(features, prototypes, mu=0.3,
                                           inverse_temperature=5.0)[0][0],
               refdml.gpu.gsp.gsp_pool_forward(features, prototypes, mu=0.3,
                                               inverse_temperature=5.0)[0][0]]
        loss = [refdml.losses.multi_similarity(points, labels)[0],
                refdml.gpu.losses.multi_similarity(points, labels)[0]]
        ot = [refdml.ot.pairwise_sinkhorn_divergence(clouds, eps=0.5),
              refdml.gpu.ot.pairwise_sinkhorn_divergence(clouds, eps=0.5)]
        picks = [refdml.kcenter.greedy_k_center(points, 6, rng=0),
                 refdml.gpu.kcenter.greedy_k_center(points, 6, rng=0)]
        metrics = [refdml.metrics.retrieval_metrics(points, labels),
                   refdml.gpu.metrics.retrieval_metrics(points, labels)]
        close = lambda a, b: bool(np.allclose(a, b, rtol=1e-10, atol=0))
        print(json.dumps({
            "gsp": close(*gsp), "losses": close(*loss), "ot": close(*ot),
            "kcenter": bool(np.array_equal(picks[0].indices, picks[1].indices)
                            and np.array_equal(picks[0].radii, picks[1].radii)),
            "metrics": metrics[0] == metrics[1],
            "numba": sorted(m for m in sys.modules if m.startswith("numba"))}))
    """, NO_NUMBA)
    assert report == {"gsp": True, "losses": True, "ot": True, "kcenter": True,
                      "metrics": True, "numba": []}
