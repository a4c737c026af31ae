# vllm-subspec on the official vLLM OpenAI server image (CUDA).
#   docker build -t vllm-subspec .
#   docker run --gpus all -p 8000:8000 -e MODEL=Qwen/Qwen2.5-7B-Instruct -e CPU_OFFLOAD_GB=10 \
#       -v ~/.cache/huggingface:/root/.cache/huggingface vllm-subspec
FROM vllm/vllm-openai:v0.32.0

WORKDIR /opt/vllm-subspec
COPY pyproject.toml README.md ./
COPY vllm_subspec ./vllm_subspec
# The plugin with its GPU extra (GemLite kernels; versions pinned in pyproject.toml); vLLM
# itself comes with the image.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[gpu]"

ENV MODEL="Qwen/Qwen2.5-7B-Instruct" \
    CPU_OFFLOAD_GB="10" \
    SUBSPEC_CONFIG='{"method": "subspec"}' \
    EXTRA_ARGS=""
EXPOSE 8000
# The image's entrypoint is `vllm serve`; the model and SubSpec settings come from env vars.
ENTRYPOINT ["/bin/sh", "-c", "exec vllm serve \"$MODEL\" --host 0.0.0.0 --port 8000 --cpu-offload-gb \"$CPU_OFFLOAD_GB\" --speculative-config \"$SUBSPEC_CONFIG\" $EXTRA_ARGS"]
