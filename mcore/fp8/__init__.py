"""mcore's FP8 (no Transformer Engine): the linear layers of the transformer layers in FP8.

One concern a module, from the bottom up (``docs/fp8.md``, "The code", walks through them):

* :mod:`~mcore.fp8.config`: the ``--fp8-*`` flags as one typed config (:class:`~mcore.fp8.config.Fp8Config`),
  the scaling recipe as an enum (:class:`~mcore.fp8.config.Recipe`), the questions the code asks of
  them as properties, and the backend check;
* :mod:`~mcore.fp8.operand`: the FP8 operand types (an FP8 tensor with its scale);
* :mod:`~mcore.fp8.scaling`: scales from amaxes, the delayed recipe's per-linear state, its step
  boundary (:class:`~mcore.fp8.scaling.DelayedScaleUpdate`) and checkpointed state;
* :mod:`~mcore.fp8.linear`: the FP8 linear's autograd Function (the tensor-parallel layers call it
  through :meth:`~mcore.fp8.config.Fp8Config.linear_call`);
* :mod:`~mcore.fp8.fused`: the fused producers (norm -> QKV, norm -> fc1 -> activation -> fc2);
* :mod:`~mcore.fp8.producers`: when a transformer layer takes them, and the calls that bind its modules;
* :mod:`~mcore.fp8.param_gather`: ``--fp8-param-gather``, the distributed optimizer's FP8 all-gather.

The package sits above :mod:`mcore.tensor_parallel` (it uses its collectives and layers) and below
:mod:`mcore.distributed` and :mod:`mcore.models`, which call it; the first-gradient write protocol
that the layers, the grad buffer and the layer graphs share stays in
:mod:`mcore.tensor_parallel.first_grad` (the parallel layers use it).
"""

# The FP8 linear registers itself as what Fp8Config.linear_call builds (the config imports none of it).
from mcore.fp8 import linear as _linear  # noqa: E402, F401
