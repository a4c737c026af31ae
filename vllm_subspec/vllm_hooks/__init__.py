"""vllm_hooks"""
