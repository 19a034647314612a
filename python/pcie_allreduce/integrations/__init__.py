"""Adapters for serving engines (SGLang, vLLM) live here."""
