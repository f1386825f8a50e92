"""Adapters between oarlock and other systems' own APIs.

``oarlock.integrations.vllm``: the ``oarlock`` weight-transfer back end of vLLM (docs/vllm.md).
"""
