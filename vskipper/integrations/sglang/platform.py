"""`vskipper_cpu`: an opt-in SGLang platform that runs SGLang's real scheduler, paged KV pool and
radix cache on a machine without a GPU or AMX (attention backend torch_native).

Selected with SGLANG_PLATFORM=vskipper_cpu. It never activates unless selected: SGLang activates
every installed platform plugin when SGLANG_PLATFORM is unset, and this one must never take
over a CUDA machine."""
from __future__ import annotations

import os

NAME = "vskipper_cpu"


def activate() -> str | None:
    """Entry point of group `sglang.srt.platforms`: the platform class's qualified name when
    selected, else None."""
    if os.environ.get("SGLANG_PLATFORM") != NAME:
        return None
    return "vskipper.integrations.sglang.platform.VSkipperCpuPlatform"


def _platform_class():
    from sglang.srt.platforms.cpu import CpuDeviceMixin
    from sglang.srt.platforms.device_mixin import PlatformEnum
    from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

    class VSkipperCpuPlatform(CpuDeviceMixin, SRTPlatform):
        _enum = PlatformEnum.OOT
        device_name = "cpu"
        device_type = "cpu"
        capabilities = PlatformCapabilities()

        def get_default_attention_backend(self) -> str:
            return "torch_native"

        def is_pin_memory_available(self, device=None) -> bool:
            return False

        def get_dispatch_key_name(self) -> str:
            return "native"

    return VSkipperCpuPlatform


def __getattr__(name):  # the class is built lazily: importing this module must not import SGLang
    if name == "VSkipperCpuPlatform":
        cls = _platform_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
