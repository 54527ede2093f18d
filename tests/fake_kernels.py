"""An audited callable for CLI tests: the SM90 model with a broken exp2."""

import dataclasses

from fa4.model import FA4Numerics, attention


def sm90_model_poly_exp2(q, k, v, *, causal=False, window_size=(None, None), return_lse=False, **kw):
    """Differs from the SM90 path: every exp2 through the degree-1 polynomial."""
    nm = dataclasses.replace(
        FA4Numerics.for_inputs("sm90", q, k, v, causal, window_size), exp2="emulated", poly_degree=1
    )
    return attention(q, k, v, causal=causal, window_size=window_size, return_lse=return_lse, numerics=nm, **kw)


def no_lse(q, k, v, *, return_lse=False, **kw):
    """Correct outputs, but ignores ``return_lse``: the LSE is never returned."""
    from tests.bugged_kernels import exact

    return exact(q, k, v, **kw)


def refuses_everything(q, k, v, **kw):
    """Raises NotImplementedError for every configuration: nothing can be audited."""
    raise NotImplementedError("this kernel supports no configuration")
