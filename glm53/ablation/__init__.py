"""Quantization ablation: what each routed-expert format costs, end to end (`python -m experiments.ablate`).

stats.py     llama-perplexity's KL-divergence statistics (the same estimators as
             tools/perplexity/perplexity.cpp), from two models' logits on the same tokens
variants.py  variant specs (a format, a per-matrix mix, UD-IQ3_XXS; +imatrix, +int8, +q8_0, +latent_*: the
             DSA latent cache layout), checked up front
imatrix.py   llama.cpp's importance matrix computed by glm53 (routed experts), its GGUF file format
llama.py     llama.cpp's logits on a GGUF through llama-cpp-python (F32 KV cache)
pipeline.py  the sweep: quantize, write DIR/<variant>.gguf, score with glm53 and llama.cpp, results.json
report.py    the markdown report and the PNGs
needle.py    needle in a haystack for a code model: trials (a value bound to a fresh name in real code, asked for
             at the end), exact match by one teacher-forced forward, base and variants on the same trials
needle_report.py  its tables (accuracy by depth x context) and heatmap PNG
"""
