"""Serving: the launcher, the OpenAI-compatible API server and the interactive shell. Its entry
point is `minisgl.server.cli:main`."""
