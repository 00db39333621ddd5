"""Other people's kernels as Backends (docs/vllm.md, docs/architecture.md#adding-an-adapter).

Each adapter imports an installed implementation and maps it onto the stage contract, converting
layouts explicitly and declaring what it derives and what it fixes. It copies none of their code.

- `moe_verify.adapters.vllm`: vLLM's DeepGEMM MoE path (`--backend vllm`, docs/vllm.md).
"""
