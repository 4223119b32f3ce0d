"""Weights beyond a float safetensors checkpoint, kept apart from the model's forward.

gguf.py reads llama.cpp's GGUF files (gguf_layout.py checks their bytes, gguf_metadata.py their
metadata, gguf_quant.py lays out their blocks); quant.py is weight-only quantization (int8, int4,
fp8 layers and their kernels); packed.py keeps float32 weights packed for oneDNN; quantize_model.py
puts these layers in a loaded model. llama.py needs none of it: a projection runs the `quantized`
layer it is given, or its float weight. Imports: models/ and below (params, core).
"""
