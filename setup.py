"""fairseq_fastgen: fast sequence generation for fairseq (a --user-dir plugin)."""

from setuptools import find_packages, setup

setup(
    name="fairseq_fastgen",
    version="0.1.0",
    description="Fast decoders for fairseq: blockwise parallel decoding, streaming variable-width "
    "beam search, cluster-projected vocabulary, FastSeq optimizations",
    python_requires=">=3.11",
    # fastgen_demo: make demo's corpus, toy models and demo, beside the plugin (which never imports it)
    packages=find_packages(include=["fairseq_fastgen", "fairseq_fastgen.*", "fastgen_demo"])
    + ["fairseq_fastgen.kernels"],
    # CUDA sources live in the checkout's kernels/; a normal install copies them
    # into the package as fairseq_fastgen/kernels/*.cu
    package_dir={"fairseq_fastgen.kernels": "kernels"},
    package_data={"fairseq_fastgen.kernels": ["*.cu", "*.cpp", "emu/*.h", "emu/*.cu"]},
    include_package_data=True,
    install_requires=[
        "torch>=2.6",
        "fairseq-fixed==0.12.3.1",
        "numpy",
        "sacrebleu>=2.0",
        "tqdm",
        "faiss-cpu",
        "matplotlib",
        "aiohttp>=3.9",  # fastgen-serve
    ],
    extras_require={
        "gpu": ["cupy-cuda12x", "faiss-gpu-cu12"],
        "bench": ["ctranslate2"],
        "ray": ["ray[serve]>=2.30"],  # fastgen-serve --ray-replicas
    },
    entry_points={
        "console_scripts": [
            "fastgen-bench=fairseq_fastgen.bench:cli_main",
            "fastgen-distill=fairseq_fastgen.distill:cli_main",
            "fastgen-serve=fairseq_fastgen.serve:cli_main",
            "fastgen-train-clusters=fairseq_fastgen.cluster.train:cli_main",
        ]
    },
)
