"""Test-only: vLLM's real CudaPlatform with its hardware queries answered without a GPU.

Only the device queries are replaced; every vLLM config function (platform rules, backend
selection, graph-mode resolution) runs unmodified. `installed(monkeypatch, capability)` makes it
`vllm.platforms.current_platform` everywhere vLLM reads it, for one test.
"""

import sys
import types

from vllm.platforms.interface import DeviceCapability


def installed(monkeypatch, capability=(9, 0), devices=1):
    # platforms/cuda.py imports this CUDA extension at import time (0.32.0 :23)
    if "vllm._C_stable_libtorch" not in sys.modules:
        monkeypatch.setitem(sys.modules, "vllm._C_stable_libtorch",
                            types.ModuleType("vllm._C_stable_libtorch"))
    import vllm.platforms as platforms
    import vllm.platforms.cuda as cuda
    # modules that branch on the platform at import time are imported on the real one first
    # (e.g. v1/attention/backends/fa_utils.py imports vllm_flash_attn when is_cuda())
    import vllm.engine.arg_utils  # noqa: F401
    import vllm.v1.attention.backends.flash_attn  # noqa: F401
    import vllm.v1.worker.gpu_model_runner  # noqa: F401

    cap = DeviceCapability(*capability)

    class FakeCuda(cuda.CudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id=0):
            return cap

        @classmethod
        def get_device_name(cls, device_id=0):
            return "fake GPU"

        @classmethod
        def get_device_total_memory(cls, device_id=0):
            return 80 << 30

        @classmethod
        def device_count(cls):
            return devices

        @classmethod
        def is_fully_connected(cls, ids):
            return True

        @classmethod
        def is_pin_memory_available(cls):
            return False

        @classmethod
        def get_device_uuid(cls, device_id=0):
            return "GPU-fake"

    fake = FakeCuda()
    monkeypatch.setattr(platforms, "current_platform", fake)
    for name, module in list(sys.modules.items()):  # modules that bound it at import
        if name.startswith("vllm") and module is not platforms and \
                getattr(module, "current_platform", None) is not None:
            monkeypatch.setattr(module, "current_platform", fake, raising=False)
    return fake
