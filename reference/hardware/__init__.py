"""The SM90 hardware the golden emulates, bit for bit: the Hopper FP8 tensor core of DeepGEMM's
GEMM (`tensor_core`), and the H200's recorded approximate fp32 steps: the compiled Triton gate
(`gate_table`) and other engines' quotients (`quotient_table`), read from reference/data/.
"""
