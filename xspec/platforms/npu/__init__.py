"""Ascend NPU platform plugin.

``platform.py`` holds :class:`NpuPlatform` (the only xspec module that imports
``torch_npu``, and only inside methods); ``probe.py`` finds the shared-KV sparse attention
operator in the ``torch.ops`` namespaces that register it (torch_npu's ``npu``,
vllm-ascend's ``_C_ascend``); ``emulated.py`` runs the same policy (capture +1 mapping, SAS
mode selection, validation) on the CPU. Importing this package imports neither ``torch_npu``
nor the platform classes: installing torch_npu without Ascend CANN breaks ``import torch``
itself, so nothing here may load it eagerly.
"""
