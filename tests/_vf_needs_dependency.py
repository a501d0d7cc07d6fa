"""A verifiers taskset package whose own import fails: it needs an optional dependency that is
not installed (taskset id `_vf_needs_dependency`)."""

import dew_tests_missing_dependency  # noqa: F401
