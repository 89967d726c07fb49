"""Hugging Face Llama/Mistral/Qwen2 `*ForCausalLM` decoders: adapter, pipeline stage and
tensor-parallel plan."""
