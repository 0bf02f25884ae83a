"""The OpenAI-compatible REST gateway: a stateless Starlette app in front of one or more engines.

It talks to engines only through the generated gRPC stubs (``ignis.v1``); it
never imports engine or tierstore code.
"""
