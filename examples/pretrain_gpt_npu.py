"""``pretrain_gpt.py`` for Ascend NPUs, the MindSpeed way: import the adaptor first, then pretrain.

    torchrun --nproc_per_node 8 examples/pretrain_gpt_npu.py <Megatron-LM flags>

``import mcore.adaptors.npu`` registers the NPU backend (HCCL, CANN fused ops), makes it the ``auto``
choice and applies the adaptor's patch table once; ``--device-backend npu`` with the plain
``pretrain_gpt.py`` does the same. With ``MCORE_SIMULATED_NPU=1`` the script first installs mcore's
*simulated* torch_npu (a CPU test double, gloo in place of HCCL), so the launch path can be checked on
a machine without NPUs; real training needs real NPUs.
"""

import os

if os.environ.get("MCORE_SIMULATED_NPU") == "1":
    from mcore.backends.npu import simulated

    simulated.install()

import mcore.adaptors.npu  # noqa: E402,F401  (activates NPU support, as mindspeed.megatron_adaptor does)

from mcore.training.gpt import forward_step, model_provider  # noqa: E402
from mcore.training.pretrain import gpt_datasets_provider, pretrain  # noqa: E402

if __name__ == "__main__":
    pretrain(model_provider, forward_step, gpt_datasets_provider)
