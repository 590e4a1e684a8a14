"""The PyTorch runtime: multi-tenant LoRA trainer (transformers + peft) and a batched sampler."""
