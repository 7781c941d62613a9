"""mlxd: an always-on local model server for MLX with journaled residency management."""

__version__ = "0.1.0"
