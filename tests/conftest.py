import os

# Fake CPU devices for sharding tests; must be set before JAX is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the test-only audio+video family (tests/toyfamily) goes through every registry-wide test
os.environ.setdefault("VIDAX_FAMILIES", "tests.toyfamily.recipes")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


from tests.prefect_env import prefect_server  # noqa: E402,F401 - session fixture, started on first use
