"""The Serve application; ``cluster.serve:build_app`` is the KubeRay ``import_path``."""

from cluster.serve.app import build_app

__all__ = ["build_app"]
