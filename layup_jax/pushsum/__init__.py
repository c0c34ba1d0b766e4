"""Push-sum's maths (Kempe et al. 2003) as LayUp uses it: no threads, no devices, no state.

Owns: the merge of a received stage and the weights it carries (`mixing`), the consensus model
and the replicas' disagreement (`consensus`), compressed sends with error feedback
(`compression`) and replicas saved on M devices resumed on M' (`remap`). Pure functions of
arrays and host numbers, tested against hand-computed values; imports nothing of the project.
"""
