"""Quantization ablation configs: ``python -m experiments.ablate --config=configs/ablate.py[:NAME] --out=DIR``.

NAME picks a sweep (`config.variants`); every field can be overridden (``--config.n_chunks=4``):

  default    F32, Q8_0, Q4_K, IQ3_S, IQ2_S, UD-IQ3_XXS: the quick overview
  ladder     every expert format glm53 decodes, F32 down to IQ2_XXS
  roles      one matrix role (gate / up / down) in IQ2_S at a time, the others F32 (and the same in IQ3_S)
  layers     one MoE layer in IQ2_S at a time, the others F32
  imatrix    each i-quant with and without the importance matrix (+imatrix)
  prior_art  UD-IQ3_XXS with the non-expert matrices F32, int8 per channel (what the prior art serves; glm53
             only) and Q8_0 (the GGUF-expressible neighbour)
  latent     the DSA layers' MLA latent cache as int8 (one f32 absmax scale per token, the release's serving
             layout) or bfloat16 against the exact latent of the base: alone (F32 experts), with UD-IQ3_XXS
             experts, and with the prior art's int8 non-experts too (glm53 only)

Fields:
  weights         base model: an HF folder, GGUF file or Orbax checkpoint ("": the shipped glm53-mini)
  variants        comma-separated variants (glm53/ablation/variants.py: FMT, gate=..,up=..,down=.., UD-IQ3_XXS,
                  N.matrix=FMT overrides, +imatrix / +int8 / +q8_0 / +latent_int8 / +latent_bf16 / +latent_f32,
                  per_role:FMT, per_layer:FMT)
  n_ctx, n_chunks chunks of n_ctx tokens of the held-out split; the second half of each is scored
  split           the corpus split scored ("test"); tokens: a JSON file of token-id lists to score instead
  imatrix         an imatrix GGUF for +imatrix ("": computed from imatrix_chunks chunks of imatrix_split)
  layout          how glm53 keeps the quantized experts (planes / reencoded)
  kernels         the implementation of each kernel op (glm53.config.kernels.KernelConfig; every op "auto", the
                  backend's best), e.g. --config.kernels.moe=xla_quant; the base model runs the reference experts
  llama_cpp       also score every GGUF with llama.cpp (llama-cpp-python), the cross-check column
  threads         llama.cpp threads (0: all cores)
"""

import ml_collections

from glm53.config.kernels import KernelConfig

IQUANTS = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS")
LADDER = ("F32", "BF16", "F16", "Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_0", "IQ4_NL", "IQ4_XS", "Q3_K", "IQ3_S",
          "IQ3_XXS", "Q2_K", "IQ2_S", "IQ2_XS", "IQ2_XXS")  # fmt: skip

SWEEPS = {
    "default": "F32,Q8_0,Q4_K,IQ3_S,IQ2_S,UD-IQ3_XXS",
    "ladder": ",".join(LADDER),
    "roles": "per_role:IQ2_S,per_role:IQ3_S",
    "layers": "per_layer:IQ2_S",
    "imatrix": ",".join(f"{f},{f}+imatrix" for f in IQUANTS),
    "prior_art": "F32,UD-IQ3_XXS,UD-IQ3_XXS+int8,UD-IQ3_XXS+q8_0",
    "latent": "F32,F32+latent_bf16,F32+latent_int8,UD-IQ3_XXS,UD-IQ3_XXS+latent_int8,UD-IQ3_XXS+int8+latent_int8",
}


def get_config(name: str = "default") -> ml_collections.ConfigDict:
    name = name or "default"
    if name not in SWEEPS:
        raise ValueError(f"configs/ablate.py:{name}: unknown sweep; choose one of {sorted(SWEEPS)}")
    return ml_collections.ConfigDict(
        dict(
            weights="",
            variants=SWEEPS[name],
            n_ctx=256,
            n_chunks=16,
            split="test",
            tokens="",
            imatrix="",
            imatrix_split="validation",
            imatrix_chunks=16,
            layout="planes",
            kernels=KernelConfig().to_dict(),
            llama_cpp=True,
            threads=0,
        )
    )
