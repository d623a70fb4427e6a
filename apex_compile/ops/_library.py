"""The one `torch.library.Library` fragment in which apex_compile.ops defines every `apex::` op.

Each op module defines its schema with `LIB.define`, registers its fake implementation right beside it
(`torch.library.register_fake(..., lib=LIB)`) and its kernels per dispatch key with `LIB.impl`; the Triton
launches come from apex_compile.kernels, which knows nothing of the ops.
"""
import torch

LIB = torch.library.Library("apex", "FRAGMENT")
PT2_COMPLIANT = (torch.Tag.pt2_compliant_tag,)


def no_autograd_formula(name: str) -> None:
    """Autograd of an inference-only functional op: the kernel runs below autograd and backward raises (as for
    a `torch.library.custom_op` without a formula), so no gradient is silently wrong."""
    qualname = f"apex::{name}"

    def backward(ctx, *grads):
        raise RuntimeError(f"Trying to backward through {qualname} but no autograd formula was registered "
                           "(the apex ops are inference-only)")

    torch.library.register_autograd(qualname, backward, lib=LIB)
