"""The fault-injection suite shares the integration tests' tiny MLX demo model."""

from tests.integration.conftest import tiny_model

__all__ = ["tiny_model"]
