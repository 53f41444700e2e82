import os

# Tiny matrices on a 2-core machine: threaded BLAS only adds contention. Must be set
# before numpy is first imported.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

from hypothesis import HealthCheck, settings

# CI machines are small (2 cores); keep hypothesis budgets modest and deadline-free.
# CI is derandomised (the same examples on every run, no example database) so a submission
# never lands or fails by the luck of the draw; "dev" and "thorough" draw afresh each run.
settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
