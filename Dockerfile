# CPU image of the proxy (the GPU image adds the `gpu` extra on an NVIDIA CUDA base).
FROM python:3.11-slim
WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 HF_HUB_OFFLINE=1 FLEETCACHE_DATA_DIR=/data
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY proxy proxy
COPY cache cache
COPY indexes indexes
COPY engines engines
COPY features features
RUN pip install .
EXPOSE 8000
CMD ["fleetcache", "serve", "--host", "0.0.0.0", "--port", "8000"]
