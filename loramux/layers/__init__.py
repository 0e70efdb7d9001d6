"""The engine's layers. DirectCall: see its docstring."""


class DirectCall:
    """Mixin for the engine's own modules (listed first in the bases: `class RMSNorm(DirectCall, nn.Module)`):
    `module(x)` runs `forward` without nn.Module.__call__'s hook dispatch, ~0.9 us a call of the ~330 a decode
    step makes. Forward hooks registered on these modules therefore do not run; the engine registers none
    (LoRALinear, which also wraps plain HF models, calls directly only inside a DirectCall parent)."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)
