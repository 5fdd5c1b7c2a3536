"""glm53: GLM-5.3-Flash in JAX / Flax NNX with GGUF-resident experts."""

from setuptools import find_packages, setup

TEST = [
    "pytest>=8",
    "pytest-xdist",  # the README test command runs the suite on every core (-n auto --dist loadfile)
    "pytest-timeout",  # a test that hangs fails with every thread's stack (pyproject.toml: timeout) instead of stalling CI
    "hypothesis>=6.100",
    "gguf==0.19.0",
    "torch==2.13.0",
    "transformers==5.23.0",
    "llama-cpp-python==0.3.36",
    "fla-core==0.6.0",
    "einops",
    "ruff",
    "matplotlib",  # the training run's loss-curve PNG (glm53/train/plot.py)
]
SERVE = ["fastapi", "uvicorn", "pydantic>=2", "prometheus-client"]  # experiments.serve (glm53/serving/app.py)
TEST += SERVE + ["openai", "anthropic"]  # the server is tested with the official SDKs
TEST += ["schemathesis"]  # fuzzing the server from its OpenAPI schema (tests/test_serving_fuzz.py)

setup(
    name="glm53",
    version="0.1.0",
    description="GLM-5.3-Flash in JAX / Flax NNX: configs, GGUF codebook experts, Pallas kernels",
    # experiments (the entry points, `python -m experiments.<name>`) and configs (`--config=NAME`) install too, so
    # both work from any folder
    packages=find_packages(include=["glm53", "glm53.*", "kernels", "kernels.*", "experiments", "configs"]),
    # The model shipped as the entry points' default (glm53/assets/mini/: config, weights, tokenizer, card).
    # + the C++ source of the CPU quantized-expert kernel (kernels/moe/cpu_ffi.py compiles it on first use)
    package_data={"glm53.assets": ["*/*"], "experiments": ["*.sh"], "kernels": ["csrc/*.h"], **{f"kernels.{op}": ["csrc/*.cc"] for op in ("moe", "matmul", "kda")}},
    python_requires=">=3.10",
    install_requires=[
        "jax==0.10.2",
        "jaxlib==0.10.2",
        "flax>=0.12",
        "optax",
        "orbax-checkpoint",
        "ml_collections",
        "absl-py",
        "numpy",
        "safetensors",
        "tokenizers",
        "jinja2",  # chat templates (glm53/tokenizer.py)
        "gguf==0.19.0",
        "tqdm",
        "packaging",  # the training corpus's installed packages (glm53/data/packages.py)
    ],
    extras_require={
        "test": TEST,
        "serve": SERVE,
        "plot": ["matplotlib"],  # the training run's loss-curve PNG (skipped with a log line without it)
        # libtpu: compiles for TPU on any host (tests marked tpu_compile); flatbuffers: jax.export serialization
        "tpu": ["jax[tpu]==0.10.2", "flatbuffers"],
    },
)
