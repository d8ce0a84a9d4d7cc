"""The NCCL model: every communication pattern of the executor replayed against NCCL's ordering rules (docs/references.md, §NCCL), so a schedule that passes cannot hang on GPUs."""
