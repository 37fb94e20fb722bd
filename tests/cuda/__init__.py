"""CUDA tests: run only with VLMCP_TEST_CUDA=1 (`make gpu-check`)."""
