"""The OpenAI-compatible HTTP API in front of whichever engine the Service runs."""

from engines.api.app import create_app

__all__ = ["create_app"]
