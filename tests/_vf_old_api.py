"""A verifiers environment package written for verifiers' older API (before `verifiers.v1`):
a `load_environment()` function and no exported `vf.Taskset` (taskset id `_vf_old_api`)."""


def load_environment(**kwargs):
    raise AssertionError("dew does not call an older API's load_environment")
