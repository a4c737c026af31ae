"""vllm-subspec: lossless Substitute Speculative Decoding (SubSpec) for offloaded LLMs in vLLM."""

__version__ = "0.2.0"
