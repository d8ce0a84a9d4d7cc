"""The NCCL model: every communication pattern of the executor replayed against NCCL's ordering rules (ptdp-facts.md, §NCCL), so a schedule that passes cannot hang on GPUs."""
