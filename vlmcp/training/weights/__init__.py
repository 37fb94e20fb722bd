"""The weights written out as Hugging Face and PEFT directories: the key mapping and writers
(`hf_format`), which rank writes which whole tensors and the gathering of each share (`shards`),
one directory written by every rank with its index and marker last (`sharded_write`), the final
and `vlmcp export` model (`export`) or LoRA adapter (`lora_export`), and the weights after a step
for an inference engine, WEIGHTS/step_N (`publish`)."""
