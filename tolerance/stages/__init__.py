"""The per-stage judgment `tolerance.compare` drives: the comparers of the stages held exactly
(`exact`: route, quant_input, align, permute) and within bounds (`bounded`: the GEMMs, act_quant,
gather, shared), and what they share: the comparison context (`context`), the check builders
(`checks`), the layout decoders (`layouts`), the legitimate recipes (`recipes`) and the chained
slot order (`slots`).
"""
