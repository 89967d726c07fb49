"""Models loom trains, each in its own folder with what parallelizes it (its tensor-parallel plan,
pipeline stage builder and adapter): loom's GPT (gpt/) and Hugging Face decoders (hf/).
`loom.models.registry.adapter_for` picks a model's adapter. Nothing here imports torch at
package level: the planner reads loom.models.gpt.config."""
