"""Settings for the whole test session.

JAX runs under strict dtype and rank promotion (as equinox's tests do), set globally rather than
per test so that it also holds in the worker threads the engine and the environments use:
library code must never lean on implicit promotion.
"""

import jax

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
