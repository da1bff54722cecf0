# autofit on a CUDA machine: `docker run --gpus all autofit search --model mistral-7b --gpus 2xA10`
# The -devel image carries nvcc, which DeepSpeed needs to JIT-build its CPU-Adam and
# communication ops on first use (ZeRO offload).
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-devel

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    AUTOFIT_DB=sqlite:////data/autofit.db

WORKDIR /opt/autofit
COPY pyproject.toml README.md ./
COPY autofit ./autofit
# torch comes from the base image (it satisfies torch>=2.4, so pip keeps it)
RUN pip install ".[quant,postgres]"

VOLUME /data
ENTRYPOINT ["autofit"]
CMD ["--help"]
