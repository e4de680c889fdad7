"""The models wing: what one forward is made of, and where its weights come from.

The Llama-family forward (`transformer`, its shapes in `spec`, rope in `rotary`), its attention
paths and native kernels (`csrc/`, built at first use), quantized GGUF weights, reading GGUF
files and Hugging Face checkpoints, the model folders of desktop tools, and the physical limits
(`roofline`). May import only the base modules (config, resources); everything else imports it.
"""
