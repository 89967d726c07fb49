"""loom's Llama-style GPT: config (shapes and presets, torch-free), model, tensor-parallel plan,
pipeline stages and the adapter that hands them to loom/parallel."""
