from setuptools import find_packages, setup

setup(
    name="torchao_optim",
    version="0.1.0",
    description="Low-bit optimizer state for PyTorch, as tensor subclasses: 8-bit AdamW with a quarter of the state memory",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["torchao_optim", "torchao_optim.*"]),
    # the fused CPU step's source, compiled on first use (torchao_optim/kernels/cpu.py): no build step here
    package_data={"torchao_optim.kernels": ["cpu_step.c"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.11"],
    extras_require={
        # triton (and numpy, its interpreter's arrays): the fused kernels also run on the CPU, so the tests cover them
        # and the training frameworks test/integrations/ runs our optimizers under (the versions tested there);
        # torchtune and torchtitan are left out: docs/integrations.md says why
        "test": ["pytest", "expecttest", "hypothesis", "numpy", "tqdm", "triton",
                 "transformers>=5.24", "accelerate>=1.16", "lightning>=2.6", "peft>=0.21"],
        "bench": ["tqdm", "matplotlib"],
        "finetune": ["timm", "datasets", "tqdm", "matplotlib"],
    },
    license="BSD-3-Clause",
)
